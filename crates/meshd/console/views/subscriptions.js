// Subscriptions: the list (admin), and per subscription its statistics per partition
// (GET /v1/subscriptions/{name}/stats): committed offset, backlog, in flight, waiting
// retries, parked, dead-lettering, ack and redelivery rates. An offset reset shows
// what it will redeliver (or skip) before it is made.

import * as api from '../api.js';
import { h, table, fmtNum, fmtRate, poll, problem, confirmDialog, adminButton } from '../dom.js';

const enc = encodeURIComponent;

function picker(ctx, name) {
  const input = h('input', { id: 'sub-name', name: 'name', value: name || '', required: true, list: 'sub-names', autocomplete: 'off' });
  const form = h('form', { class: 'inline', 'data-test': 'sub-picker' }, h('label', { for: 'sub-name' }, 'Subscription'), input, h('button', { type: 'submit' }, 'Show'));
  form.addEventListener('submit', (ev) => { ev.preventDefault(); location.hash = `#/subscriptions?name=${enc(input.value.trim())}`; });
  return form;
}

function list(ctx, slot) {
  return poll(async () => {
    const subs = await api.all('/v1/subscriptions', 'subscriptions');
    slot.replaceChildren(subs.length ? table([
      ['Name', (x) => h('a', { href: `#/subscriptions?name=${enc(x.name)}` }, x.name)],
      ['Topic', (x) => x.topic],
      ['Delivery', (x) => (x.push ? `push ${x.push.url}` : 'pull')],
      ['Max attempts', (x) => String(x.max_attempts), 'num'],
      ['Ack timeout', (x) => `${x.ack_timeout_ms} ms`, 'num'],
      ['Ordering', (x) => x.ordering || 'none'],
      ['Filter', (x) => (x.filter ? JSON.stringify(x.filter) : '–')],
    ], subs, { test: 'subscriptions' }) : h('p', { class: 'muted' }, 'No subscriptions yet.'));
  }, 5000, null);
}

const rates = new Map(); // name -> {at, parts: Map p -> counters}

function rateOf(name, parts) {
  const at = performance.now();
  const prev = rates.get(name);
  const out = new Map();
  for (const p of parts) {
    if (p.available === false) continue;
    const before = prev && prev.parts.get(p.partition);
    const dt = prev ? (at - prev.at) / 1000 : 0;
    const r = (k) => (before && dt > 0 ? Math.max(0, p[k] - before[k]) / dt : null);
    out.set(p.partition, { acks: r('acked_total'), redeliveries: r('redelivered_total') });
  }
  rates.set(name, { at, parts: new Map(parts.filter((p) => p.available !== false).map((p) => [p.partition, p])) });
  return out;
}

function resetForm(ctx, name, latest) {
  const partition = h('select', { id: 'reset-partition', name: 'partition' });
  const offset = h('input', { id: 'reset-offset', name: 'offset', type: 'number', min: 0, required: true, inputmode: 'numeric' });
  const result = h('div', { 'data-test': 'reset-result', 'aria-live': 'polite' });
  const fill = () => {
    const have = new Set([...partition.options].map((o) => o.value));
    for (const p of latest().filter((x) => x.available !== false)) {
      if (!have.has(String(p.partition))) partition.append(h('option', { value: p.partition }, String(p.partition)));
    }
  };
  const go = async () => {
    fill();
    const p = latest().find((x) => String(x.partition) === partition.value);
    const n = Number(offset.value);
    if (!p || offset.value === '' || !Number.isInteger(n) || n < 0) {
      result.replaceChildren(problem({ title: 'Choose a partition and an offset', detail: 'the offset is a whole number from 0 to the partition\'s end offset' }));
      return;
    }
    let what;
    if (n < p.committed) what = `Events ${n} to ${p.committed - 1} of partition ${p.partition} (${p.committed - n} events) will be delivered again to ${name}, with a fresh attempt count.`;
    else if (n > p.committed) what = `Events ${p.committed} to ${n - 1} of partition ${p.partition} (${n - p.committed} events) will be skipped: ${name} never receives them.`;
    else what = `The committed offset of partition ${p.partition} is already ${n}: nothing changes.`;
    const ok = await confirmDialog(`Reset ${name}, partition ${p.partition}, to offset ${n}?`,
      h('p', { 'data-test': 'reset-what' }, what),
      h('p', { class: 'muted' }, `Committed now: ${fmtNum(p.committed)}; end of the log: ${fmtNum(p.end_offset)}; in flight: ${fmtNum(p.in_flight)} (their acks no longer count after the reset).`));
    if (!ok) return;
    try {
      const r = await api.call('PUT', `/v1/subscriptions/${enc(name)}/offsets/${p.partition}`, { offset: n });
      result.replaceChildren(h('p', { class: 'ok' }, `Partition ${p.partition} reset to ${r && r.committed !== undefined ? r.committed : n}.`));
    } catch (e) {
      result.replaceChildren(problem(e, 'Reset'));
    }
  };
  const form = h('div', { class: 'reset', 'data-test': 'reset' },
    h('h2', {}, 'Reset an offset'),
    h('div', { class: 'inline' }, h('label', { for: 'reset-partition' }, 'Partition'), partition,
      h('label', { for: 'reset-offset' }, 'New committed offset'), offset,
      adminButton(ctx, 'Reset…', { 'data-test': 'reset-button' }, go)),
    result);
  return { form, fill };
}

