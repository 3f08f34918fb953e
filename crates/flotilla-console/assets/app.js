// The Flotilla console: plain ES module, no build step. Every view is reachable by URL
// (hash routes); live data comes from the console service over server-sent events.
//
//   #/runs?status=&label=&session=&q=   the runs list (virtualised, paged from the server)
//   #/run/<id>?profile=&children=&task= a run: tree, DAG, tasks, timeline, events, workspace,
//                                       inbox; `task` opens that task's panel
//   #/inbox                             pending approvals, questions, client tools
//   #/team                              the roster with presence, trust, failures
//   #/workers                           live workers, slots, backlog per pool
//   #/diff/<a>/<b>                      two runs compared task by task
//   #/usage?days=                       the tenant's quotas and usage (several tenants only)
// A console of several tenants (`--tenants`) serves each at /t/<tenant>/ (API /t/<tenant>/api/),
// with a picker of the person's tenants (GET /api/me); one installation's at / (API /api/).

const $ = (sel, root = document) => root.querySelector(sel);
const main = () => $('#main');
let me = { name: '?', operator: false };
// The tenant this page shows (a console of several tenants), and where its API is.
const tenant = (location.pathname.match(/^\/t\/([a-z0-9-]+)\//) || [])[1] || null;
const base = tenant ? `/t/${tenant}` : '';
// How many trailing hex digits of a run id tell the runs known apart (the server counts them:
// `short_len` of /api/runs, at least 8). A UUIDv7 begins with its creation time, which runs
// started together share; it ends with random digits.
let shortLen = 8;
let cleanup = [];

// ---------- helpers ----------

function esc(s) {
  return String(s ?? '').replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
}

// Sets an element's HTML when it is still on the page (a view's late answer after the
// person moved on is dropped).
const shown = new WeakMap();
function set(sel, html) {
  const el = $(sel);
  // Unchanged content is left alone: no re-layout while a run's events stream in.
  if (el && shown.get(el) !== html) {
    el.innerHTML = html;
    shown.set(el, html);
  }
  return el;
}

function h(html) {
  const t = document.createElement('template');
  t.innerHTML = html.trim();
  return t.content.firstElementChild;
}

async function api(path, opts = {}) {
  const init = { headers: { Accept: 'application/json' }, credentials: 'same-origin' };
  if (opts.body !== undefined) {
    init.method = 'POST';
    init.headers['Content-Type'] = 'application/json';
    // The console's CSRF guard: a cross-site page cannot send this header.
    init.headers['X-Flotilla-Console'] = '1';
    init.body = JSON.stringify(opts.body);
  }
  // `top`: the console's own routes (who is signed in, their tenants), not a tenant's.
  const r = await fetch(opts.top ? path : base + path, init);
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = { message: text }; }
  if (!r.ok) {
    const e = new Error((data && (data.message || data.error)) || r.statusText);
    e.status = r.status;
    e.code = data && (data.error || data.code);
    e.data = data;
    throw e;
  }
  return data;
}

function toast(msg, error = false) {
  const t = $('#toast');
  t.textContent = msg;
  t.className = error ? 'error' : '';
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, 5000);
}

function live(url, handlers) {
  const es = new EventSource(base + url);
  for (const [name, fn] of Object.entries(handlers)) es.addEventListener(name, fn);
  cleanup.push(() => es.close());
  return es;
}

// Resolves when the page has a moment (at most 250 ms later): work that can wait lets the
// next frame of a stream be drawn first.
const idle = () => new Promise((resolve) => {
  if (window.requestIdleCallback) requestIdleCallback(() => resolve(), { timeout: 250 });
  else setTimeout(resolve, 0);
});

function every(ms, fn) {
  const id = setInterval(fn, ms);
  cleanup.push(() => clearInterval(id));
}

function debounce(ms, fn) {
  let t = null;
  return () => { if (!t) t = setTimeout(() => { t = null; fn(); }, ms); };
}

function ms(d) {
  if (d == null) return '';
  if (d < 1000) return `${d} ms`;
  const s = d / 1000;
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  return m < 60 ? `${m}m ${Math.round(s % 60)}s` : `${Math.floor(m / 60)}h ${m % 60}m`;
}

// Times as the CLI prints them: ISO 8601 in UTC, to the millisecond (2026-11-28T08:31:20.215Z),
// whatever the browser's locale.
function time(ts) {
  if (!ts) return '';
  const d = new Date(ts);
  return Number.isNaN(d.getTime()) ? '' : d.toISOString();
}
// The time of day of `time` (08:31:20.215Z), for lines of one run.
const clock = (ts) => time(ts).slice(11);
const since = (ts) => (ts ? Math.max(0, Date.now() - Date.parse(ts)) : null);

function durationOf(r) {
  const end = r.finished_at ? Date.parse(r.finished_at) : Date.now();
  return end - Date.parse(r.created_at);
}

const status = (s) => `<span class="status s-${esc(s)}" data-status="${esc(s)}">${esc(s)}</span>`;
const short = (id) => String(id).replace(/-/g, '').slice(-shortLen);
// A run as a person names it: its plan's name and its short id.
const runName = (name, id) => `${name || 'run'} · ${short(id)}`;
const terminal = (s) => ['succeeded', 'failed', 'cancelled', 'rejected'].includes(s);
const taskDone = (s) => ['succeeded', 'failed', 'skipped', 'cancelled'].includes(s);

function query() {
  const [, q = ''] = location.hash.split('?');
  return new URLSearchParams(q);
}

function setQuery(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v) q.set(k, v);
  const s = q.toString();
  history.replaceState(null, '', `#${path}${s ? `?${s}` : ''}`);
}

// A virtualised list: only the rows in view (plus a margin) are in the DOM, so 10,000 runs
// or a long event stream stay smooth. `row(i)` returns the HTML of row i (or null: not loaded).
// Rows are kept by index between draws: a draw adds the rows that came into view, removes
// those that left it and rewrites only a row whose HTML changed (a reply streaming in).
function vlist(container, rowHeight, count, row, onMissing) {
  container.innerHTML = '';
  const spacer = h('<div class="spacer"></div>');
  container.appendChild(spacer);
  const cls = container.dataset.rowClass || 'vrow';
  const shownRows = new Map(); // index -> element
  let n = count;
  const render = (toEnd = false) => {
    spacer.style.height = `${n * rowHeight}px`;
    if (toEnd) container.scrollTop = n * rowHeight;
    const top = container.scrollTop;
    const first = Math.max(0, Math.floor(top / rowHeight) - 10);
    const last = Math.min(n, Math.ceil((top + container.clientHeight) / rowHeight) + 10);
    for (const [i, el] of shownRows) {
      if (i < first || i >= last) { el.remove(); shownRows.delete(i); }
    }
    let missing = -1;
    for (let i = first; i < last; i++) {
      const html = row(i);
      if (html == null && missing < 0) missing = i;
      const want = html ?? '<span class="muted">…</span>';
      let el = shownRows.get(i);
      if (!el) {
        el = document.createElement('div');
        el.className = cls;
        el.dataset.i = i;
        // Positions through the CSSOM: the Content-Security-Policy forbids inline style attributes.
        el.style.top = `${i * rowHeight}px`;
        spacer.appendChild(el);
        shownRows.set(i, el);
      }
      if (el.drawn !== want) { el.innerHTML = want; el.drawn = want; }
    }
    if (missing >= 0 && onMissing) onMissing(missing);
  };
  let raf = 0;
  const schedule = () => { if (!raf) raf = requestAnimationFrame(() => { raf = 0; render(); }); };
  container.addEventListener('scroll', schedule);
  render();
  return {
    setCount(c) { n = c; schedule(); },
    refresh: schedule,
    // Now, inside a frame callback that batches changes (a frame requested from a frame
    // callback would draw one frame late); `toEnd` scrolls to the last row first.
    renderNow(c = n, toEnd = false) { n = c; render(toEnd); },
    atBottom: () => container.scrollTop + container.clientHeight >= container.scrollHeight - 2 * rowHeight,
    toBottom() { render(true); },
  };
}

// ---------- runs list ----------

// The runs list's columns; agent, tokens, cost and labels only when some run has one.
const RUN_COLS = [
  { key: 'run', title: 'RUN', width: 'minmax(200px, 1.4fr)' },
  { key: 'status', title: 'STATUS', width: '110px' },
  { key: 'agent', title: 'AGENT', width: 'minmax(90px, 1fr)' },
  { key: 'started', title: 'STARTED (UTC)', width: '200px' },
  { key: 'duration', title: 'DURATION', width: '80px' },
  { key: 'tasks', title: 'TASKS', width: '60px' },
  { key: 'tokens', title: 'TOKENS', width: '70px' },
  { key: 'cost', title: 'COST', width: '80px' },
  { key: 'labels', title: 'LABELS', width: 'minmax(80px, 1fr)' },
];

