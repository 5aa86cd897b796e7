// Topics: partitions, end offsets, and the publish rate this instance sees (from
// /metrics, plotted live).

import * as api from '../api.js';
import { h, table, fmtNum, fmtRate, sparkline, poll } from '../dom.js';
import { parse, byLabel, Rates } from '../metrics.js';

const rates = new Rates(90);
// Topics whose end offsets are read on every refresh (one request each).
const SHOWN = 200;

export function mount(el) {
  const errors = h('div');
  const body = h('div', {}, h('p', { class: 'muted' }, 'Loading…'));
  el.append(h('h1', {}, 'Topics'), errors, body);
  return poll(async () => {
    const list = await api.all('/v1/topics', 'topics');
    const shown = list.slice(0, SHOWN);
    const [details, metrics] = await Promise.all([
      Promise.all(shown.map((t) => api.get(`/v1/topics/${encodeURIComponent(t.name)}`))),
      api.get('/metrics').then(parse).catch(() => null),
    ]);
    const now = metrics ? rates.update(byLabel(metrics, 'meshd_published_events_total', 'topic')) : new Map();
    body.replaceChildren(
      list.length ? table([
        ['Topic', (t) => h('strong', {}, t.name)],
        ['Partitions', (t) => String(t.partitions), 'num'],
        ['End offsets', (t) => h('span', { class: 'offsets' }, (t.end_offsets || []).map((o, p) => h('span', { class: 'offset', title: `partition ${p}` }, `${p}:${fmtNum(o)}`)))],
        ['Events', (t) => fmtNum((t.end_offsets || []).reduce((a, b) => a + b, 0)), 'num'],
        ['Published/s', (t) => fmtRate(now.get(t.name) ?? (metrics ? 0 : null)), 'num'],
        ['Last 3 min', (t) => sparkline(rates.series(t.name), `publish rate of ${t.name}`)],
      ], details, { test: 'topics', caption: metrics ? 'Publish rates are what this instance accepted (its /metrics).' : 'Publish rates need /metrics, which this token may not read.' })
        : h('p', { class: 'muted' }, 'No topics yet. Create one with PUT /v1/topics/{name} or `meshd topics create`.'),
      list.length > SHOWN ? h('p', { class: 'muted' }, `Showing the first ${SHOWN} of ${list.length} topics.`) : null,
    );
  }, 3000, errors);
}