function detail(ctx, name, slot) {
  let latest = [];
  const statsSlot = h('div', {}, h('p', { class: 'muted' }, 'Loading…'));
  const settings = h('div');
  const reset = resetForm(ctx, name, () => latest);
  slot.replaceChildren(h('h2', {}, name), settings, statsSlot, reset.form);
  if (ctx.role !== 'client') {
    api.get(`/v1/subscriptions/${enc(name)}`).then((x) => settings.replaceChildren(h('p', { class: 'muted', 'data-test': 'settings' },
      `topic ${x.topic} · ${x.push ? `push to ${x.push.url}` : 'pull'} · max ${x.max_attempts} attempts · ack timeout ${x.ack_timeout_ms} ms · ordering ${x.ordering || 'none'}`)))
      .catch((e) => settings.replaceChildren(problem(e)));
  }
  const errors = h('div');
  slot.insertBefore(errors, statsSlot);
  return poll(async () => {
    const st = await api.get(`/v1/subscriptions/${enc(name)}/stats`);
    latest = st.partitions || [];
    reset.fill();
    const r = rateOf(name, latest);
    const known = latest.filter((p) => p.available !== false);
    const sum = (k) => known.reduce((a, p) => a + (p[k] || 0), 0);
    const cols = [
      ['Partition', (p) => String(p.partition), 'num'],
      ['Committed', (p) => fmtNum(p.committed), 'num'],
      ['End', (p) => fmtNum(p.end_offset), 'num'],
      ['Backlog', (p) => fmtNum(p.backlog), 'num'],
      ['In flight', (p) => fmtNum(p.in_flight), 'num'],
      ['Waiting retries', (p) => fmtNum(p.waiting_retries), 'num'],
      ['Parked', (p) => fmtNum(p.parked), 'num'],
      ['Dead-lettering', (p) => fmtNum(p.dead_lettering), 'num'],
      ['Acks/s', (p) => fmtRate(r.get(p.partition)?.acks), 'num'],
      ['Redeliveries/s', (p) => fmtRate(r.get(p.partition)?.redeliveries), 'num'],
      ['Delivered', (p) => fmtNum(p.delivered_total), 'num'],
      ['Dead-lettered', (p) => fmtNum(p.dead_lettered_total), 'num'],
      ['Owner', (p) => p.owner || '–'],
    ];
    const rows = latest.map((p) => (p.available === false ? { ...p, unavailable: true } : p));
    statsSlot.replaceChildren(
      h('p', { class: 'totals', 'data-test': 'totals' }, `backlog ${fmtNum(sum('backlog'))} · in flight ${fmtNum(sum('in_flight'))} · waiting retries ${fmtNum(sum('waiting_retries'))} · parked ${fmtNum(sum('parked'))} · dead-lettering ${fmtNum(sum('dead_lettering'))}`),
      table(cols.map(([label, cell, cls]) => [label, (p) => (p.unavailable ? (label === 'Partition' ? String(p.partition) : label === 'Committed' ? h('span', { class: 'bad' }, `unavailable: ${p.detail}`) : '') : cell(p)), cls]), rows,
        { test: 'stats', caption: 'Counters count since the process serving the partition started; rates are between the console\'s last two reads.' }),
    );
  }, 2000, errors);
}

export function mount(el, ctx) {
  const name = ctx.params.get('name');
  const top = h('div');
  const slot = h('div');
  el.append(h('h1', {}, 'Subscriptions'), picker(ctx, name), top, slot);
  const pollers = [];
  if (ctx.role !== 'client') {
    const dl = h('datalist', { id: 'sub-names' });
    el.append(dl);
    api.all('/v1/subscriptions', 'subscriptions').then((subs) => dl.replaceChildren(...subs.map((x) => h('option', { value: x.name })))).catch(() => {});
    if (!name) pollers.push(list(ctx, top));
  } else if (!name) {
    top.append(h('p', { class: 'muted' }, 'Listing subscriptions needs an admin token; a client token can show the statistics of a subscription it names.'));
  }
  if (name) pollers.push(detail(ctx, name, slot));
  return { stop() { pollers.forEach((p) => p.stop()); } };
}