async function viewRuns() {
  const q = query();
  const f = { status: q.get('status') || '', label: q.get('label') || '', session: q.get('session') || '', q: q.get('q') || '' };
  main().innerHTML = `
    <h1>Runs <span id="runs-total" class="muted"></span></h1>
    <div class="filters">
      <select id="f-status" title="status">
        ${['', 'pending', 'running', 'waiting', 'paused', 'human_control', 'succeeded', 'failed', 'cancelled', 'rejected']
          .map((s) => `<option value="${s}" ${s === f.status ? 'selected' : ''}>${s || 'any status'}</option>`).join('')}
      </select>
      <input id="f-label" placeholder="label key=value" value="${esc(f.label)}">
      <input id="f-session" placeholder="session id" value="${esc(f.session)}" size="36">
      <input id="f-q" placeholder="name or id" value="${esc(f.q)}">
      <span id="runs-counts" class="muted"></span>
    </div>
    <div id="runs-view">
    <div id="runs-head" class="vhead runs-grid">${RUN_COLS.map((c) => `<span class="c-${c.key}" data-col="${c.key}">${c.title}</span>`).join('')}</div>
    <div id="runs" class="vlist" data-row-class="vrow runs-grid"></div>
    </div>`;
  const PAGE = 500;
  let rows = []; // index -> record (sparse: pages load on demand)
  let total = 0;
  const loading = new Set();
  const params = () => new URLSearchParams(Object.entries(f).filter(([, v]) => v)).toString();
  // A column that would be blank on every run loaded (agent, tokens, cost, labels: exec and
  // scripted agents report no tokens, most runs have no labels) is not shown.
  const filled = { agent: false, tokens: false, cost: false, labels: false };
  const showColumns = () => {
    const view = $('#runs-view');
    if (!view) return;
    const cols = RUN_COLS.filter((c) => !(c.key in filled) || filled[c.key]);
    view.style.setProperty('--runs-cols', cols.map((c) => c.width).join(' '));
    for (const k of Object.keys(filled)) view.classList.toggle(`hide-${k}`, !filled[k]);
  };
  const row = (i) => {
    const r = rows[i];
    if (!r) return null;
    const labels = Object.entries(r.labels || {}).map(([k, v]) => `${k}=${v}`).join(' ');
    const id = r.handle.run_id;
    const sum = summaries.get(id);
    if (!sum || sum.stale) wantSummary(id);
    const u = sum && sum.usage;
    const tokens = u ? u.prompt_tokens + u.completion_tokens : 0;
    const waits = (r.waiting || []).map((w) => `${w.kind}${w.task_id ? ` of ${w.task_id}` : ''}: ${w.what}`).join('; ');
    return `<span class="c-run"><a href="#/run/${id}" title="${esc(id)}">${esc(r.name || 'run')} <span class="mono muted">${short(id)}</span></a></span>
      <span class="c-status" title="${esc(waits || r.status)}">${status(r.label || r.status)}</span>
      <span class="c-agent">${esc((sum && sum.agent) || '')}</span><span class="c-started mono">${time(r.created_at)}</span><span class="c-duration">${ms(durationOf(r))}</span>
      <span class="c-tasks">${r.tasks.succeeded}/${r.tasks.total}</span><span class="c-tokens">${tokens || ''}</span>
      <span class="c-cost">${u && u.cost_usd ? `$${u.cost_usd.toFixed(4)}` : ''}</span><span class="c-labels muted">${esc(labels)}</span>`;
  };
  // Columns fill in as rows and their summaries load.
  const note = (r, sum) => {
    let more = false;
    const mark = (k, v) => { if (v && !filled[k]) { filled[k] = true; more = true; } };
    if (r) mark('labels', Object.keys(r.labels || {}).length > 0);
    if (sum) {
      mark('agent', !!sum.agent);
      mark('tokens', !!(sum.usage && sum.usage.prompt_tokens + sum.usage.completion_tokens));
      mark('cost', !!(sum.usage && sum.usage.cost_usd));
    }
    if (more) showColumns();
  };
  // Agent, tokens and cost of the rows in view: read in batches, again when a run changes.
  const summaries = new Map();
  const wanted = new Set();
  const fetchSummaries = debounce(150, async () => {
    const ids = [...wanted].slice(0, 100);
    ids.forEach((id) => wanted.delete(id));
    if (!ids.length) return;
    ids.forEach((id) => summaries.set(id, { ...(summaries.get(id) || {}), stale: false }));
    try {
      const got = await api(`/api/runs/summaries?ids=${ids.join(',')}`);
      for (const [id, v] of Object.entries(got)) { summaries.set(id, v); note(null, v); }
      list.refresh();
    } catch { /* shown again on the next change */ }
    if (wanted.size) fetchSummaries();
  });
  function wantSummary(id) { wanted.add(id); fetchSummaries(); }
  showColumns();
  const list = vlist($('#runs'), 30, 0, row, (i) => load(Math.floor(i / PAGE) * PAGE));
  $('#runs').addEventListener('click', (e) => {
    const el = e.target.closest('[data-i]');
    if (el && rows[el.dataset.i] && e.target.tagName !== 'A') location.hash = `#/run/${rows[el.dataset.i].handle.run_id}`;
  });
  async function load(offset) {
    if (loading.has(offset)) return;
    loading.add(offset);
    try {
      const p = await api(`/api/runs?${params()}&offset=${offset}&limit=${PAGE}`);
      total = p.total;
      if (p.short_len) shortLen = p.short_len;
      p.runs.forEach((r, k) => { rows[offset + k] = r; note(r); });
      ($('#runs-total') || {}).textContent = `${total}${p.loading ? ' (loading…)' : ''}`;
      ($('#runs-counts') || {}).textContent = Object.entries(p.counts).map(([k, v]) => `${k} ${v}`).join(' · ');
      list.setCount(total);
      if (p.loading) setTimeout(() => { loading.delete(offset); load(offset); }, 500);
    } catch (e) {
      toast(e.message, true);
    } finally {
      setTimeout(() => loading.delete(offset), 1000);
    }
  }
  const reload = () => { rows = []; loading.clear(); load(0); };
  for (const id of ['f-status', 'f-label', 'f-session', 'f-q']) {
    $(`#${id}`).addEventListener('change', () => {
      f[id.slice(2)] = $(`#${id}`).value.trim();
      setQuery('/runs', f);
      reload();
    });
  }
  await load(0);
  // Live: a changed run is patched in place; a new one matching the filter goes on top.
  const refresh = debounce(200, () => list.refresh());
  // Counts by status follow the changes (one small read, at most every 2 s).
  const recount = debounce(2000, async () => {
    try {
      const p = await api(`/api/runs?${params()}&offset=0&limit=1`);
      if (p.short_len) shortLen = p.short_len;
      ($('#runs-counts') || {}).textContent = Object.entries(p.counts).map(([k, v]) => `${k} ${v}`).join(' · ');
    } catch { /* the next change tries again */ }
  });
  live('/api/runs/stream', {
    run: (m) => {
      recount();
      const c = JSON.parse(m.data);
      if (c.kind !== 'put') return;
      const r = c.record;
      note(r);
      const i = rows.findIndex((x) => x && x.handle.run_id === r.handle.run_id);
      const known = summaries.get(r.handle.run_id);
      if (known) known.stale = true;
      if (i >= 0) { rows[i] = r; refresh(); return; }
      if (r.handle.parent_run_id) return;
      if (f.status && !f.status.split(',').some((x) => x === r.status || x === r.label)) return;
      if (f.session && r.session_id !== f.session) return;
      if (f.q && !(`${r.name || ''} ${r.handle.run_id}`.toLowerCase().includes(f.q.toLowerCase()))) return;
      if (f.label) {
        const [k, v] = f.label.split('=');
        if (!(k in (r.labels || {})) || (v !== undefined && r.labels[k] !== v)) return;
      }
      rows.unshift(r);
      total += 1;
      ($('#runs-total') || {}).textContent = `${total}`;
      list.setCount(total);
    },
    reload: () => reload(),
  });
  every(1000, () => list.refresh()); // running durations tick
}

// ---------- one run ----------

// The tasks of `plan` downstream of `at` (`at` included): its dependents and the consumers of
// topics they produce, transitively — what a fork at `at` runs again (`run.fork`).
function downstreamOf(plan, at) {
  const subs = (plan && plan.subtasks) || [];
  const out = new Set([at]);
  const stack = [at];
  while (stack.length) {
    const sub = subs.find((t) => t.id === stack.pop()) || {};
    for (const o of subs) {
      if (out.has(o.id)) continue;
      if ((o.dependencies || []).includes(sub.id) || (o.consumes || []).some((t) => (sub.produces || []).includes(t))) {
        out.add(o.id);
        stack.push(o.id);
      }
    }
  }
  return out;
}

// A refusal as a person reads it: what was refused, why, and each problem the API named.
function refusalHtml(what, code, message, problems) {
  if (!problems || !problems.length) return `${esc(what)}${code ? ` (${esc(code)})` : ''}: ${esc(message)}`;
  return `${esc(what)}${code ? ` (${esc(code)})` : ''}:<ul class="problems">${problems.map((p) => `<li data-code="${esc(p.code)}">${esc(p.message)} <span class="muted">${esc(p.code)}${p.path ? ` at ${esc(p.path)}` : ''}</span></li>`).join('')}</ul>`;
}

function flattenTree(node, depth = 0, out = []) {
  out.push({ node, depth });
  for (const c of node.children || []) flattenTree(c, depth + 1, out);
  return out;
}

// The plan's DAG: tasks in columns by dependency depth, coloured by state. The layout is drawn
// once per plan; a state change patches its node in place (a 1,000-task plan is not redrawn
// every time a task moves).
function dagLayout(plan) {
  const byId = new Map(plan.subtasks.map((t) => [t.id, t]));
  const level = new Map();
  // Iterative depth (a 1,000-long chain would overflow a recursive one): each task's level is
  // one more than its deepest dependency's.
  for (const root of plan.subtasks) {
    const stack = [[root.id, false]];
    const open = new Set();
    while (stack.length) {
      const [id, expanded] = stack.pop();
      if (level.has(id)) continue;
      const deps = ((byId.get(id) || {}).dependencies || []).filter((d) => byId.has(d));
      if (expanded || !deps.length) {
        open.delete(id);
        level.set(id, deps.length ? 1 + Math.max(...deps.map((d) => level.get(d) ?? 0)) : 0);
        continue;
      }
      if (open.has(id)) { level.set(id, 0); continue; } // a cycle: validation refuses these
      open.add(id);
      stack.push([id, true]);
      for (const d of deps) if (!level.has(d)) stack.push([d, false]);
    }
  }
  const cols = [];
  for (const t of plan.subtasks) (cols[level.get(t.id)] ||= []).push(t.id);
  const W = 150, H = 30, GX = 40, GY = 12;
  const pos = new Map();
  cols.forEach((ids, c) => ids.forEach((id, r) => pos.set(id, { x: 10 + c * (W + GX), y: 10 + r * (H + GY) })));
  const height = 20 + Math.max(...cols.map((c) => c.length)) * (H + GY);
  const width = 20 + cols.length * (W + GX);
  let svg = '';
  for (const t of plan.subtasks) {
    for (const d of t.dependencies || []) {
      const a = pos.get(d), b = pos.get(t.id);
      if (a && b) svg += `<path d="M${a.x + W},${a.y + H / 2} C${a.x + W + GX / 2},${a.y + H / 2} ${b.x - GX / 2},${b.y + H / 2} ${b.x},${b.y + H / 2}"/>`;
    }
  }
  for (const t of plan.subtasks) {
    const p = pos.get(t.id);
    svg += `<g class="t-waiting" data-task="${esc(t.id)}" data-state="waiting"><rect x="${p.x}" y="${p.y}" width="${W}" height="${H}"/>
      <text x="${p.x + 6}" y="${p.y + 13}">${esc(String(t.id).slice(0, 22))}</text>
      <text x="${p.x + 6}" y="${p.y + 25}" fill="#6b7280">waiting</text></g>`;
  }
  return `<svg viewBox="0 0 ${width} ${height}" height="${Math.min(height, 400)}" preserveAspectRatio="xMinYMin meet">${svg}</svg>`;
}

// `labels`: what a person reads of each task (`running` once a worker started it, …);
// `detail`: a second line for a task (a running task's elapsed time).
function drawDag(root, plan, tasks, labels = {}, detail = () => '') {
  if (!root) return;
  if (!plan || !plan.subtasks || !plan.subtasks.length) {
    set('#dag', '<p class="muted">No plan yet.</p>');
    root.dagKey = null;
    return;
  }
  const key = plan.subtasks.map((t) => `${t.id}<${(t.dependencies || []).join(',')}`).join(';');
  if (root.dagKey !== key) {
    set('#dag', dagLayout(plan));
    root.dagKey = key;
    root.dagNodes = new Map([...root.querySelectorAll('g[data-task]')].map((g) => [g.dataset.task, g]));
  }
  for (const t of tasks || []) {
    const g = root.dagNodes.get(t.task_id);
    if (!g) continue;
    const state = labels[t.task_id] || t.status;
    const text = `${state}${detail(t) ? ` · ${detail(t)}` : ''}`;
    if (g.dataset.state !== state) {
      g.dataset.state = state;
      g.setAttribute('class', `t-${state}`);
    }
    if (g.lastElementChild.textContent !== text) g.lastElementChild.textContent = text;
  }
}

