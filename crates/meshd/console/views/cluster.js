// Cluster: the instances with live membership leases, Meta and log health, every
// partition with its owner and epoch as a grid coloured by owner, and the ownership
// changes seen while the console is open.

import * as api from '../api.js';
import { h, s, table, fmtTime, fmtBytes, colour, poll } from '../dom.js';

const KEEP_MS = 10 * 60 * 1000;
// Partitions drawn in the timeline.
const ROWS = 64;
// Snapshots of ownership (kept across view switches while the page is open).
const history = [];
const changes = [];

// Embedded mode has no owners in Meta: this instance serves every partition.
let thisInstance = null;

function ownerName(p) {
  return p.owner || thisInstance || 'local';
}

function record(c) {
  const at = Date.now();
  const owners = new Map(c.partitions.map((p) => [`${p.topic}/${p.partition}`, [ownerName(p), p.epoch]]));
  const last = history[history.length - 1];
  if (last) {
    for (const [key, [owner, epoch]] of owners) {
      const before = last.owners.get(key);
      if (before && before[0] !== owner) changes.push({ at, key, from: before[0], to: owner, epoch });
    }
  }
  history.push({ at, owners });
  while (history.length && history[0].at < at - KEEP_MS) history.shift();
  while (changes.length > 50) changes.shift();
}

function swatch(name) {
  const sw = h('span', { class: 'swatch', 'aria-hidden': 'true' });
  sw.style.background = colour(name);
  return sw;
}

function health(ok, text) {
  return h('span', { class: ok ? 'ok' : 'bad' }, ok ? '● ' : '▲ ', text);
}

function grid(c) {
  const byTopic = new Map();
  for (const p of c.partitions) {
    if (!byTopic.has(p.topic)) byTopic.set(p.topic, []);
    byTopic.get(p.topic).push(p);
  }
  if (!byTopic.size) return h('p', { class: 'muted' }, 'No topics yet.');
  return h('div', { class: 'grids' }, [...byTopic].map(([topic, parts]) => h('div', { class: 'grid-topic' },
    h('h3', {}, topic),
    h('ul', { class: 'grid', 'data-test': `grid-${topic}` }, parts.map((p) => {
      const owner = ownerName(p);
      const cell = h('li', {
        class: 'cell', tabindex: 0, 'data-owner': owner, 'data-partition': p.partition,
        title: `${topic}/${p.partition}: owner ${owner}${p.epoch !== null && p.epoch !== undefined ? `, epoch ${p.epoch}` : ''}`,
      }, h('span', { class: 'p' }, String(p.partition)),
      h('span', { class: 'epoch' }, p.epoch !== null && p.epoch !== undefined ? `e${p.epoch}` : ''));
      cell.style.background = colour(owner);
      return cell;
    })))));
}

function timeline() {
  if (history.length < 2) return h('p', { class: 'muted' }, 'Ownership over time appears here as the console keeps watching (one column every 2 s).');
  const all = [...history[history.length - 1].owners.keys()];
  const keys = all.slice(0, ROWS);
  const w = 6;
  const rowH = 12;
  const cols = history.slice(-120);
  const [width, height] = [cols.length * w + 90, keys.length * rowH];
  const svg = s('svg', { class: 'timeline', width, height, viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': 'Owner of each partition over the last minutes', 'data-test': 'timeline' },
    keys.map((k, r) => [
      s('text', { x: 0, y: r * rowH + 9, class: 'tl-label' }, k),
      cols.map((snap, i) => {
        const o = snap.owners.get(k);
        return s('rect', { x: 90 + i * w, y: r * rowH + 1, width: w - 1, height: rowH - 2, fill: o ? colour(o[0]) : '#eee' },
          s('title', {}, `${k}: ${o ? o[0] : 'not listed'} at ${new Date(snap.at).toLocaleTimeString()}`));
      }),
    ]));
  return h('div', { class: 'table-wrap' }, svg, all.length > ROWS ? h('p', { class: 'muted' }, `The first ${ROWS} of ${all.length} partitions; the moves table lists every change.`) : null);
}

export function mount(el) {
  const errors = h('div');
  const body = h('div', {}, h('p', { class: 'muted' }, 'Loading…'));
  el.append(h('h1', {}, 'Cluster'), errors, body);
  return poll(async () => {
    const [c, ready] = await Promise.all([
      api.get('/v1/cluster'),
      fetch('/readyz', { cache: 'no-store' }).then(async (r) => ({ ok: r.ok, text: (await r.text()).trim() })).catch((e) => ({ ok: false, text: e.message })),
    ]);
    thisInstance = c.instance;
    record(c);
    const members = c.members || [];
    const owners = new Map();
    for (const p of c.partitions) owners.set(ownerName(p), (owners.get(ownerName(p)) || 0) + 1);
    body.replaceChildren(
      h('div', { class: 'cards' },
        h('div', { class: 'card', 'data-test': 'this-instance' }, h('h2', {}, 'This instance'), h('p', {}, swatch(c.instance), c.instance), h('p', {}, `release ${c.release}`, c.oldest_release && c.oldest_release !== c.release ? ` (oldest member: ${c.oldest_release})` : ''), h('p', {}, health(ready.ok, ready.ok ? 'ready' : `not ready: ${ready.text}`))),
        h('div', { class: 'card', 'data-test': 'meta' }, h('h2', {}, 'Meta'), h('p', {}, `${c.meta.backend} `, health(c.meta.healthy, c.meta.healthy ? 'healthy' : 'unreachable')),
          h('p', {}, `database ${fmtBytes(c.meta.db_size_bytes)}`, c.meta.quota_bytes ? ` of ${fmtBytes(c.meta.quota_bytes)}` : ''),
          (c.meta.alarms || []).length ? h('p', { class: 'bad' }, `alarms: ${c.meta.alarms.join(', ')}`) : null),
        h('div', { class: 'card', 'data-test': 'log' }, h('h2', {}, 'Log'), h('p', {}, c.log.backend), h('p', { class: 'muted' }, c.log.id || ''))),
      h('h2', {}, `Instances (${members.length})`),
      table([
        ['Instance', (m) => [swatch(m.instance), m.instance, m.instance === c.instance ? h('span', { class: 'muted' }, ' (this one)') : null]],
        ['Address', (m) => m.addr],
        ['Release', (m) => m.release],
        ['Member since', (m) => fmtTime(m.since)],
        ['Lease', () => health(true, 'live')],
        ['Partitions', (m) => String(owners.get(m.instance) || 0), 'num'],
      ], members, { test: 'members', caption: 'Members hold a live lease in Meta; an instance whose lease ran out is no longer listed.' }),
      h('h2', {}, `Partitions (${c.partitions.length})`),
      h('p', { class: 'legend' }, [...owners].map(([o, n]) => h('span', { class: 'legend-item' }, swatch(o), `${o}: ${n}`))),
      grid(c),
      h('h2', {}, 'Ownership over the last minutes'),
      timeline(),
      changes.length ? table([
        ['When', (x) => new Date(x.at).toLocaleTimeString()],
        ['Partition', (x) => x.key],
        ['From', (x) => [swatch(x.from), x.from]],
        ['To', (x) => [swatch(x.to), x.to]],
        ['Epoch', (x) => String(x.epoch ?? '–'), 'num'],
      ], [...changes].reverse(), { test: 'moves' }) : h('p', { class: 'muted', 'data-test': 'moves-none' }, 'No ownership change seen since the console opened.'),
    );
  }, 2000, errors);
}

