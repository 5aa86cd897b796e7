// The console's shell: sign-in, navigation between views (by URL hash), and the
// rule that an error is always shown as its problem, never as a blank page.

import * as api from './api.js';
import { h, problem } from './dom.js';
import * as cluster from './views/cluster.js';
import * as topics from './views/topics.js';
import * as subscriptions from './views/subscriptions.js';
import * as deadletters from './views/deadletters.js';
import * as tasks from './views/tasks.js';
import * as sessions from './views/sessions.js';
import * as live from './views/live.js';

const VIEWS = [
  ['cluster', 'Cluster', cluster],
  ['topics', 'Topics', topics],
  ['subscriptions', 'Subscriptions', subscriptions],
  ['deadletters', 'Dead letters', deadletters],
  ['tasks', 'Tasks', tasks],
  ['sessions', 'Sessions', sessions],
  ['live', 'Live', live],
];

const main = document.getElementById('main');
const nav = document.getElementById('nav');
const banner = document.getElementById('banner');
const who = document.getElementById('who');
const signout = document.getElementById('signout');
let ctx = null;
let current = null;

const ADMIN_REASON = 'needs an admin token (signed in with a client token)';

function showFatal(e) {
  main.replaceChildren(h('h1', {}, 'Something went wrong'), problem(e));
}

window.addEventListener('unhandledrejection', (ev) => {
  if (ev.reason && ev.reason.name === 'AbortError') return;
  banner.replaceChildren(problem(ev.reason, 'Unexpected'));
});
window.addEventListener('error', (ev) => {
  banner.replaceChildren(problem(ev.error || ev.message, 'Unexpected'));
});

// `#/name?x=y` -> ['name', URLSearchParams]
function route() {
  const raw = location.hash.replace(/^#\/?/, '');
  const [name, query] = raw.split('?');
  return [name || 'cluster', new URLSearchParams(query || '')];
}

function render() {
  if (!ctx) return;
  if (current && current.stop) current.stop();
  current = null;
  const [name, params] = route();
  const view = VIEWS.find(([n]) => n === name) || VIEWS[0];
  for (const a of nav.querySelectorAll('a')) {
    if (a.dataset.view === view[0]) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  document.title = `${view[1]} · meshd console`;
  const el = h('section', { class: 'view', 'data-view': view[0] });
  main.replaceChildren(el);
  try {
    current = view[2].mount(el, { ...ctx, params });
  } catch (e) {
    el.replaceChildren(problem(e, view[1]));
  }
}

function signIn(error) {
  nav.hidden = true;
  signout.hidden = true;
  who.textContent = '';
  const input = h('input', { id: 'token', type: 'password', name: 'token', autocomplete: 'off', required: true, 'aria-describedby': 'token-help' });
  const form = h('form', { class: 'signin', 'data-test': 'signin' },
    h('h1', {}, 'Sign in'),
    h('p', { id: 'token-help' }, 'Enter an access token of this meshd (a line of its --admin-token-file or --client-token-file). It is kept in this tab only (sessionStorage) and sent as a bearer token; the console can do what the token can, nothing more.'),
    h('label', { for: 'token' }, 'Token'), input,
    h('button', { type: 'submit' }, 'Sign in'),
    error ? problem(error) : null);
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    api.setToken(input.value.trim());
    await start();
  });
  main.replaceChildren(form);
  input.focus();
}

async function start() {
  let role;
  try {
    role = await api.role();
  } catch (e) {
    const hadToken = !!api.token();
    api.setToken('');
    if (e.status === 401) {
      signIn(hadToken ? e : null);
      return;
    }
    showFatal(e);
    return;
  }
  ctx = { role, adminReason: ADMIN_REASON };
  banner.replaceChildren();
  if (role === 'open') {
    banner.append(h('div', { class: 'warning', 'data-test': 'tokenless' },
      h('strong', {}, 'No access tokens. '),
      'This meshd runs without --admin-token-file or --client-token-file: anyone who can reach it can read and change everything shown here.'));
  }
  who.textContent = role === 'open' ? 'no tokens' : `signed in: ${role} token`;
  who.dataset.role = role;
  signout.hidden = role === 'open';
  nav.hidden = false;
  nav.replaceChildren(...VIEWS.map(([n, label]) => h('a', { href: `#/${n}`, 'data-view': n }, label)));
  render();
}

signout.addEventListener('click', () => {
  api.setToken('');
  ctx = null;
  if (current && current.stop) current.stop();
  signIn(null);
});
window.addEventListener('hashchange', render);
start().catch(showFatal);