// The run's tasks in time: per task its queue (dispatched, not started), its attempts (from
// start to end, coloured by outcome), its waits for a person; the run's holds behind them.
// SVG: its geometry is attributes, which the Content-Security-Policy allows (no inline styles).
const TL_ROWS = 200;
function drawTimeline(tl, labels = {}) {
  if (!tl || !tl.tasks || !tl.tasks.length) return '<p class="muted">No tasks yet.</p>';
  const t0 = Date.parse(tl.start);
  const t1 = Math.max(tl.end ? Date.parse(tl.end) : Date.now(), t0 + 1);
  const L = 130, W = 620, R = 10, H = 16, G = 4;
  const x = (ts) => L + Math.max(0, Math.min(1, ((ts == null ? t1 : Date.parse(ts)) - t0) / (t1 - t0))) * (W - L - R);
  const rows = tl.tasks.slice(0, TL_ROWS);
  const height = 22 + rows.length * (H + G);
  const bar = (cls, from, to, title, y, h = H) => {
    const a = x(from), b = Math.max(x(to), a + 2);
    return `<rect class="${cls}" x="${a.toFixed(1)}" y="${y}" width="${(b - a).toFixed(1)}" height="${h}"><title>${esc(title)}</title></rect>`;
  };
  let svg = '';
  for (const hd of tl.holds || []) {
    svg += bar(`hold h-${hd.kind}`, hd.from, hd.to, `${hd.kind} ${time(hd.from)} → ${hd.to ? time(hd.to) : 'now'}${hd.what ? `: ${hd.what}` : ''}`, 0, height - 18);
  }
  rows.forEach((line, i) => {
    const y = i * (H + G);
    const state = labels[line.task_id] || line.ended || '';
    let g = `<text x="0" y="${y + 12}">${esc(String(line.task_id).slice(0, 20))}</text>`;
    const first = (line.attempts || []).find((a) => !line.queued_at || Date.parse(a.started_at) >= Date.parse(line.queued_at));
    if (line.queued_at && (first || !line.ended)) {
      g += bar('q', line.queued_at, first ? first.started_at : (line.ended_at || null), `${line.task_id}: queued for a worker ${time(line.queued_at)}${first ? ` → started ${time(first.started_at)}` : ''}`, y + 5, H - 10);
    }
    for (const a of line.attempts || []) {
      g += bar(`a a-${a.outcome}`, a.started_at, a.ended_at || null, `${line.task_id}: attempt ${a.attempt}${a.worker ? ` on ${a.worker}` : ''} ${time(a.started_at)} → ${a.ended_at ? time(a.ended_at) : 'now'} (${a.outcome})`, y);
    }
    for (const w of line.waits || []) {
      g += bar(`w w-${w.kind.replace(' ', '_')}`, w.from, w.to || null, `${line.task_id}: waits for a person (${w.kind}) ${time(w.from)} → ${w.to ? time(w.to) : 'now'}${w.what ? `: ${w.what}` : ''}`, y + 3, H - 6);
    }
    svg += `<g class="tl-row" data-task="${esc(line.task_id)}" data-state="${esc(state)}">${g}</g>`;
  });
  const axis = `<text x="${L}" y="${height - 4}" class="axis">${esc(time(tl.start))}</text>
    <text x="${W - R}" y="${height - 4}" class="axis" text-anchor="end">${tl.end ? esc(time(tl.end)) : 'now'} · ${ms(t1 - t0)}</text>`;
  const more = tl.tasks.length - rows.length + (tl.omitted || 0);
  return `<svg viewBox="0 0 ${W} ${height}" preserveAspectRatio="xMinYMin meet">${svg}${axis}</svg>
    <div class="muted tl-legend"><span class="key q"></span> queued <span class="key a-running"></span> running <span class="key a-succeeded"></span> succeeded <span class="key a-failed"></span> failed or retried <span class="key w"></span> waits for a person <span class="key hold"></span> run held${more > 0 ? ` · ${more} more task(s) not drawn` : ''}</div>`;
}

function eventLine(pe) {
  const env = pe.event;
  const ev = env.event;
  const who = pe.agent ? `${pe.agent}·${short(pe.run_id)}` : (env.task_id || 'run');
  const indent = '  '.repeat(pe.depth);
  const t = clock(env.ts);
  let what;
  let cls = '';
  switch (ev.type) {
    case 'assistant_reply': what = `says: ${ev.text}`; break;
    case 'tool_start': what = `→ ${ev.tool} ${JSON.stringify(ev.input)}`; break;
    case 'tool_end':
      what = `← ${ev.tool || 'tool'} ${ev.ok ? 'ok' : 'failed'}${ev.duration_ms != null ? ` in ${ev.duration_ms} ms` : ''}${ev.error ? `: ${ev.error}` : ''}`;
      if (!ev.ok) cls = 'tool-failed';
      break;
    case 'agent_run_started': what = `⇢ child run ${short(ev.child.run_id)} (${ev.agent || 'agent'})`; break;
    case 'usage': what = `usage ${ev.prompt_tokens} + ${ev.completion_tokens} tokens${ev.model ? ` (${ev.model})` : ''}${ev.cost_usd != null ? ` $${ev.cost_usd.toFixed(4)}` : ''}`; break;
    case 'workflow':
      what = `${ev.phase}${env.task_id ? ` ${env.task_id}` : ''}${env.attempt > 1 ? ` (attempt ${env.attempt})` : ''}${ev.worker && ev.phase === 'task_started' ? ` on ${ev.worker}` : ''}${ev.detail ? `: ${ev.detail}` : ''}${ev.error ? `: ${ev.error.message || ev.error.kind || ''}` : ''}`;
      break;
    case 'agent_step': {
      const e = ev.entry || {};
      what = `step ${ev.step}: ${e.results ? `${e.results.length} tool results` : `model reply (${(e.tool_calls || []).length} tool calls)`}`;
      break;
    }
    case 'await_clarification': what = `asks: ${ev.question} (answer in the inbox)`; break;
    case 'await_external_tools': what = `waits for client tools: ${(ev.calls || []).map((c) => `${c.tool}(${JSON.stringify(c.input)})`).join('; ')}`; break;
    default: what = ev.type;
  }
  return { text: `${t} ${indent}[${who}] ${what}`, cls };
}

// How a person answers a wait in the page.
function answerHere(w) {
  switch (w.kind) {
    case 'approval': return 'approve, reject or edit its input in the request below';
    case 'question': return 'respond in the request below';
    case 'client tool': return 'the client answers it, or respond in the request below';
    case 'pause': return 'resume (the button above)';
    case 'takeover': return 'complete its waiting tasks (complete… in the tasks), resume or cancel above';
    default: return 'see the requests below';
  }
}

