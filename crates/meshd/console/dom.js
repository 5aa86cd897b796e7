// Small DOM helpers: elements are built with createElement and text nodes only (no
// markup strings), so nothing a client published can become markup.

const SVG_NS = 'http://www.w3.org/2000/svg';

function build(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') el.setAttribute('class', v);
    else if (k === 'text') el.textContent = v;
    else if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else if (k === 'value') el.value = v;
    else if (k === 'checked') el.checked = !!v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

// A problem (an ApiError or any error) as its title and detail.
export function problem(e, what) {
  const title = e && e.title ? e.title : (e && e.name) || 'Error';
  const detail = e && e.title ? e.detail : (e && e.message) || String(e);
  return h('div', { class: 'problem', role: 'alert', 'data-test': 'problem' },
    what ? h('span', { class: 'what' }, `${what}: `) : null,
    h('strong', { class: 'problem-title' }, title),
    e && e.status ? h('span', { class: 'status' }, ` (${e.status})`) : null,
    detail ? h('div', { class: 'problem-detail' }, detail) : null);
}

// A table: `columns` are [label, row => cell content, class?].
export function table(columns, rows, opts = {}) {
  const head = h('tr', {}, columns.map(([label, , cls]) => h('th', { scope: 'col', class: cls }, label)));
  const body = rows.map((r, i) => h('tr', opts.rowAttrs ? opts.rowAttrs(r, i) : {},
    columns.map(([, cell, cls]) => h('td', { class: cls }, cell(r, i)))));
  return h('div', { class: 'table-wrap' },
    h('table', { 'data-test': opts.test }, opts.caption ? h('caption', {}, opts.caption) : null,
      h('thead', {}, head), h('tbody', {}, body)));
}

export function fmtNum(n) {
  return n === undefined || n === null ? '–' : Number(n).toLocaleString('en-US');
}

export function fmtRate(r) {
  if (r === undefined || r === null || Number.isNaN(r)) return '–';
  return r >= 100 ? r.toFixed(0) : r >= 10 ? r.toFixed(1) : r.toFixed(2);
}

export function fmtBytes(n) {
  if (n === undefined || n === null) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

export function fmtTime(iso) {
  if (!iso) return '–';
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toISOString().replace('T', ' ').replace('Z', ' UTC');
}

// A stable colour per name (owners, states), as an HSL string.
export function colour(name) {
  if (!name) return 'hsl(0, 0%, 70%)';
  let x = 2166136261;
  for (const ch of name) x = Math.imul(x ^ ch.codePointAt(0), 16777619) >>> 0;
  return `hsl(${x % 360}, 60%, 45%)`;
}

// A sparkline of `points` (numbers), drawn as an SVG polyline.
export function sparkline(points, label, width = 160, height = 32) {
  const max = Math.max(1e-9, ...points);
  const step = points.length > 1 ? width / (points.length - 1) : width;
  const coords = points.map((p, i) => `${(i * step).toFixed(1)},${(height - 2 - (p / max) * (height - 4)).toFixed(1)}`);
  return s('svg', { class: 'spark', viewBox: `0 0 ${width} ${height}`, width, height, role: 'img', 'aria-label': label },
    s('title', {}, label),
    s('polyline', { points: coords.join(' '), fill: 'none', stroke: 'currentColor', 'stroke-width': 1.5 }));
}

// Runs `tick` now and every `ms` until stopped; a failure is shown in `slot` and the
// polling goes on (the next success clears it).
export function poll(tick, ms, slot) {
  let timer = null;
  let stopped = false;
  const run = async () => {
    try {
      await tick();
      if (slot) slot.replaceChildren();
    } catch (e) {
      if (slot && !stopped) slot.replaceChildren(problem(e));
    }
    if (!stopped) timer = setTimeout(run, ms);
  };
  run();
  return { stop() { stopped = true; clearTimeout(timer); } };
}

// A modal confirmation: resolves true when the operator confirms.
export function confirmDialog(title, ...body) {
  return new Promise((resolve) => {
    const ok = h('button', { type: 'button', class: 'danger', 'data-test': 'confirm' }, 'Confirm');
    const cancel = h('button', { type: 'button', 'data-test': 'cancel' }, 'Cancel');
    const d = h('dialog', { class: 'confirm', 'aria-labelledby': 'confirm-title' },
      h('h2', { id: 'confirm-title' }, title), h('div', { class: 'confirm-body' }, body),
      h('div', { class: 'actions' }, cancel, ok));
    const done = (v) => { d.close(); d.remove(); resolve(v); };
    ok.addEventListener('click', () => done(true));
    cancel.addEventListener('click', () => done(false));
    d.addEventListener('cancel', (e) => { e.preventDefault(); done(false); });
    document.body.append(d);
    d.showModal();
    cancel.focus();
  });
}

// A button for an admin-only action: disabled, with the reason beside it, when the
// console is signed in with a client token.
export function adminButton(ctx, label, attrs, onclick) {
  const b = h('button', { type: 'button', ...attrs, onclick }, label);
  if (ctx.role === 'client') {
    b.disabled = true;
    b.title = ctx.adminReason;
    return h('span', { class: 'admin-only' }, b, h('span', { class: 'reason', 'data-test': 'admin-reason' }, ctx.adminReason));
  }
  return b;
}
