// Dead letters: filter by subscription, read an entry (its event pretty-printed,
// binary data shown as bytes), its reason, attempts and redrives; redrive or delete
// one entry or a selection.

import * as api from '../api.js';
import { h, table, fmtTime, problem, confirmDialog, adminButton } from '../dom.js';

const enc = encodeURIComponent;

function bytesOf(b64) {
  try {
    const bin = atob(b64);
    return Uint8Array.from(bin, (c) => c.charCodeAt(0));
  } catch {
    return null;
  }
}

function hexdump(bytes, max = 512) {
  const lines = [];
  for (let i = 0; i < Math.min(bytes.length, max); i += 16) {
    const row = [...bytes.slice(i, i + 16)];
    const hex = row.map((b) => b.toString(16).padStart(2, '0')).join(' ');
    const text = row.map((b) => (b >= 32 && b < 127 ? String.fromCharCode(b) : '.')).join('');
    lines.push(`${i.toString(16).padStart(6, '0')}  ${hex.padEnd(47)}  ${text}`);
  }
  if (bytes.length > max) lines.push(`… ${bytes.length - max} more bytes`);
  return lines.join('\n');
}

function eventView(event) {
  if (!event) return h('p', { class: 'muted' }, 'The event is not included in this entry.');
  const parts = [h('h3', {}, 'Event'), h('pre', { class: 'json', 'data-test': 'event-json' }, JSON.stringify(event, null, 2))];
  if (typeof event.data_base64 === 'string') {
    const bytes = bytesOf(event.data_base64);
    parts.push(h('h3', {}, 'Binary data'), bytes
      ? [h('p', { 'data-test': 'binary-size' }, `${bytes.length} bytes${event.datacontenttype ? ` of ${event.datacontenttype}` : ''}`), h('pre', { class: 'hex', 'data-test': 'hexdump' }, hexdump(bytes))]
      : h('p', { class: 'bad' }, 'data_base64 is not valid base64'));
  }
  return parts;
}