// One task's panel, from /api/runs/RUN/tasks/TASK.
function taskPanel(d) {
  const t = d.task;
  const sub = d.subtask || {};
  const line = d.timeline || { attempts: [], waits: [] };
  const attempts = line.attempts || [];
  const last = attempts[attempts.length - 1];
  const a = d.activity;
  const worker = (a && a.worker) || (d.result && d.result.worker) || (last && last.worker) || '';
  const started = (a && a.started_at) || (last && last.started_at) || (d.result && d.result.started_at);
  const endedAt = line.ended_at || (last && last.ended_at);
  const kv = (k, v) => (v === '' || v == null ? '' : `<span>${k}</span><span>${v}</span>`);
  const input = sub.input == null ? '' : JSON.stringify(sub.input, null, 2);
  const result = d.result && d.result.result;
  const lines = (d.events || []).map((env) => eventLine({ run_id: env.run_id, depth: 0, event: env }));
  return `<div class="panel-head"><h2>Task <span class="mono">${esc(t.task_id)}</span> ${status(d.label || t.status)}</h2><button id="task-close" title="close">×</button></div>
    <div class="kv" id="task-facts">
      ${kv('agent', esc((line.agent || sub.agent || (d.result && d.result.agent) || (sub.role ? `a member of role ${sub.role}` : 'the default agent'))))}
      ${kv('pool', esc(t.pool || sub.pool || ''))}
      ${kv('after', esc((sub.dependencies || []).join(', ')))}
      ${kv('action', esc(sub.action || ''))}
      ${kv('attempts', String(t.attempts))}
      ${kv('worker', worker ? `<span class="mono" data-worker>${esc(worker)}</span>` : '')}
      ${kv('queued', t.dispatched_at ? `<span class="mono">${time(t.dispatched_at)}</span>` : '')}
      ${kv('started', started ? `<span class="mono">${time(started)}</span>` : '')}
      ${kv('ended', endedAt ? `<span class="mono">${time(endedAt)}</span>` : '')}
      ${kv('took', started ? `${endedAt ? ms(Date.parse(endedAt) - Date.parse(started)) : `${ms(since(started))} so far`}` : '')}
      ${kv('paused until', t.paused_until ? `<span class="mono">${time(t.paused_until)}</span>` : '')}
    </div>
    ${(d.waiting || []).map((w) => `<div class="wait"><b>waits for ${esc(w.kind)}</b>: ${esc(w.what)}<div class="muted">answer: ${esc(answerHere(w))} — or <code>${esc(w.answer)}</code></div></div>`).join('')}
    <h3>Input</h3><p class="wrap">${esc(sub.description || '')}</p>${input ? `<pre class="mono" id="task-input">${esc(input)}</pre>` : ''}
    <h3>Result</h3>${result ? `<pre class="mono" id="task-result">${esc(result.response)}</pre>${d.result.worker ? `<div class="muted">from ${esc(d.result.worker)}, attempt ${d.result.attempt}${result.tokens ? ` · ${result.tokens} tokens` : ''}</div>` : ''}`
      : (t.error ? `<p class="error-text">${esc(t.error.message || JSON.stringify(t.error))}</p>` : `<p class="muted">${t.skip_reason ? esc(t.skip_reason) : 'none yet'}</p>`)}
    <h3>Attempts <span class="muted">(UTC)</span></h3>${attempts.length ? `<table id="task-attempts"><tr><th>#</th><th>WORKER</th><th>STARTED</th><th>ENDED</th><th>OUTCOME</th></tr>${attempts.map((x) => `<tr><td>${x.attempt}</td><td class="mono">${esc(x.worker || '')}</td><td class="mono" title="${time(x.started_at)}">${clock(x.started_at)}</td><td class="mono" title="${time(x.ended_at)}">${clock(x.ended_at)}</td><td>${status(x.outcome)}</td></tr>`).join('')}</table>` : '<p class="muted">not started</p>'}
    ${(line.waits || []).length ? `<h3>Waits</h3><table><tr><th>FOR</th><th>FROM</th><th>UNTIL</th><th>WHAT</th></tr>${line.waits.map((w) => `<tr><td>${esc(w.kind)}</td><td class="mono" title="${time(w.from)}">${clock(w.from)}</td><td class="mono">${w.to ? clock(w.to) : 'now'}</td><td class="wrap">${esc(w.what || '')}</td></tr>`).join('')}</table>` : ''}
    <h3>Events <span class="muted">(${d.events_total}${d.events_total > lines.length ? `, the last ${lines.length}` : ''})</span></h3>
    <div id="task-events" class="task-events">${lines.map((l) => `<div class="${l.cls}" title="${esc(l.text)}">${esc(l.text)}</div>`).join('')}</div>`;
}

const TREE_ROW = 22;
const TASK_ROW = 30;

async function viewRun(runId) {
  // Reads still in flight when the person opens another page (or another run) are dropped.
  let left = false;
  cleanup.push(() => { left = true; });
  const q = query();
  const profile = q.get('profile') || 'user';
  const children = q.get('children') || 'linked';
  main().innerHTML = `
    <div class="run-head card">
      <div><h1 id="run-title">Run <span class="mono">${esc(runId)}</span></h1>
        <div id="run-meta" class="muted"></div><div id="run-fork" class="muted"></div></div>
      <div class="actions">
        <label class="muted" title="how long a pause or takeover lasts before its default (empty: the deployment's default)">for <input id="hold-min" type="number" min="1" placeholder="default" ${me.operator ? '' : 'disabled'}> min</label>
        ${['pause', 'resume', 'takeover', 'edit', 'cancel'].map((a) => `<button data-action="${a}" class="${a === 'cancel' ? 'danger' : ''}" ${a === 'edit' ? 'hidden' : ''} ${me.operator ? '' : 'disabled title="operators only"'}>${a === 'edit' ? 'edit plan…' : a}</button>`).join('')}
        <label class="muted" title="compensate the tasks that succeeded, in reverse dependency order"><input type="checkbox" id="rollback" ${me.operator ? '' : 'disabled'}> rollback</label>
        <form id="compare" class="compare"><input id="compare-with" class="mono" placeholder="another run's id" size="20"><button type="submit">compare</button></form>
      </div>
    </div>
    <div id="edit-plan" class="card" hidden>
      <h2>Edit the plan</h2>
      <p class="muted">The whole plan as it should run from here: tasks that started stay as they are, waiting tasks may change, new tasks may be appended.</p>
      <textarea id="plan-text" class="mono" rows="16" spellcheck="false"></textarea>
      <div class="filters"><button id="plan-save" class="primary">Save the plan</button><button id="plan-close">Close</button><span id="plan-problems" class="error-text"></span></div>
    </div>
    <form id="fork-form" class="card" hidden>
      <h2 id="fork-title">Fork</h2>
      <p id="fork-what" class="muted"></p>
      <div class="filters"><label>agent <input id="fork-agent" class="mono" size="24"></label><label>model <input id="fork-model" class="mono" size="20"></label><label>from step <input id="fork-step" class="mono" type="number" min="0" size="4" placeholder="start"></label></div>
      <textarea id="fork-description" rows="4" spellcheck="false"></textarea>
      <div class="filters"><button id="fork-submit" type="submit" class="primary">Fork</button><button id="fork-close" type="button">Close</button></div>
      <div id="fork-problems" class="error-text"></div>
    </form>
    <div id="run-waits"></div>
    <div id="run-inbox"></div>
    <div id="grants"></div>
    <div class="cols">
      <div>
        <div class="card"><h2>Tree <span id="tree-count" class="muted"></span></h2><div id="tree" class="tree vlist" data-row-class="trow"></div></div>
        <div class="card"><h2>Tasks <span id="tasks-count" class="muted"></span></h2><div class="vhead tasks-grid"><span>TASK</span><span>STATUS</span><span>ATTEMPTS</span><span>POOL</span><span>DETAIL</span></div><div id="tasks" class="vlist tasks" data-row-class="vrow tasks-grid"></div><div id="result"></div></div>
        <div class="card"><h2>Timeline <span class="muted">(UTC; click a task for its panel)</span></h2><div id="timeline" class="timeline"></div></div>
      </div>
      <div>
        <div class="card dag"><h2>Plan</h2><div id="dag"></div></div>
        <div class="card">
          <div class="tabs"><button id="tab-events" class="on">Events</button><button id="tab-ws">Workspace</button><button id="tab-mbox">Mailboxes</button><button id="tab-state">Session state</button></div>
          <div id="pane-events">
            <div class="filters">
              profile <select id="profile">${['user', 'debug', 'metrics'].map((p) => `<option ${p === profile ? 'selected' : ''}>${p}</option>`).join('')}</select>
              children <select id="children">${['off', 'linked', 'flatten'].map((p) => `<option ${p === children ? 'selected' : ''}>${p}</option>`).join('')}</select>
              <span id="events-state" class="muted"></span>
            </div>
            <div id="events" class="vlist events" data-row-class="ev"></div>
          </div>
          <div id="pane-ws" hidden><div id="ws"></div></div>
          <div id="pane-mbox" hidden><div class="filters">mailbox of task <select id="mbox-reader"></select></div><div id="mbox"></div></div>
          <div id="pane-state" hidden><div id="state-keys" class="filters"></div><div class="filters">key <input id="state-key" placeholder="a session-state key"><button id="state-get">Read</button></div><div id="state"></div></div>
        </div>
      </div>
    </div>
    <aside id="task-panel" class="card" hidden></aside>`;
  // The task whose panel is open (kept in the URL: a link opens it too).
  let openTask = q.get('task') || null;
  const keepQuery = () => setQuery(`/run/${runId}`, { profile: $('#profile').value, children: $('#children').value, task: openTask });
  for (const sel of ['#profile', '#children']) {
    $(sel).addEventListener('change', () => {
      keepQuery();
      route();
    });
  }
  const tabs = ['events', 'ws', 'mbox', 'state'];
  const show = (name) => tabs.forEach((t) => { $(`#pane-${t}`).hidden = t !== name; $(`#tab-${t}`).className = t === name ? 'on' : ''; });
  $('#tab-events').onclick = () => show('events');
  $('#tab-ws').onclick = () => { show('ws'); loadWorkspace(runId); };
  $('#tab-mbox').onclick = () => { show('mbox'); loadMailbox(runId); };
  $('#mbox-reader').onchange = () => loadMailbox(runId);
  // The session's keys (`state.list`), each a button that reads it.
  $('#tab-state').onclick = async () => {
    show('state');
    try {
      const k = await api(`/api/runs/${runId}/state`);
      set('#state-keys', k.keys.length
        ? `keys of session <span class="mono">${esc(short(k.session_id))}</span>: ${k.keys.map((x) => `<button class="mono" data-state-key="${esc(x)}">${esc(x)}</button>`).join(' ')}${k.more ? ` <span class="muted">— the first ${k.keys.length} keys; read any other by its name below</span>` : ''}`
        : '<span class="muted">No keys are set in this run\'s session.</span>');
    } catch (e) { set('#state-keys', `<span class="muted">${esc(e.message)}</span>`); }
  };
  $('#state-keys').addEventListener('click', (ev) => {
    const b = ev.target.closest('[data-state-key]');
    if (!b) return;
    $('#state-key').value = b.dataset.stateKey;
    $('#state-get').click();
  });
  $('#state-get').onclick = async () => {
    const key = $('#state-key').value.trim();
    if (!key) return;
    try {
      const v = await api(`/api/runs/${runId}/state/${encodeURIComponent(key)}`);
      set('#state', `<div class="kv"><span>revision</span><span>${v.revision}</span><span>written</span><span>${time(v.ts)}</span></div><pre class="mono">${esc(JSON.stringify(v.value, null, 2))}</pre>`);
    } catch (e) { set('#state', `<p class="muted">${esc(e.message)}</p>`); }
  };
  let currentPlan = null;
  // The run's plan name, for what the page says about it (toasts).
  let runTitle = null;
  $('#compare').addEventListener('submit', (e) => {
    e.preventDefault();
    const other = $('#compare-with').value.trim();
    if (other) location.hash = `#/diff/${runId}/${encodeURIComponent(other)}`;
  });
  main().querySelectorAll('[data-action]').forEach((b) => {
    b.onclick = async () => {
      const action = b.dataset.action;
      if (action === 'edit') {
        $('#plan-text').value = JSON.stringify(currentPlan || {}, null, 2);
        set('#plan-problems', '');
        $('#edit-plan').hidden = false;
        return;
      }
      const rollback = $('#rollback').checked;
      if (action === 'cancel' && !confirm(`Cancel this run${rollback ? ' and roll back what it did' : ''}?`)) return;
      const body = { reason: 'from the console' };
      const minutes = parseInt($('#hold-min').value, 10);
      if ((action === 'pause' || action === 'takeover') && minutes > 0) body.timeout_ms = minutes * 60000;
      if (action === 'cancel') body.rollback = rollback;
      try {
        const r = await api(`/api/runs/${runId}/${action}`, { body });
        toast(`${action} run ${runName(runTitle, runId)}: ${r.applied === false ? (r.detail || `already ${r.status}`) : (r.pending ? 'recorded, not applied yet' : 'done')}`);
        refreshRun();
      } catch (e) { toast(`${action} run ${runName(runTitle, runId)}: ${e.message}`, true); }
    };
  });
  $('#plan-close').onclick = () => { $('#edit-plan').hidden = true; };
  $('#plan-save').onclick = async () => {
    let plan;
    try { plan = JSON.parse($('#plan-text').value); } catch (e) { set('#plan-problems', esc(`not JSON: ${e.message}`)); return; }
    try {
      const r = await api(`/api/runs/${runId}/edit`, { body: { plan, reason: 'edited in the console' } });
      toast(`plan edited${r.changed ? `: ${r.changed.length} task(s) changed` : ''}`);
      $('#edit-plan').hidden = true;
      refreshRun();
    } catch (e) {
      const problems = (e.data && e.data.problems) || [];
      set('#plan-problems', esc([e.message, ...problems.map((p) => p.message || JSON.stringify(p))].join(' · ')));
    }
  };
  // Forking the run from a task: the task, with another agent or other instructions if the
  // person gives them, and what is downstream of it run again in a new run; every other task
  // that succeeded keeps this run's result. The page then follows the fork.
  let runTasks = [];
  const forkForm = $('#fork-form');
  const openFork = (task) => {
    const sub = ((currentPlan && currentPlan.subtasks) || []).find((t) => t.id === task) || {};
    const again = downstreamOf(currentPlan, task);
    const keeps = runTasks.filter((t) => !again.has(t.task_id) && t.status === 'succeeded').map((t) => t.task_id);
    const rerun = runTasks.filter((t) => !keeps.includes(t.task_id)).map((t) => t.task_id);
    forkForm.dataset.task = task;
    set('#fork-title', `Fork from task <span class="mono">${esc(task)}</span>`);
    set('#fork-what', `A new run of this run's plan: ${esc(rerun.join(', '))} run${rerun.length === 1 ? 's' : ''} again; ${keeps.length ? `${esc(keeps.join(', '))} keep${keeps.length === 1 ? 's' : ''} this run's result` : 'no result is kept'}. Empty fields leave the task as it was.`);
    const agent = $('#fork-agent');
    agent.value = '';
    agent.placeholder = sub.agent || (sub.role ? `a member of role ${sub.role}` : 'the default agent');
    const model = $('#fork-model');
    model.value = '';
    model.placeholder = "its agent's";
    $('#fork-step').value = '';
    const description = $('#fork-description');
    description.value = '';
    description.placeholder = `instructions for ${task} (now: ${sub.description || 'none'})`;
    set('#fork-problems', '');
    forkForm.hidden = false;
    forkForm.scrollIntoView({ block: 'nearest' });
    agent.focus();
  };
  $('#fork-close').onclick = () => { forkForm.hidden = true; };
  forkForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const at = forkForm.dataset.task;
    const body = { at };
    const agent = $('#fork-agent').value.trim();
    if (agent) body.agent = agent;
    const description = $('#fork-description').value;
    if (description.trim()) body.description = description;
    const model = $('#fork-model').value.trim();
    if (model) body.model = model;
    // A step of an LLM agent's conversation (`agent_step` events): the steps before it are kept.
    const step = $('#fork-step').value.trim();
    if (step !== '') body.step = Number(step);
    set('#fork-problems', '');
    // One fork per click: each accepted fork is a new run.
    const submit = $('#fork-submit');
    submit.disabled = true;
    try {
      const r = await api(`/api/runs/${runId}/fork`, { body });
      if (!r.run_id || r.status === 'rejected') {
        set('#fork-problems', refusalHtml('The fork was rejected', null, 'its plan was not admitted', r.errors));
        return;
      }
      toast(`forked run ${runName(runTitle, runId)} at task ${at}: ${r.reused.length} result(s) kept, ${r.rerun.length} task(s) run again`);
      location.hash = `#/run/${r.run_id}`;
    } catch (e) {
      set('#fork-problems', refusalHtml('The fork was refused', e.code, e.message, e.data && e.data.problems));
    } finally {
      submit.disabled = false;
    }
  });
  // The tools approved for the rest of the run's session, each revocable.
  const loadGrants = async (session) => {
    if (!session) return;
    try {
      const g = await api(`/api/runs/${runId}/grants`);
      const off = me.operator ? '' : 'disabled title="operators only"';
      set('#grants', g.grants.length ? `<div class="card"><h2>Approved for this session</h2><table><tr><th>TOOL</th><th>BY</th><th>AT</th><th>COMMENT</th><th></th></tr>
        ${g.grants.map((x) => `<tr data-grant="${esc(x.tool)}"><td class="mono">${esc(x.tool)}</td><td>${esc(x.by)}</td><td>${time(x.at)}</td><td class="muted">${esc(x.comment || '')}</td>
          <td><button data-revoke="${esc(x.tool)}" ${off}>revoke</button></td></tr>`).join('')}</table></div>` : '');
    } catch (e) { set('#grants', `<p class="muted">${esc(e.message)}</p>`); }
  };
  $('#grants').addEventListener('click', async (ev) => {
    const b = ev.target.closest('[data-revoke]');
    if (!b) return;
    try {
      await api(`/api/runs/${runId}/revoke`, { body: { tool: b.dataset.revoke } });
      toast(`revoked: ${b.dataset.revoke} waits for a person again`);
    } catch (e) { toast(`revoke: ${e.message}`, true); }
    loadGrants(sessionOf);
  });
  let sessionOf = null;
  const answered = () => loadGrants(sessionOf);
  window.addEventListener('flotilla:answered', answered);
  cleanup.push(() => window.removeEventListener('flotilla:answered', answered));

  // A task's own pause and resume, and completing a task of a run under human control.
  $('#tasks').addEventListener('click', async (ev) => {
    const b = ev.target.closest('[data-task-action]');
    if (!b) {
      // A click anywhere else on a task's row opens its panel.
      const row = ev.target.closest('[data-task]');
      if (row) showTask(row.dataset.task);
      return;
    }
    const action = b.dataset.taskAction;
    const task = b.closest('[data-task]').dataset.task;
    if (action === 'fork') { openFork(task); return; }
    const body = { task, reason: 'from the console' };
    if (action === 'pause') {
      const m = prompt(`Pause task ${task} for how many minutes? (empty: the default, 24 h)`, '');
      if (m == null) return;
      const minutes = parseInt(m, 10);
      if (m.trim() && !(minutes > 0)) { toast(`not a number of minutes: ${m}`, true); return; }
      if (minutes > 0) body.timeout_ms = minutes * 60000;
    }
    if (action === 'complete') {
      const result = prompt(`The result of task ${task}:`);
      if (result == null) return;
      body.result = result;
    }
    try {
      const r = await api(`/api/runs/${runId}/${action}`, { body });
      toast(`${action} task ${task} of run ${runName(runTitle, runId)}: ${r.applied === false ? (r.detail || 'nothing to do') : (action === 'complete' ? 'completed' : (r.pending ? 'recorded, not applied yet' : 'done'))}`);
      refreshRun();
    } catch (e) { toast(`${action} task ${task} of run ${runName(runTitle, runId)}: ${e.message}`, true); }
  });

  // The task panel: one task's input, result, attempts, worker, timings, waits and events
  // (`/api/runs/RUN/tasks/TASK`), opened by a click on its DAG node, its row or its timeline
  // line, read again with the run while it is open.
  let running = {};
  const panel = $('#task-panel');
  let taskReading = false;
  async function loadTask() {
    const task = openTask;
    if (!task || taskReading) return;
    taskReading = true;
    try {
      const d = await api(`/api/runs/${runId}/tasks/${encodeURIComponent(task)}`);
      if (left || openTask !== task) return;
      panel.hidden = false;
      panel.dataset.task = task;
      set('#task-panel', taskPanel(d));
    } catch (e) {
      if (openTask === task) set('#task-panel', `<div class="panel-head"><h2>Task <span class="mono">${esc(task)}</span></h2><button id="task-close" title="close">×</button></div><p class="muted">${esc(e.message)}</p>`);
    } finally { taskReading = false; }
  }
  function showTask(task) {
    openTask = task;
    keepQuery();
    panel.hidden = false;
    panel.dataset.task = task;
    loadTask();
  }
  panel.addEventListener('click', (ev) => {
    if (!ev.target.closest('#task-close')) return;
    openTask = null;
    panel.hidden = true;
    delete panel.dataset.task;
    keepQuery();
  });
  for (const sel of ['#dag', '#timeline']) {
    $(sel).addEventListener('click', (ev) => {
      const g = ev.target.closest('g[data-task]');
      if (g) showTask(g.dataset.task);
    });
  }
  if (openTask) showTask(openTask);

  let ended = false;
  // The run's record, tasks and DAG; its tree and what waits for a person when asked. Drawn
  // when the page is idle (events streaming in are drawn first).
  const readRun = async ({ tree: withTree = true, inbox = true } = {}) => {
    try {
      const { view, plan, label, progress, task_labels: labels = {}, timeline, fork_of_name: forkName } = await api(`/api/runs/${runId}`);
      await idle();
      if (left || !$('#run-title')) return; // the person moved on
      const r = view.record;
      // What a person reads (as `flotilla runs show`): `waiting` for a run someone must act
      // on, with the record's own status beside it.
      const shownAs = label || r.status;
      runTitle = r.name;
      set('#run-title', `${esc(r.name || 'Run')} <span class="mono muted" title="${esc(runId)}">${short(runId)}</span> ${status(shownAs)}${shownAs !== r.status ? ` <span class="muted run-status">(the run is ${esc(r.status)})</span>` : ''} <span class="mono muted run-id">${esc(runId)}</span>`);
      $('#run-title').dataset.runStatus = r.status;
      const waiting = (progress && progress.waiting) || [];
      running = (progress && progress.running) || {};
      set('#run-waits', waiting.length ? `<div class="card waits"><h2>Waiting for a person</h2>${waiting.map((w) => `
        <div class="wait" data-wait-kind="${esc(w.kind)}"${w.task_id ? ` data-task="${esc(w.task_id)}"` : ''}>
          <b>${esc(w.kind)}</b>${w.task_id ? ` of task <b>${esc(w.task_id)}</b>` : ''}: ${esc(w.what)}${w.deadline ? ` <span class="muted">(its default at ${time(w.deadline)})</span>` : ''}
          <div class="muted">answer: ${esc(answerHere(w))} — or <code>${esc(w.answer)}</code></div></div>`).join('')}</div>` : '');
      const runLabels = Object.entries(r.labels || {}).map(([k, v]) => `${k}=${v}`).join(' ');
      set('#run-meta', `started ${time(r.created_at)} · ${ms(durationOf(r))} · tasks ${r.tasks.succeeded}/${r.tasks.total}
        ${r.session_id ? ` · session <a href="#/runs?session=${r.session_id}">${short(r.session_id)}</a>` : ''}
        ${r.handle.parent_run_id ? ` · parent <a href="#/run/${r.handle.parent_run_id}">${short(r.handle.parent_run_id)}</a>` : ''}
        ${runLabels ? ` · ${esc(runLabels)}` : ''}${r.outcome && r.outcome.reason ? ` · ${esc(r.outcome.reason)}` : ''}`);
      // A fork (`run.fork`) says which run it forks, at which task, and how many of its
      // results it kept (as `flotilla runs show`).
      const f = r.fork_of;
      set('#run-fork', f ? `fork of <a href="#/run/${esc(f.run_id)}" title="${esc(f.run_id)}">${esc(runName(forkName, f.run_id))}</a> at <b class="mono">${esc(f.task_id)}</b> (${f.reused} result${f.reused === 1 ? '' : 's'} kept)` : '');
      const going = !terminal(r.status);
      currentPlan = view.plan || plan;
      runTasks = view.tasks;
      // The tasks of a fork that kept the original's result (its plan says which).
      const origin = (currentPlan && currentPlan.fork) || null;
      const kept = new Set(((origin && origin.reused) || []).map((k) => k.task_id));
      // A plan is edited while the run is under human control (taken over).
      const edit = main().querySelector('[data-action="edit"]');
      if (edit) edit.hidden = r.status !== 'human_control';
      // A run that has ended takes no more controls: its buttons say so instead of
      // answering "not applied".
      // Set on every draw from this run's status (and the person's role), so it follows the
      // run however the page was reached.
      const endedNote = `the run has ended (${r.status})`;
      main().querySelectorAll('[data-action]').forEach((b) => {
        b.disabled = !going || !me.operator;
        b.title = !me.operator ? 'operators only' : (going ? '' : endedNote);
      });
      const hold = $('#hold-min');
      if (hold) hold.disabled = !going || !me.operator;
      sessionOf = r.session_id || null;
      const off = me.operator ? '' : 'disabled title="operators only"';
      // An ended run is forked from one of its tasks (`run.fork`).
      const forkable = ['succeeded', 'failed', 'cancelled'].includes(r.status);
      const taskActions = (t) => {
        if (forkable) return `<button data-task-action="fork" ${me.operator ? 'title="run this task and what is downstream of it again, in a new run"' : off}>fork from here…</button>`;
        if (!going || taskDone(t.status)) return '';
        const b = [t.paused_until
          ? `<button data-task-action="resume" ${off}>resume</button>`
          : `<button data-task-action="pause" ${off}>pause</button>`];
        if (r.status === 'human_control' && ['waiting', 'retrying', 'awaiting_approval'].includes(t.status)) {
          b.push(`<button data-task-action="complete" ${off}>complete…</button>`);
        }
        return b.join(' ');
      };
      // What a task does now: what it waits for, the worker running it and for how long,
      // queued for a worker, paused, its error.
      const detail = (t) => {
        const w = waiting.find((x) => x.task_id === t.task_id);
        const a = running[t.task_id];
        return [
          w ? `waits for ${w.kind}: ${w.what}` : '',
          a ? `on ${a.worker} for ${ms(since(a.started_at))}` : '',
          !w && !a && t.status === 'dispatched' ? 'queued for a worker' : '',
          t.paused_until ? `paused until ${time(t.paused_until)}` : '',
          t.error ? (t.error.message || JSON.stringify(t.error)) : (t.skip_reason || ''),
        ].filter(Boolean).join(' · ');
      };
      // Virtualised like the events: a 1,000-task run draws the rows in view.
      // A fork's task that kept the original's result says so beside its status.
      const stateOf = (t) => (kept.has(t.task_id)
        ? `<span title="kept the result of run ${esc(runName(forkName, origin.run_id))} (${esc(origin.run_id)})">${status(labels[t.task_id] || t.status)} <span class="muted kept">· kept</span></span>`
        : status(labels[t.task_id] || t.status));
      taskRows = view.tasks.map((t) => `<div class="task" data-task="${esc(t.task_id)}"><span class="mono">${esc(t.task_id)}</span>${stateOf(t)}<span>${t.attempts}</span><span>${esc(t.pool || '-')}</span>
          <span class="detail" title="${esc(detail(t))}"><span class="task-actions">${taskActions(t)}</span><span class="muted">${esc(detail(t))}</span></span></div>`);
      ($('#tasks-count') || {}).textContent = `${view.tasks.length}`;
      $('#tasks').style.height = `${Math.min(taskRows.length * TASK_ROW + 2, 420)}px`;
      tasksList.renderNow(taskRows.length);
      set('#result', r.outcome && r.outcome.final_result ? `<h2>Result</h2><pre class="mono">${esc(r.outcome.final_result.response)}</pre>` : '');
      drawDag($('#dag'), view.plan || plan, view.tasks, labels, (t) => (running[t.task_id] ? ms(since(running[t.task_id].started_at)) : ''));
      set('#timeline', drawTimeline(timeline, labels));
      if (openTask) loadTask();
      const readers = $('#mbox-reader');
      if (readers && readers.options.length !== view.tasks.length) {
        const was = readers.value;
        readers.innerHTML = view.tasks.map((t) => `<option>${esc(t.task_id)}</option>`).join('');
        if (was) readers.value = was;
      }
      ended = terminal(r.status);
    } catch (e) { toast(e.message, true); }
    if (inbox) { loadInbox(runId, $('#run-inbox')); loadGrants(sessionOf); }
    if (!withTree) return;
    try {
      const t = await api(`/api/runs/${runId}/tree`);
      await idle();
      const rows = flattenTree(t.root);
      ($('#tree-count') || {}).textContent = `${t.runs} run(s)${t.omitted ? `, ${t.omitted} not listed` : ''}`;
      treeRows = rows;
      // Virtualised: a 1,000-run tree keeps only the rows in view in the page.
      $('#tree').style.height = `${Math.min(rows.length * TREE_ROW + 2, 360)}px`;
      tree.renderNow(rows.length);
    } catch (e) { /* the run may not be recorded yet */ }
  };
  // One refresh at a time, and a large run's (a long read: a 1,000-run tree) at most every
  // four times its duration: the page keeps drawing events in between.
  let busy = null;
  let lastTook = 0;
  let lastAt = 0;
  const refreshRun = (parts) => {
    if (busy) return busy;
    const t0 = performance.now();
    busy = readRun(parts).finally(() => { busy = null; lastTook = performance.now() - t0; lastAt = performance.now(); });
    return busy;
  };
  const tree = vlist($('#tree'), TREE_ROW, 0, (i) => {
    const { node, depth } = treeRows[i] || {};
    if (!node) return '';
    return `<div class="node d${Math.min(depth, 12)}" data-run="${node.run_id}">${depth ? '└ ' : ''}<a href="#/run/${node.run_id}">${esc(node.agent || node.name || short(node.run_id))}</a> ${status(node.status)}
        <span class="muted">${ms(node.duration_ms)} · ${node.usage.prompt_tokens + node.usage.completion_tokens} tok${node.subtree_usage.cost_usd ? ` · $${node.subtree_usage.cost_usd.toFixed(4)}` : ''}</span></div>`;
  });
  let treeRows = [];
  let taskRows = [];
  const tasksList = vlist($('#tasks'), TASK_ROW, 0, (i) => taskRows[i] ?? '');
  await refreshRun();
  // The person moved on while the run was read: this page is gone, nothing more to set up.
  if (!$('#events')) return;
  // At most once a second, and for a large run at most every 4× its read (see refreshRun).
  // The tree is read again when a run under this one changed; the inbox has its own stream.
  let treeChanged = false;
  const refreshSoon = debounce(1000, () => {
    if (performance.now() - lastAt < 3 * lastTook) { refreshSoon(); return; }
    refreshRun({ tree: treeChanged, inbox: false });
    treeChanged = false;
  });
  // Tasks follow the run's record changes, the tree its children's.
  live('/api/runs/stream', {
    run: (m) => {
      const c = JSON.parse(m.data);
      const h2 = c.record && c.record.handle;
      if (!h2) return;
      if (h2.run_id === runId) refreshSoon();
      else if (h2.root_run_id === runId || h2.parent_run_id === runId) { treeChanged = true; refreshSoon(); }
    },
  });
  live('/api/inbox/stream', { inbox: () => { loadInbox(runId, $('#run-inbox')); loadGrants(sessionOf); } });
  // Durations tick while the run goes on.
  every(2000, () => { if (!ended && performance.now() - lastAt >= 3 * lastTook) refreshRun({ inbox: false }); });

  // Events: the `flotilla watch` projection, streamed; replies stream in as increments.
  const lines = [];
  const streaming = new Map(); // run+task -> index of its live reply line
  const box = $('#events');
  const list = vlist(box, 24, 0, (i) => {
    const l = lines[i];
    return l ? `<span class="${l.cls}" title="${esc(l.text)}">${esc(l.text)}</span>` : '';
  });
  // Follow the end unless the person scrolled up; read on scroll, not per event (reading the
  // layout per event would force one per event in a burst).
  let follow = true;
  box.addEventListener('scroll', () => { follow = list.atBottom(); });
  // Events are drawn once per frame, however many arrived in it.
  let frame = 0;
  const draw = () => {
    frame = 0;
    ($('#events-state') || {}).textContent = `${lines.length} events · ${streamEnded ? 'the run ended' : 'live'}`;
    list.renderNow(lines.length, follow);
  };
  let streamEnded = false;
  const es = live(`/api/runs/${runId}/events?profile=${profile}&children=${children}`, {
    event: (m) => {
      const pe = JSON.parse(m.data);
      const ev = pe.event.event;
      const key = `${pe.run_id}/${pe.event.task_id || ''}`;
      if (ev.type === 'assistant_reply' && !ev.final) {
        const i = streaming.get(key);
        if (i !== undefined) {
          lines[i].text += ev.text;
        } else {
          const l = eventLine(pe);
          l.cls = 'streaming';
          streaming.set(key, lines.length);
          lines.push(l);
        }
      } else if (ev.type === 'assistant_reply' && streaming.has(key)) {
        const i = streaming.get(key);
        lines[i] = eventLine(pe);
        streaming.delete(key);
      } else {
        lines.push(eventLine(pe));
      }
      if (!frame) frame = requestAnimationFrame(draw);
      // For extensions and measurements: each projected event once handled (drawn in the
      // next frame).
      window.dispatchEvent(new CustomEvent('flotilla:event', { detail: pe }));
      if (ev.type === 'workflow' || ev.type === 'agent_run_started') refreshSoon();
    },
    end: () => {
      streamEnded = true;
      ended = true;
      if (frame) { cancelAnimationFrame(frame); frame = 0; }
      draw();
      es.close();
      refreshRun();
    },
    failed: (m) => toast(m.data, true),
  });
}

