// Live: a tail of a subscription through its Server-Sent Events stream (read with
// fetch, so the token goes in the Authorization header). Without "ack", what the
// tail receives stays leased until its ack timeout and then goes to a consumer
// again; with it, the tail consumes.

import * as api from '../api.js';
import { h, problem } from '../dom.js';

const KEEP = 200;
const enc = encodeURIComponent;

function preview(event) {
  if (!event) return '';
  const d = event.data !== undefined ? JSON.stringify(event.data) : event.data_base64 !== undefined ? `binary, ${Math.floor((event.data_base64.length * 3) / 4)} bytes` : '';
  return d.length > 120 ? `${d.slice(0, 117)}…` : d;
}

export function mount(el, ctx) {
  const name = h('input', { id: 'live-sub', name: 'subscription', required: true, value: ctx.params.get('name') || '', list: 'live-names', autocomplete: 'off' });
  const inFlight = h('input', { id: 'live-max', name: 'max_in_flight', type: 'number', min: 1, max: 10000, value: 100 });
  const ack = h('input', { id: 'live-ack', name: 'ack', type: 'checkbox' });
  const startB = h('button', { type: 'submit', 'data-test': 'live-start' }, 'Start');
  const stopB = h('button', { type: 'button', 'data-test': 'live-stop', disabled: true }, 'Stop');
  const state = h('p', { class: 'muted', 'data-test': 'live-state', 'aria-live': 'polite' }, 'Not streaming.');
  const errors = h('div');
  const rows = h('tbody');
  const names = h('datalist', { id: 'live-names' });
  const form = h('form', { class: 'inline' },
    h('label', { for: 'live-sub' }, 'Subscription'), name,
    h('label', { for: 'live-max' }, 'Max in flight'), inFlight,
    h('label', { for: 'live-ack', class: 'check' }, ack, ' ack what arrives'), startB, stopB);
  el.append(h('h1', {}, 'Live'),
    h('p', { class: 'muted' }, 'Without “ack what arrives”, deliveries shown here stay leased to this tail until their ack timeout, then go to consumers again (with the next attempt number); the stream holds at most “max in flight” of them.'),
    form, names, state, errors,
    h('div', { class: 'table-wrap' }, h('table', { 'data-test': 'live' },
      h('thead', {}, h('tr', {}, ['Received', 'Partition', 'Offset', 'Attempt', 'Event id', 'Type', 'Data'].map((c) => h('th', { scope: 'col' }, c)))),
      rows)));
  if (ctx.role !== 'client') {
    api.all('/v1/subscriptions', 'subscriptions').then((subs) => names.replaceChildren(...subs.map((x) => h('option', { value: x.name })))).catch(() => {});
  }

  let abort = null;
  let count = 0;
  let pendingAcks = [];
  let ackTimer = null;

  const flushAcks = async (sub) => {
    ackTimer = null;
    const ids = pendingAcks;
    pendingAcks = [];
    if (!ids.length) return;
    try {
      await api.call('POST', `/v1/subscriptions/${enc(sub)}/ack`, { delivery_ids: ids });
    } catch (e) {
      errors.replaceChildren(problem(e, 'Ack'));
    }
  };

  const stop = () => {
    if (abort) abort.abort();
    abort = null;
    startB.disabled = false;
    stopB.disabled = true;
  };

  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    stop();
    const sub = name.value.trim();
    const max = Math.max(1, Math.min(10000, Number(inFlight.value) || 100));
    errors.replaceChildren();
    rows.replaceChildren();
    count = 0;
    abort = new AbortController();
    startB.disabled = true;
    stopB.disabled = false;
    state.textContent = `Streaming ${sub}…`;
    state.dataset.state = 'streaming';
    const acking = ack.checked;
    try {
      await api.stream(`/v1/subscriptions/${enc(sub)}/stream?max_in_flight=${max}`, (kind, data) => {
        if (kind !== 'delivery') return;
        let d;
        try { d = JSON.parse(data); } catch { return; }
        count += 1;
        const e = d.event || {};
        rows.prepend(h('tr', { 'data-delivery': d.delivery_id, 'data-event-id': e.id || '' },
          h('td', {}, new Date().toLocaleTimeString()), h('td', { class: 'num' }, String(d.partition)), h('td', { class: 'num' }, String(d.offset)),
          h('td', { class: 'num' }, String(d.attempt)), h('td', {}, e.id || ''), h('td', {}, e.type || ''), h('td', { class: 'mono' }, preview(e))));
        while (rows.children.length > KEEP) rows.lastElementChild.remove();
        state.textContent = `Streaming ${sub}: ${count} received${acking ? ', acked' : ''}.`;
        if (acking) {
          pendingAcks.push(d.delivery_id);
          if (!ackTimer) ackTimer = setTimeout(() => flushAcks(sub), 200);
        }
      }, abort.signal);
      state.textContent = `The stream of ${sub} ended (${count} received).`;
    } catch (e) {
      errors.replaceChildren(problem(e, sub));
      state.textContent = 'Not streaming.';
    }
    state.dataset.state = 'stopped';
    stop();
  });
  stopB.addEventListener('click', stop);
  return { stop };
}