export function mount(el, ctx) {
  const filter = h('select', { id: 'dl-sub', name: 'subscription' }, h('option', { value: '' }, 'every subscription'));
  const listSlot = h('div', {}, h('p', { class: 'muted' }, 'Loading…'));
  const bulk = h('div', { class: 'inline bulk' });
  const detailSlot = h('div', { class: 'detail', 'aria-live': 'polite' });
  const status = h('div', { 'data-test': 'dl-status', 'aria-live': 'polite' });
  const more = h('button', { type: 'button', hidden: true }, 'Load more');
  let entries = [];
  let cursor = null;
  const selected = new Set();
  const chosen = ctx.params.get('subscription') || '';

  el.append(h('h1', {}, 'Dead letters'),
    h('form', { class: 'inline' }, h('label', { for: 'dl-sub' }, 'Subscription'), filter),
    status, bulk, listSlot, more, detailSlot);

  async function act(ids, what) {
    const verb = what === 'redrive' ? 'Redrive' : 'Delete';
    if (what === 'delete') {
      const ok = await confirmDialog(`Delete ${ids.length} dead letter${ids.length > 1 ? 's' : ''}?`,
        h('p', {}, 'The events are gone for good: their subscriptions will never get them again.'));
      if (!ok) return;
    }
    let done = 0;
    const failed = [];
    for (const id of ids) {
      try {
        if (what === 'redrive') await api.call('POST', `/v1/deadletters/${enc(id)}/redrive`);
        else await api.call('DELETE', `/v1/deadletters/${enc(id)}`);
        done += 1;
      } catch (e) {
        failed.push([id, e]);
      }
    }
    status.replaceChildren(h('p', { class: done ? 'ok' : '' }, `${verb}: ${done} of ${ids.length} done.`),
      ...failed.map(([id, e]) => problem(e, id)));
    selected.clear();
    await load(true);
  }

  function renderBulk() {
    const ids = [...selected];
    bulk.replaceChildren(h('span', { 'data-test': 'selected' }, `${ids.length} selected`),
      adminButton(ctx, 'Redrive selected', { 'data-test': 'redrive-selected', disabled: !ids.length }, () => act(ids, 'redrive')),
      adminButton(ctx, 'Delete selected', { class: 'danger', 'data-test': 'delete-selected', disabled: !ids.length }, () => act(ids, 'delete')));
  }

  async function show(id) {
    detailSlot.replaceChildren(h('p', { class: 'muted' }, 'Loading…'));
    try {
      const e = await api.get(`/v1/deadletters/${enc(id)}`);
      detailSlot.replaceChildren(h('h2', {}, `Entry ${e.id}`),
        h('dl', { class: 'facts', 'data-test': 'entry' },
          h('dt', {}, 'Subscription'), h('dd', {}, e.subscription),
          h('dt', {}, 'Topic, partition, offset'), h('dd', {}, `${e.topic} / ${e.partition} @ ${e.offset}`),
          h('dt', {}, 'State'), h('dd', {}, e.state || 'dead'),
          h('dt', {}, 'Reason'), h('dd', { 'data-test': 'entry-reason' }, e.reason || '–'),
          h('dt', {}, 'Attempts'), h('dd', {}, String(e.attempts)),
          h('dt', {}, 'Redrives'), h('dd', {}, String(e.redrives ?? 0)),
          h('dt', {}, 'First attempt'), h('dd', {}, fmtTime(e.first_attempt_at)),
          h('dt', {}, 'Dead-lettered'), h('dd', {}, fmtTime(e.dead_lettered_at)),
          h('dt', {}, 'Instance'), h('dd', {}, e.instance || '–')),
        h('div', { class: 'actions' },
          adminButton(ctx, 'Redrive', { 'data-test': 'redrive-one' }, () => act([e.id], 'redrive')),
          adminButton(ctx, 'Delete', { class: 'danger', 'data-test': 'delete-one' }, () => act([e.id], 'delete'))),
        h('div', { class: 'event' }, eventView(e.event)));
    } catch (err) {
      detailSlot.replaceChildren(problem(err, id));
    }
  }

  function renderList() {
    listSlot.replaceChildren(entries.length ? table([
      ['', (e) => {
        const box = h('input', { type: 'checkbox', 'aria-label': `select ${e.id}`, checked: selected.has(e.id), 'data-id': e.id });
        box.addEventListener('change', () => { if (box.checked) selected.add(e.id); else selected.delete(e.id); renderBulk(); });
        return box;
      }],
      ['Dead-lettered', (e) => fmtTime(e.dead_lettered_at)],
      ['Subscription', (e) => e.subscription],
      ['Where', (e) => `${e.topic}/${e.partition}@${e.offset}`],
      ['Event id', (e) => (e.event && e.event.id) || '–'],
      ['Attempts', (e) => String(e.attempts), 'num'],
      ['Reason', (e) => e.reason || '–'],
      ['Redrives', (e) => String(e.redrives ?? 0), 'num'],
      ['State', (e) => e.state || 'dead'],
      ['', (e) => h('button', { type: 'button', class: 'link', 'data-test': 'view-entry', 'data-id': e.id, onclick: () => show(e.id) }, 'View')],
    ], entries, { test: 'deadletters', rowAttrs: (e) => ({ 'data-id': e.id }) })
      : h('p', { class: 'muted', 'data-test': 'dl-empty' }, 'No dead letters.'));
    more.hidden = !cursor;
    renderBulk();
  }

  async function load(fresh) {
    const sub = filter.value;
    const q = `/v1/deadletters?limit=100${sub ? `&subscription=${enc(sub)}` : ''}${!fresh && cursor ? `&cursor=${enc(cursor)}` : ''}`;
    try {
      const page = await api.get(q);
      entries = fresh ? page.entries : entries.concat(page.entries);
      cursor = page.next_cursor || null;
      renderList();
    } catch (e) {
      listSlot.replaceChildren(problem(e));
      bulk.replaceChildren();
    }
  }

  filter.addEventListener('change', () => { selected.clear(); detailSlot.replaceChildren(); load(true); });
  more.addEventListener('click', () => load(false));
  api.all('/v1/subscriptions', 'subscriptions').then((subs) => {
    filter.append(...subs.map((x) => h('option', { value: x.name }, x.name)));
    filter.value = chosen;
    load(true);
  }).catch(() => load(true));
  return { stop() {} };
}