async function loadWorkspace(runId) {
  try {
    const page = await api(`/api/runs/${runId}/workspace`);
    const entries = page.entries || [];
    set('#ws', entries.length
      ? `<table><tr><th>SEQ</th><th>TOPIC</th><th>BY</th><th>ENTRY</th></tr>${entries.map((e) => `<tr><td>${e.seq}</td><td>${esc(e.topic)}</td>
          <td>${esc((e.writer && e.writer.task_id) || '')}</td><td class="mono wrap">${esc(JSON.stringify(e.entry))}</td></tr>`).join('')}</table>`
      : '<p class="muted">No workspace entries.</p>');
  } catch (e) { set('#ws', `<p class="muted">${esc(e.message)}</p>`); }
}

async function loadMailbox(runId) {
  const reader = $('#mbox-reader').value;
  if (!reader) return;
  try {
    const page = await api(`/api/runs/${runId}/mailbox/${encodeURIComponent(reader)}?since=0`);
    const m = page.messages || [];
    set('#mbox', m.length
      ? `<table><tr><th>SEQ</th><th>KIND</th><th>FROM</th><th>TO</th><th>PAYLOAD</th></tr>${m.map((x) => `<tr><td>${x.seq}</td><td>${esc(x.kind)}</td>
          <td>${esc(x.from)}</td><td>${esc(x.to)}</td><td class="mono wrap">${esc(JSON.stringify(x.payload))}</td></tr>`).join('')}</table>`
      : '<p class="muted">No messages.</p>');
  } catch (e) { set('#mbox', `<p class="muted">${esc(e.message)}</p>`); }
}

