// Tasks: a board by state (for every agent or one), and a task's history.

import * as api from '../api.js';
import { h, fmtTime, poll, problem } from '../dom.js';

const STATES = ['submitted', 'working', 'input-required', 'completed', 'failed', 'canceled', 'rejected'];
const enc = encodeURIComponent;

function history(t) {
  return h('ol', { class: 'history', 'data-test': 'task-history' }, (t.history || []).map((x) => h('li', {}, h('strong', { 'data-state': x.state }, x.state), ` ${fmtTime(x.at)}`)));
}

export function mount(el, ctx) {
  const agent = ctx.params.get('agent') || '';
  const chosen = ctx.params.get('id');
  const input = h('input', { id: 'task-agent', name: 'agent', value: agent, autocomplete: 'off', placeholder: 'every agent' });
  const form = h('form', { class: 'inline' }, h('label', { for: 'task-agent' }, 'Agent'), input, h('button', { type: 'submit' }, 'Filter'));
  form.addEventListener('submit', (ev) => { ev.preventDefault(); location.hash = `#/tasks${input.value.trim() ? `?agent=${enc(input.value.trim())}` : ''}`; });
  const errors = h('div');
  const board = h('div', { class: 'board', 'data-test': 'board' });
  const detail = h('div', { class: 'detail', 'aria-live': 'polite' });
  el.append(h('h1', {}, 'Tasks'), form, errors, board, detail);

  async function show(id) {
    try {
      const t = await api.get(`/v1/tasks/${enc(id)}`);
      detail.replaceChildren(h('h2', {}, `Task ${t.id}`),
        h('dl', { class: 'facts', 'data-test': 'task' },
          h('dt', {}, 'Agent'), h('dd', {}, t.agent),
          h('dt', {}, 'State'), h('dd', { 'data-test': 'task-state' }, t.state),
          h('dt', {}, 'Version'), h('dd', {}, String(t.version)),
          h('dt', {}, 'Assignee'), h('dd', {}, t.assignee ? `session ${t.assignee.session} (epoch ${t.assignee.epoch})` : '–')),
        h('h3', {}, 'History'), history(t),
        h('h3', {}, 'Input'), h('pre', { class: 'json' }, JSON.stringify(t.input, null, 2)),
        t.output !== null && t.output !== undefined ? h('div', {}, h('h3', {}, 'Output'), h('pre', { class: 'json' }, JSON.stringify(t.output, null, 2))) : '');
    } catch (e) {
      detail.replaceChildren(problem(e, id));
    }
  }
  if (chosen) show(chosen);

  return poll(async () => {
    const tasks = await api.all(`/v1/tasks${agent ? `?agent=${enc(agent)}` : ''}`, 'tasks', 2000);
    board.replaceChildren(...STATES.map((state) => {
      const here = tasks.filter((t) => t.state === state);
      return h('section', { class: 'column', 'data-state': state, 'aria-label': `${state}: ${here.length}` },
        h('h2', {}, state, h('span', { class: 'count' }, ` ${here.length}`)),
        h('ul', {}, here.slice(0, 200).map((t) => h('li', {},
          h('button', { type: 'button', class: 'card-button', 'data-id': t.id, onclick: () => show(t.id) },
            h('strong', {}, t.id), h('span', { class: 'muted' }, ` ${t.agent} · v${t.version}`)))),
        here.length > 200 ? h('p', { class: 'muted' }, `… and ${here.length - 200} more`) : null));
    }));
    if (tasks.length >= 2000) board.append(h('p', { class: 'muted' }, `The first ${tasks.length} tasks; filter by agent to see the rest.`));
  }, 3000, errors);
}
