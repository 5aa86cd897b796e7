// Calls to meshd's public API with the signed-in token. Every failure becomes an
// ApiError carrying the problem's title and detail (RFC 9457), so a view can always
// say what went wrong.

const KEY = 'meshd-console-token';

export class ApiError extends Error {
  constructor(status, title, detail, type) {
    super(detail ? `${title}: ${detail}` : title);
    this.status = status;
    this.title = title;
    this.detail = detail || '';
    this.type = type || '';
  }
}

export function token() {
  return sessionStorage.getItem(KEY) || '';
}

export function setToken(t) {
  if (t) sessionStorage.setItem(KEY, t);
  else sessionStorage.removeItem(KEY);
}

function headers(extra = {}) {
  const h = { ...extra };
  const t = token();
  if (t) h.Authorization = `Bearer ${t}`;
  return h;
}

async function problemOf(r, method, path) {
  const ct = r.headers.get('content-type') || '';
  if (ct.includes('json')) {
    const p = await r.json().catch(() => ({}));
    return new ApiError(r.status, p.title || `HTTP ${r.status}`, p.detail || '', p.type);
  }
  const text = (await r.text().catch(() => '')).slice(0, 400);
  return new ApiError(r.status, `HTTP ${r.status} ${r.statusText}`.trim(), text || `${method} ${path}`);
}

// Sends a request; answers the parsed JSON (or text, or null for 204).
export async function call(method, path, body, opts = {}) {
  const init = { method, headers: headers(opts.headers), cache: 'no-store', signal: opts.signal };
  if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let r;
  try {
    r = await fetch(path, init);
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new ApiError(0, 'meshd did not answer', `${method} ${path}: ${e.message}`);
  }
  if (!r.ok) throw await problemOf(r, method, path);
  if (r.status === 204) return null;
  const ct = r.headers.get('content-type') || '';
  return ct.includes('json') ? r.json() : r.text();
}

export const get = (path, opts) => call('GET', path, undefined, opts);

// Opens the Server-Sent Events stream of a subscription through fetch (which, unlike
// EventSource, can send the Authorization header). `onEvent(name, data)` gets every
// event; resolves when the stream ends.
export async function stream(path, onEvent, signal) {
  let r;
  try {
    r = await fetch(path, { headers: headers({ Accept: 'text/event-stream' }), cache: 'no-store', signal });
  } catch (e) {
    if (e.name === 'AbortError') return;
    throw new ApiError(0, 'meshd did not answer', `GET ${path}: ${e.message}`);
  }
  if (!r.ok) throw await problemOf(r, 'GET', path);
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (e) {
      if (e.name === 'AbortError') return;
      throw new ApiError(0, 'the stream broke', e.message);
    }
    if (chunk.done) return;
    buffer += decoder.decode(chunk.value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, '');
      let name = 'message';
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith(':')) continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
        if (field === 'event') name = value;
        else if (field === 'data') data.push(value);
      }
      if (data.length) onEvent(name, data.join('\n'));
    }
  }
}

// What the token may do: 'admin', 'client', or 'open' (meshd has no tokens). Asks an
// admin route: meshd's gate answers 401 (unknown token) or 403 (not an admin) before
// anything else, so any other answer (even a 503 while Meta is down) means the token
// passed as an admin's, and the views show that 503 themselves. Throws the 401's
// problem, or the failure to reach meshd at all.
export async function role() {
  try {
    await get('/v1/cluster');
  } catch (e) {
    if (e.status === 403 && token()) return 'client';
    if (e.status === 401 || e.status === 0 || e.status === undefined) throw e;
  }
  return token() ? 'admin' : 'open';
}

// Every page of a list route (`key` names the array), up to `max` items.
export async function all(path, key, max = 5000) {
  const out = [];
  let cursor = null;
  do {
    const sep = path.includes('?') ? '&' : '?';
    const page = await get(`${path}${sep}limit=1000${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`);
    out.push(...(page[key] || []));
    cursor = page.next_cursor || null;
  } while (cursor && out.length < max);
  return out;
}