// ---------- inbox ----------

// The plan names of the runs the inbox lists (its answer's `names`), for its cards and toasts.
const runNames = new Map();

function approvalCard(rec) {
  const q = rec.request;
  const name = runName(runNames.get(q.run_id), q.run_id);
  const input = q.input == null ? '' : JSON.stringify(q.input, null, 2);
  const canAnswer = me.operator && rec.status === 'pending';
  return `<div class="card approval" data-approval="${esc(q.approval_id)}" data-run="${q.run_id}">
    <div><b>${esc(q.trigger)}</b> · task <b class="card-task">${esc(q.task_id)}</b> of run <a href="#/run/${q.run_id}" class="card-run" title="${esc(q.run_id)}">${esc(name)}</a>${q.action ? ` · action <b>${esc(q.action)}</b>` : ''}${q.agent ? ` · agent ${esc(q.agent)}` : ''}
      · ${esc(q.approval_id)} · ${status(rec.status)}
      <span class="muted">deadline ${time(q.deadline)}</span></div>
    <p>${esc(q.description)}</p>
    ${input ? `<pre class="mono">${esc(input)}</pre>` : ''}
    ${q.tool_call ? `<div>tool call <b>${esc(q.tool_call.tool)}</b> <span class="mono muted">${esc(q.tool_call.call_id)}</span></div>` : ''}
    <div class="muted">default at the deadline: ${esc(JSON.stringify(q.default))} · the agent's reasoning so far: <a href="#/run/${q.run_id}?profile=debug">the run's events</a></div>
    <div class="answer">
      <input class="comment" placeholder="comment for the record" size="40" ${canAnswer ? '' : 'disabled'}>
      <button class="primary" data-decision="approve" ${canAnswer ? '' : 'disabled'}>Approve</button>
      <label title="approve this tool for the rest of the run's session"><input type="checkbox" class="always" ${canAnswer ? '' : 'disabled'}> always (this session)</label>
      <button class="danger" data-decision="reject" ${canAnswer ? '' : 'disabled'}>Reject</button>
      <label title="record the rejection as an incident of the task's agent (and role)"><input type="checkbox" class="incident" ${canAnswer ? '' : 'disabled'}> incident</label>
      <button data-decision="edit" ${canAnswer ? '' : 'disabled'}>Edit input…</button>
      <button data-decision="respond" ${canAnswer ? '' : 'disabled'}>Respond…</button>
      ${me.operator ? '' : '<span class="muted">operators only</span>'}
    </div>
    <textarea class="payload" hidden></textarea>
  </div>`;
}

