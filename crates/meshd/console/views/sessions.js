// Sessions: the live ones, refreshed every two seconds.

import * as api from '../api.js';
import { h, table, fmtNum, poll } from '../dom.js';

export function mount(el) {
  const errors = h('div');
  const body = h('div', {}, h('p', { class: 'muted' }, 'Loading…'));
  el.append(h('h1', {}, 'Sessions'), errors, body);
  return poll(async () => {
    const list = await api.all('/v1/sessions', 'sessions');
    body.replaceChildren(list.length ? table([
      ['Client id', (x) => h('strong', {}, x.client_id)],
      ['Session', (x) => x.session_id],
      ['Epoch', (x) => fmtNum(x.epoch), 'num'],
      ['Instance', (x) => x.instance],
      ['TTL', (x) => `${fmtNum(x.ttl_ms)} ms`, 'num'],
    ], list, { test: 'sessions', caption: 'A session ends when its client stops heartbeating for its TTL, or is taken over by a newer session of the same client id (a higher epoch).' })
      : h('p', { class: 'muted', 'data-test': 'sessions-empty' }, 'No live sessions.'));
  }, 2000, errors);
}