function wireApprovals(root, records, reload) {
  root.querySelectorAll('.approval').forEach((card) => {
    const rec = records.find((r) => r.request.approval_id === card.dataset.approval && r.request.run_id === card.dataset.run);
    card.querySelectorAll('[data-decision]').forEach((b) => {
      b.onclick = async () => {
        const decision = b.dataset.decision;
        const payload = card.querySelector('.payload');
        const body = { decision, comment: card.querySelector('.comment').value, digest: rec.request.digest };
        if (decision === 'edit' || decision === 'respond') {
          if (payload.hidden) {
            payload.hidden = false;
            payload.value = decision === 'edit' ? JSON.stringify(rec.request.input ?? {}, null, 2) : '';
            payload.placeholder = decision === 'edit' ? 'the input to run with (JSON)' : 'the result';
            b.textContent = decision === 'edit' ? 'Run with this input' : 'Send result';
            return;
          }
          if (decision === 'edit') {
            try { body.input = JSON.parse(payload.value); } catch { toast('the input is not JSON', true); return; }
          } else body.result = payload.value;
        }
        if (decision === 'approve' && card.querySelector('.always').checked) body.always = true;
        if (decision === 'reject') {
          body.message = body.comment;
          if (card.querySelector('.incident').checked) body.incident = true;
        }
        try {
          const r = await api(`/api/approvals/${card.dataset.run}/${card.dataset.approval}`, { body });
          const a = r.record.answer;
          // Which task of which run, and what became of it.
          const what = `task ${rec.request.task_id} of run ${runName(runNames.get(rec.request.run_id), rec.request.run_id)}`;
          const done = { approve: 'approved', reject: 'rejected', edit: 'ran with an edited input:', respond: 'answered:' };
          toast(r.outcome === 'decided'
            ? `${done[a.decision] || a.decision} ${what}, by ${a.by}`
            : `${what}: already decided${a ? ` (${done[a.decision] || a.decision} by ${a.by})` : ` (${r.record.status})`}`);
          reload();
          window.dispatchEvent(new CustomEvent('flotilla:answered'));
        } catch (e) { toast(`${decision}: ${e.message}`, true); }
      };
    });
  });
}

async function loadInbox(runId, root) {
  if (!root) return;
  try {
    const l = await api(`/api/inbox${runId ? `?run=${runId}` : ''}`);
    const recs = l.approvals || [];
    for (const [id, n] of Object.entries(l.names || {})) runNames.set(id, n);
    if (!root.isConnected) return;
    if (!runId) {
      const c = $('#inbox-count');
      c.hidden = !recs.length;
      c.textContent = recs.length;
    }
    root.innerHTML = recs.length ? recs.map(approvalCard).join('')
      : (runId ? '' : '<p class="muted" id="inbox-empty">Nothing is waiting for a person.</p>');
    wireApprovals(root, recs, () => loadInbox(runId, root));
  } catch (e) {
    root.innerHTML = `<p class="muted">${esc(e.message)}</p>`;
  }
}

async function viewInbox() {
  main().innerHTML = '<h1>Inbox</h1><p class="muted">Approvals, questions and client tool requests across runs and sessions.</p><div id="inbox"></div>';
  const reload = () => loadInbox(null, $('#inbox'));
  await reload();
  live('/api/inbox/stream', { inbox: debounce(200, reload) });
  every(10000, reload);
}

// ---------- two runs compared ----------

async function viewDiff(a, b) {
  main().innerHTML = `<h1>Two runs compared</h1><div id="diff"><p class="muted">reading both runs…</p></div>`;
  let d;
  try {
    d = await api(`/api/diff/${encodeURIComponent(a)}/${encodeURIComponent(b || '')}`);
  } catch (e) {
    set('#diff', `<p class="error-text">${esc(e.message)}</p>`);
    return;
  }
  const tokens = (u) => (u.prompt_tokens + u.completion_tokens);
  const cost = (c) => (c > 0 ? `$${c.toFixed(4)}` : '-');
  const side = (s) => `<a href="#/run/${esc(s.run_id)}">${esc(s.name || 'Run')} <span class="mono">${short(s.run_id)}</span></a>`;
  const row = (what, x, y) => `<tr${x === y ? '' : ' class="changed"'}><th>${what}</th><td>${x}</td><td>${y}</td></tr>`;
  const runStatus = (s) => `${status(s.status)}${s.reason ? ` <span class="muted">${esc(s.reason)}</span>` : ''}`;
  const pair = (t, f) => `${t.a ? f(t.a) : '-'} → ${t.b ? f(t.b) : '-'}`;
  // A unified diff's lines, coloured: `-` from A, `+` from B.
  const lines = (text) => text.split('\n').map((l) => {
    const cls = l.startsWith('+') ? 'add' : l.startsWith('-') ? 'del' : l.startsWith('@@') ? 'hunk' : '';
    return `<span class="${cls}">${esc(l)}</span>`;
  }).join('\n');
  set('#diff', `<table class="diff-runs"><tr><th></th><th>A</th><th>B</th></tr>
      ${row('run', side(d.a), side(d.b))}
      ${row('status', runStatus(d.a), runStatus(d.b))}
      ${row('tasks', `${d.a.tasks} (${d.a.succeeded} ok, ${d.a.failed} failed)`, `${d.b.tasks} (${d.b.succeeded} ok, ${d.b.failed} failed)`)}
      ${row('attempts', d.a.attempts, d.b.attempts)}
      ${row('duration', ms(d.a.duration_ms), ms(d.b.duration_ms))}
      ${row('tokens', `${tokens(d.a.usage)} in ${d.a.usage.calls} call(s)`, `${tokens(d.b.usage)} in ${d.b.usage.calls} call(s)`)}
      ${row('cost', cost(d.a.usage.cost_usd), cost(d.b.usage.cost_usd))}
    </table>
    <p id="diff-count"><b>${d.changed}</b> of ${d.tasks.length} task(s) changed</p>
    <table id="diff-tasks"><tr><th>TASK</th><th>STATUS</th><th>ATTEMPTS</th><th>LATENCY</th><th>TOKENS</th><th>COST</th><th>RESULT</th></tr>
      ${d.tasks.map((t) => `<tr data-task="${esc(t.task_id)}" data-changed="${t.changed}"${t.changed ? ' class="changed"' : ''}>
        <td class="mono">${t.changed ? '● ' : ''}${esc(t.task_id)}</td>
        <td>${pair(t, (s) => esc(s.status))}</td><td>${pair(t, (s) => s.attempts)}</td>
        <td>${pair(t, (s) => (s.latency_ms == null ? '-' : ms(s.latency_ms)))}</td>
        <td>${pair(t, (s) => tokens(s.usage))}</td><td>${pair(t, (s) => cost(s.usage.cost_usd))}</td>
        <td>${!t.a ? 'only in B' : !t.b ? 'only in A' : t.diff ? 'changed (below)' : t.changed ? 'status changed' : 'same'}</td></tr>`).join('')}
    </table>
    ${d.tasks.filter((t) => t.diff).map((t) => `<h2 class="mono">${esc(t.task_id)}</h2><pre class="diff" data-task="${esc(t.task_id)}">${lines(t.diff)}${t.diff_truncated ? '\n… (cut at 16 KiB)' : ''}</pre>`).join('')}`);
}

// ---------- team ----------

async function viewTeam() {
  main().innerHTML = '<h1>Team</h1><div id="team"></div>';
  const load = async () => {
    try {
      const { team, trust } = await api('/api/team');
      const trusted = new Map(((trust && trust.records) || []).map((r) => [`${r.scope}/${r.name}`, r]));
      const level = (name) => { const r = trusted.get(`agent/${name}`); return r ? (r.pinned || r.earned) : ''; };
      // The last incident, as `flotilla trust show` reports it (a rejection as an incident, a
      // sensitive action that failed: the trust record's), or the last failure the failure
      // record counted — whichever is newer.
      const incident = (m) => {
        const t = (trusted.get(`agent/${m.name}`) || {}).last_incident;
        const f = m.failures && m.failures.last_incident;
        const fromTrust = t ? { at: t.at, text: `${t.reason} (recorded by ${t.by})` } : null;
        const fromFailures = f ? { at: f.at, text: `${f.kind}: ${f.message} (task ${f.task_id}#${f.attempt} of run ${short(f.run_id)})` } : null;
        const last = [fromTrust, fromFailures].filter(Boolean).sort((a, b) => Date.parse(b.at) - Date.parse(a.at))[0];
        return last ? `<span class="mono">${time(last.at)}</span> ${esc(last.text)}` : '';
      };
      set('#team', `<table><tr><th>MEMBER</th><th>STATUS</th><th>ROLES</th><th>TRUST</th><th>WORKERS</th><th>RUNNING</th><th>LAST PROGRESS</th><th>FAILURES (1h / 24h)</th><th>CONSECUTIVE</th><th>LAST INCIDENT</th></tr>
        ${team.members.map((m) => {
          const f = m.failures;
          return `<tr data-member="${esc(m.name)}"><td><b>${esc(m.name)}</b><div class="muted">${esc((m.card && m.card.description) || '')}</div></td>
            <td>${status(m.status)}</td><td>${esc([...new Set([...(m.card.roles || []), ...(m.served || [])])].join(', '))}</td>
            <td>${esc(level(m.name) || '-')}</td><td>${(m.workers || []).length}</td><td>${(m.tasks || []).length}</td>
            <td>${time(m.last_progress)}</td>
            <td>${f ? `${f.last_hour.failed} / ${f.last_day.failed}` : '-'}</td><td>${f ? f.consecutive_failures : '-'}</td>
            <td class="muted wrap incident">${incident(m)}</td></tr>`;
        }).join('')}</table>
        ${(team.teammates || []).length ? `<h2>Teammates</h2><table><tr><th>NAME</th><th>TEAM</th><th>STATUS</th><th>ROLE</th></tr>${team.teammates.map((t) => `<tr><td>${esc(t.name)}</td><td>${esc(t.team)}</td><td>${status(t.status)}</td><td>${esc(t.role)}</td></tr>`).join('')}</table>` : ''}`);
    } catch (e) { set('#team', `<p class="muted">${esc(e.message)}</p>`); }
  };
  await load();
  every(2000, load);
}

// ---------- workers ----------

async function viewWorkers() {
  main().innerHTML = '<h1>Workers and pools</h1><div id="pools"></div><h2>Live workers</h2><div id="workers"></div>';
  const load = async () => {
    try {
      const w = await api('/api/workers');
      set('#pools', `<table><tr><th>POOL</th><th>WORKERS</th><th>SLOTS IN USE</th><th>BACKLOG</th><th>DELIVERED, NOT DONE</th></tr>
        ${w.pools.map((p) => `<tr data-pool="${esc(p.pool)}"><td>${esc(p.pool)}</td><td>${p.workers}</td><td>${p.in_use} / ${p.slots}</td><td>${p.backlog ?? '-'}</td><td>${p.ack_pending ?? '-'}</td></tr>`).join('')}</table>
        <p class="muted">${w.active_runs} run(s) not ended.</p>`);
      set('#workers', `<table><tr><th>WORKER</th><th>POOL</th><th>HOST</th><th>SLOTS</th><th>AGENTS</th><th>VERSION</th><th>LAST SEEN</th></tr>
        ${w.workers.map(({ worker: x, last_seen }) => `<tr class="worker"><td class="mono">${esc(x.id)}</td><td>${esc(x.pool)}</td><td>${esc(x.host)}</td>
          <td>${x.in_flight} / ${x.concurrency}</td><td>${esc((x.agents || []).join(', '))}</td><td>${esc(x.version)}</td><td>${time(last_seen)}</td></tr>`).join('')}</table>`);
    } catch (e) { set('#pools', `<p class="muted">${esc(e.message)}</p>`); }
  };
  await load();
  every(2000, load);
}

// ---------- usage (a tenant's: a console of several tenants) ----------

// Millionths of a US dollar as dollars (small amounts to the hundredth of a cent).
const usd = (micros) => `$${(micros / 1e6).toFixed(micros && micros < 10000 ? 4 : 2)}`;
const count = (n) => Number(n || 0).toLocaleString('en-US');

async function viewUsage() {
  const days = Number(query().get('days')) || 7;
  main().innerHTML = `<h1>Usage of ${esc(tenant)}</h1>
    <div class="filters"><label>Last <select id="usage-days">${[1, 7, 30, 90, 400].map((d) => `<option value="${d}"${d === days ? ' selected' : ''}>${d} day${d > 1 ? 's' : ''}</option>`).join('')}</select></label>
    <span class="muted">as <span class="mono">flotilla tenant usage ${esc(tenant)} --since ${days}d</span></span></div>
    <div id="usage"></div>`;
  $('#usage-days').addEventListener('change', (e) => { setQuery('/usage', { days: e.target.value }); route(); });
  const load = async () => {
    try {
      const u = await api(`/api/usage?days=${days}`);
      const q = u.quotas || {};
      const c = u.current || {};
      const limit = (v, fmt = count) => (v == null ? '<span class="muted">none</span>' : fmt(v));
      const muted = (t) => `<span class="muted">${t}</span>`;
      const quota = (name, used, lim, resets, fmt = count) => `<tr data-quota="${name}"><td>${name}</td><td>${used == null ? muted('-') : fmt(used)}</td><td>${limit(lim, fmt)}</td><td class="mono">${resets}</td></tr>`;
      const kib = (n) => (n < 1024 ? `${count(n)} B` : n < 1048576 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / 1048576).toFixed(1)} MiB`);
      const total = (u.days || []).reduce((t, d) => ({ tokens: t.tokens + d.total.tokens, cost: t.cost + d.total.cost_micros, calls: t.calls + d.total.calls }), { tokens: 0, cost: 0, calls: 0 });
      set('#usage', `<div class="card" id="usage-total"><b>${count(total.tokens)}</b> tokens · <b>${usd(total.cost)}</b> · <b>${count(total.calls)}</b> model calls in the last ${days} day${days > 1 ? 's' : ''}</div>
        <h2>Quotas</h2>
        <table id="quotas"><tr><th>QUOTA</th><th>USED</th><th>LIMIT</th><th>RESETS</th></tr>
          ${quota('concurrent_runs', c.concurrent_runs, q.concurrent_runs, muted('when a run ends'))}
          ${quota('runs_per_hour', c.runs_this_hour, q.runs_per_hour, time(c.hour_resets_at_ms))}
          ${quota('tokens_per_day', c.tokens_today, q.tokens_per_day, time(c.day_resets_at_ms))}
          ${quota('cost_per_month', c.cost_this_month_micros, q.cost_per_month_micros, time(c.month_resets_at_ms), usd)}
          ${quota('model_requests_per_minute', null, q.model_requests_per_minute, muted('each minute'))}
          ${quota('model_tokens_per_minute', null, q.model_tokens_per_minute, muted('each minute'))}
          ${c.workspace_bytes != null ? quota('workspace_bytes', c.workspace_bytes, q.workspace_bytes, muted('as entries expire'), kib) : ''}
          ${c.mailbox_bytes != null ? quota('mailbox_bytes', c.mailbox_bytes, q.mailbox_bytes, muted('as posts expire'), kib) : ''}
          ${c.persistent_teammates != null || q.persistent_teammates != null ? quota('persistent_teammates', c.persistent_teammates, q.persistent_teammates, muted('when one shuts down')) : ''}</table>
        <h2>By day, agent and model</h2>
        ${(u.days || []).length ? `<table id="usage-days-table"><tr><th>DAY</th><th>AGENT</th><th>MODEL</th><th>TOKENS</th><th>COST</th><th>CALLS</th></tr>
          ${u.days.slice().reverse().map((d) => `<tr class="day" data-day="${esc(d.day)}"><td><b>${esc(d.day)}</b></td><td></td><td></td><td><b>${count(d.total.tokens)}</b></td><td><b>${usd(d.total.cost_micros)}</b></td><td><b>${count(d.total.calls)}</b></td></tr>
            ${d.by.map((b) => `<tr data-day="${esc(d.day)}" data-agent="${esc(b.agent)}" data-model="${esc(b.model)}"><td></td><td>${esc(b.agent)}</td><td class="mono">${esc(b.model)}</td><td>${count(b.tokens)}</td><td>${usd(b.cost_micros)}</td><td>${count(b.calls)}</td></tr>`).join('')}`).join('')}</table>`
          : '<p class="muted" id="usage-none">No model calls in these days.</p>'}`);
    } catch (e) { set('#usage', `<p class="muted">${esc(e.message)}</p>`); }
  };
  await load();
  every(10000, load);
}

// ---------- tenants (a console of several) ----------

// The header's picker of the person's tenants. `true`: this tenant's page can be shown;
// `false`: it cannot (no tenant named and the person has none, or one they are not in), and
// the page says why; `null`: the page goes to the person's first tenant.
function tenants() {
  const mine = me.tenants;
  if (!tenant && mine.length) {
    location.replace(`/t/${encodeURIComponent(mine[0])}/${location.hash}`);
    return null;
  }
  if (!tenant) {
    main().innerHTML = `<div class="card" id="no-tenant"><h1>No tenant</h1><p>${esc(me.name)} is in no tenant of this console: a tenant's people (<span class="mono">flotilla tenant set TENANT --person ${esc(me.name)}</span>) and the console's administrators see it.</p></div>`;
    return false;
  }
  const picker = $('#tenant');
  picker.innerHTML = mine.map((t) => `<option value="${esc(t)}"${t === tenant ? ' selected' : ''}>${esc(t)}</option>`).join('');
  $('#tenant-pick').hidden = false;
  picker.addEventListener('change', () => {
    // The same list page in the other tenant; a run is another tenant's: its runs.
    const page = (location.hash.slice(1) || '/runs').split(/[/?]/)[1];
    const keep = ['runs', 'inbox', 'team', 'workers', 'usage'].includes(page) ? page : 'runs';
    location.assign(`/t/${encodeURIComponent(picker.value)}/#/${keep}`);
  });
  $('[data-nav="usage"]').hidden = false;
  if (!mine.includes(tenant)) {
    main().innerHTML = `<div class="card" id="no-tenant"><h1>Not in tenant ${esc(tenant)}</h1><p>${esc(me.name)} is not in tenant ${esc(tenant)}.${mine.length ? ` Your tenants: ${mine.map((t) => `<a href="/t/${esc(t)}/">${esc(t)}</a>`).join(', ')}.` : ''}</p></div>`;
    return false;
  }
  document.title = `${tenant} · Flotilla console`;
  return true;
}

// ---------- router ----------

let routeSeq = 0;

async function route() {
  const seq = ++routeSeq;
  for (const c of cleanup) c();
  cleanup = [];
  const path = (location.hash.slice(1) || '/runs').split('?')[0];
  const [, page, arg] = path.split('/');
  document.querySelectorAll('[data-nav]').forEach((a) => a.classList.toggle('active', a.dataset.nav === page || (page === 'run' && a.dataset.nav === 'runs')));
  try {
    if (page === 'run' && arg) await viewRun(arg);
    else if (page === 'inbox') await viewInbox();
    else if (page === 'team') await viewTeam();
    else if (page === 'workers') await viewWorkers();
    else if (page === 'diff' && arg) await viewDiff(arg, path.split('/')[3]);
    else if (page === 'usage' && tenant) await viewUsage();
    else await viewRuns();
  } catch (e) {
    // A page the person already left does not put its failure on the one they are on.
    if (seq === routeSeq) main().innerHTML = `<p class="muted">${esc(e.message)}</p>`;
  }
}

async function start() {
  try {
    me = await api('/api/me', { top: true });
    set('#me', `${esc(me.name)} · ${me.administrator ? 'administrator' : me.operator ? 'operator' : 'viewer'}`);
    $('#me').dataset.role = me.operator ? 'operator' : 'viewer';
  } catch (e) {
    main().innerHTML = `<div class="card"><h1>Sign in</h1><p>${esc(e.message)}</p></div>`;
    return;
  }
  // A console of several tenants lists the person's (`tenants`); one installation's does not.
  const shown = me.tenants ? tenants() : true;
  if (shown === null) return;
  if (!shown) { document.body.dataset.ready = '1'; return; }
  try {
    const p = await api('/api/runs?limit=0');
    if (p.short_len) shortLen = p.short_len;
  } catch { /* the runs page reads it again */ }
  window.addEventListener('hashchange', route);
  // The inbox badge follows notices on every page.
  const badge = async () => {
    try {
      const l = await api('/api/inbox');
      const c = $('#inbox-count');
      c.hidden = !l.approvals.length;
      c.textContent = l.approvals.length;
    } catch { /* no coordinator yet */ }
  };
  badge();
  const es = new EventSource(`${base}/api/inbox/stream`);
  es.addEventListener('inbox', debounce(300, badge));
  await route();
  document.body.dataset.ready = '1';
}

start();
