/*
 * stargym trainer dashboard: the single-page front end (issue 8).
 *
 * Plain ES2020, no build step, no framework. It reads the dashboard's read-only JSON API
 * (/api/runs, /api/runs/{run}/metrics|events|trajectories|groups|config, /api/system) and the
 * trainer's /status, and draws charts with the Plotly bundle served at /static/vendor/plotly.min.js.
 *
 * Security: every string that comes from the API reaches the page as text (textContent, text nodes,
 * setAttribute) and never as HTML; strings handed to Plotly (which understands a little HTML in
 * trace names and hover text) are entity-escaped first.
 *
 * Sections: constants · dom helpers · formatting · api · error banners · run store and nav bar ·
 * router · pages (charts, system, trajectories, trajectory, group, runs, config) · boot.
 */

// ===== constants ==================================================================================

const POLL_MS = 2000; // live metrics and the system view
const NAV_POLL_MS = 2000; // run list and the nav bar's live run (a tiny run updates several times a second)
const EVENTS_POLL_MS = 10000; // stage starts and echo traps of a live run
const LIST_POLL_MS = 5000; // trajectory list auto refresh
const MAX_POINTS = 1000; // points per series asked for on a full load (the server downsamples)
const REFETCH_FACTOR = 4; // a live series this many times MAX_POINTS long is reloaded downsampled
const PREFS_KEY = 'stargym.dashboard.prefs';

// Run colours avoid pure red, which marks echo-trap events.
const PALETTE = ['#1f77b4', '#2ca02c', '#ff7f0e', '#9467bd', '#17becf', '#8c564b', '#e377c2', '#7f7f7f',
  '#bcbd22', '#393b79'];
const DASHES = ['solid', 'dash', 'dot', 'dashdot', 'longdash', 'longdashdot'];
const ECHO_COLOR = '#d62728';

/** The chart set; `keys` are server patterns ('*' spans any characters, '/' too), `right` go on a 2nd axis. */
const CHARTS = [
  { id: 'success', title: 'Success', keys: ['eval/success', 'rollout/success', 'env/*/success', 'eval/*/success'] },
  { id: 'reward', title: 'Reward', keys: ['rollout/reward_mean', 'eval/reward', 'env/*/reward', 'eval/*/reward'] },
  {
    id: 'in_group_std', title: 'In-group reward std (share of groups with signal right)',
    keys: ['rollout/in_group_std', 'rollout/groups_with_signal'], right: ['rollout/groups_with_signal'],
  },
  { id: 'entropy', title: 'Entropy', keys: ['train/entropy'] },
  { id: 'grad_norm', title: 'Gradient norm', keys: ['train/grad_norm'] },
  { id: 'kl', title: 'KL', keys: ['train/kl'] },
  { id: 'clipfrac', title: 'Clip fraction', keys: ['train/clipfrac'] },
  { id: 'logprob_gap', title: 'Log-prob gap', keys: ['rollout/logprob_gap'] },
  { id: 'response_length', title: 'Response length', keys: ['rollout/response_length'] },
  { id: 'turns', title: 'Turns', keys: ['rollout/turns', 'env/*/turns'] },
  { id: 'staleness', title: 'Staleness', keys: ['rollout/staleness', 'rollout/staleness_max'] },
  { id: 'kept_ratio', title: 'Kept-group ratio', keys: ['rollout/kept_ratio'] },
  {
    id: 'throughput', title: 'Throughput (tokens/s, episodes/s right)',
    keys: ['system/tokens_per_s', 'system/episodes_per_s'], right: ['system/episodes_per_s'],
  },
  {
    id: 'update_wait', title: 'Update vs wait (s)',
    keys: ['system/update_s', 'system/batch_wait_s', 'system/step_time_s'],
  },
];
const ALL_PATTERNS = [...new Set(CHARTS.flatMap((c) => c.keys))];

// ===== dom helpers ================================================================================

/**
 * Make an element. attrs: 'class', 'dataset' (object), 'style' (object), on<event> (function),
 * the properties value/checked/disabled/selected/hidden, anything else via setAttribute.
 * Children: nodes or strings (strings become text nodes); null/false/undefined are skipped.
 */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === 'class') node.className = value;
    else if (name === 'dataset') Object.assign(node.dataset, value);
    else if (name === 'style') Object.assign(node.style, value);
    else if (name.startsWith('on') && typeof value === 'function') node.addEventListener(name.slice(2), value);
    else if (['value', 'checked', 'disabled', 'selected', 'hidden'].includes(name)) node[name] = value;
    else node.setAttribute(name, value === true ? '' : String(value));
  }
  appendChildren(node, children);
  return node;
}

/** Append children (nested arrays flattened, strings as text nodes); `fill` replaces them instead. */
function add(node, ...children) {
  appendChildren(node, children);
  return node;
}

function fill(node, ...children) {
  node.replaceChildren();
  return add(node, ...children);
}

function appendChildren(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** An in-app link; `segments` are URL-encoded one by one. */
function hashFor(...segments) {
  return `#/${segments.map((s) => encodeURIComponent(String(s))).join('/')}`;
}

function trajectoryHref(run, jobId) { return hashFor('trajectory', run, jobId); }
function groupHref(run, groupId) { return hashFor('group', run, groupId); }
function chartsHref(runs) { return `#/charts?${runs.map((r) => `run=${encodeURIComponent(r)}`).join('&')}`; }

function badge(label, kind, attrs) {
  return el('span', { ...attrs, class: `badge badge-${kind}` }, label);
}

function statusBadge(status) {
  const label = status || 'unknown';
  return badge(label, String(label).replace(/[^a-z]/g, ''), { 'data-status': status || '' });
}

/** A definition list of label/value pairs; values may be nodes. */
function kvList(pairs) {
  return el('dl', { class: 'kv' }, pairs.map(([label, value]) => [el('dt', {}, label), el('dd', {}, value)]));
}

/** A table; `rows` are arrays of cells or {cells, attrs}; a cell may be a node, string or {node, attrs}. */
function table(headers, rows, attrs) {
  const body = el('tbody', {}, rows.map((row) => {
    const spec = Array.isArray(row) ? { cells: row } : row;
    return el('tr', spec.attrs, spec.cells.map((cell) => (
      cell && typeof cell === 'object' && !(cell instanceof Node) && !Array.isArray(cell)
        ? el('td', cell.attrs, cell.node) : el('td', {}, cell)
    )));
  }));
  return el('div', { class: 'table-wrap' },
    el('table', attrs, el('thead', {}, el('tr', {}, headers.map((h) => el('th', {}, h)))), body));
}

function emptyNote(message, attrs) {
  return el('p', { ...attrs, class: 'empty-note' }, message);
}

function pageHeader(title, ...extra) {
  return el('div', { class: 'page-head' },
    el('h1', {}, title),
    extra.length ? el('div', { class: 'page-actions' }, extra) : null);
}

// ===== formatting =================================================================================

const pad2 = (n) => String(n).padStart(2, '0');

/** What a training warning is called on a chart: the watch's kinds (trainer/algorithms/echo_trap.py). */
function warningName(kind) {
  return kind === 'no_signal' ? 'no learning signal' : `echo trap (${kind})`;
}

function fmtNum(value, digits = 3) {
  if (value === null || value === undefined || (typeof value === 'number' && Number.isNaN(value))) return '—';
  if (typeof value !== 'number') return String(value);
  if (Number.isInteger(value)) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return value.toFixed(digits);
}

function fmtPct(value) {
  return value === null || value === undefined ? '—' : `${(value * 100).toFixed(1)}%`;
}

function localDate(unix) {
  const d = new Date(unix * 1000);
  const day = `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())}`;
  return `${day} ${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
}

function fmtTime(unix) {
  return unix === null || unix === undefined ? '—' : localDate(unix);
}

/** A wall-clock time as Plotly reads dates (local time, millisecond precision). */
function plotlyDate(unix) {
  return `${localDate(unix)}.${String(Math.floor((unix * 1000) % 1000)).padStart(3, '0')}`;
}

function fmtAgo(seconds) {
  if (seconds === null || seconds === undefined) return '—';
  if (seconds < 60) return `${seconds.toFixed(1)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

/** Plotly renders a small HTML subset in names and hover text: escape so API text stays literal. */
function plotlyText(value) {
  return String(value).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;');
}

// ===== api ========================================================================================

class ApiError extends Error {
  constructor(status, code, message, path) {
    super(message);
    this.status = status;
    this.code = code;
    this.path = path || null;
  }
}

const enc = encodeURIComponent;

/** /api/runs/{run}/... with every segment URL-encoded. */
function runApi(run, ...rest) {
  return ['/api/runs', enc(run), ...rest.map((s) => enc(String(s)))].join('/');
}

function withQuery(path, params) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params || {})) {
    if (value !== null && value !== undefined && value !== '') query.set(name, String(value));
  }
  const text = query.toString();
  return text ? `${path}?${text}` : path;
}

/**
 * GET a JSON resource. A 401 reloads the page (the server then answers with its login form) and
 * never settles; other failures throw ApiError carrying the server's error.message.
 */
async function api(path, params) {
  let response;
  try {
    response = await fetch(withQuery(path, params), {
      headers: { Accept: 'application/json' }, credentials: 'same-origin',
    });
  } catch (err) {
    throw new ApiError(0, 'network', `cannot reach the dashboard server (${err.message})`);
  }
  if (response.status === 401) {
    window.location.reload();
    return new Promise(() => {});
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`.trim();
    let code = 'http_error';
    try {
      const body = await response.json();
      if (body && body.error) {
        message = body.error.message || message;
        code = body.error.code || code;
      }
    } catch (_) {
      // not a JSON error body: keep the status line
    }
    throw new ApiError(response.status, code, message, path);
  }
  return response.json();
}

function errorText(err) {
  return err instanceof Error ? err.message : String(err);
}

// ===== error banners ==============================================================================

const banners = new Map();

/** Show (or update) the error banner `key`; one banner per source, so polls do not pile them up. */
function showError(key, message) {
  let banner = banners.get(key);
  if (!banner) {
    banner = el('div', { class: 'banner error', role: 'alert', 'data-error-banner': key },
      el('span', { class: 'banner-text' }),
      el('button', {
        class: 'banner-close', type: 'button', 'aria-label': 'Dismiss', onclick: () => clearError(key),
      }, '×'));
    banners.set(key, banner);
    document.getElementById('banners').append(banner);
  }
  banner.querySelector('.banner-text').textContent = message;
}

function clearError(key) {
  const banner = banners.get(key);
  if (banner) {
    banner.remove();
    banners.delete(key);
  }
}

/** Put a failed page load in the page itself as well as in the banner. */
function renderFailure(page, err) {
  const notFound = err instanceof ApiError && err.status === 404;
  add(page, el('div', { class: 'failure', 'data-failure': notFound ? 'not-found' : 'error' },
    el('h2', {}, notFound ? 'Not found' : 'Could not load this page'),
    el('p', {}, errorText(err)),
    el('p', {}, el('a', { href: '#/runs' }, 'Back to the runs'))));
}

// ===== run store and nav bar ======================================================================

/** The run list every page shares, refreshed by the nav bar's poll. */
const store = {
  runs: null,
  liveRun: null,
  status: null, // the trainer's /status answer when it gave one
  statusUsable: true, // false once /status said it does not exist here (standalone dashboard)
  loading: null,
  listeners: new Set(),
};

/** Reload the run list (concurrent callers share one request); the trainer status follows on its own. */
function refreshRuns() {
  if (!store.loading) {
    store.loading = (async () => {
      const data = await api('/api/runs');
      store.runs = data.runs || [];
      store.liveRun = data.live_run || null;
      if (!store.liveRun) store.status = null;
      renderLiveStatus();
      for (const listener of store.listeners) listener();
      refreshStatus();
    })().finally(() => { store.loading = null; });
  }
  return store.loading;
}

/** /status exists only where the trainer serves the dashboard: asked only while a run is live. */
async function refreshStatus() {
  if (!store.liveRun || !store.statusUsable) return;
  try {
    store.status = await api('/status');
  } catch (err) {
    store.status = null;
    if (err instanceof ApiError && (err.status === 404 || err.status === 405)) store.statusUsable = false;
  }
  renderLiveStatus();
}

function ensureRuns() {
  return store.runs ? Promise.resolve() : refreshRuns();
}

function findRun(name) {
  return (store.runs || []).find((r) => r.name === name) || null;
}

function isLive(name) {
  const run = findRun(name);
  return Boolean(run && run.live);
}

/** The live run, else the newest one (by start time; the server lists newest first). */
function defaultRun() {
  if (store.liveRun) return store.liveRun;
  const runs = store.runs || [];
  if (!runs.length) return null;
  let best = runs[0];
  for (const run of runs) if ((run.started || 0) > (best.started || 0)) best = run;
  return best.name;
}

function renderLiveStatus() {
  const box = document.getElementById('live-status');
  const status = store.status;
  const run = store.liveRun ? findRun(store.liveRun) : null;
  box.replaceChildren();
  if (!store.liveRun) {
    box.append(el('span', { class: 'dot idle' }), el('span', { class: 'muted' }, 'no live run'));
    return;
  }
  const state = status ? status.state : run ? run.status : 'unknown';
  const step = status ? status.step : run ? run.step : null;
  const total = status ? status.total_steps : run ? run.total_steps : null;
  box.append(
    el('span', { class: 'dot live' }),
    el('a', { href: chartsHref([store.liveRun]), class: 'live-run', 'data-live-run': '' },
      status ? status.run : store.liveRun),
    statusBadge(state),
    el('span', { class: 'live-step', 'data-live-step': '' }, `step ${fmtNum(step)}${total ? ` / ${total}` : ''}`),
  );
}

async function pollNav() {
  try {
    await refreshRuns();
    clearError('nav');
  } catch (err) {
    showError('nav', `Run list: ${errorText(err)}`);
  }
}

// ===== router =====================================================================================

/** One rendered page's lifetime: its timers stop and its late answers are ignored once it is left. */
class PageContext {
  constructor() {
    this.alive = true;
    this.timers = [];
    this.cleanups = [];
  }

  /** Run `fn` every `ms` while the page is shown and visible; a slow run is never overlapped. */
  every(ms, fn) {
    let running = false;
    const id = setInterval(async () => {
      if (!this.alive || running || document.hidden) return;
      running = true;
      try {
        await fn();
      } finally {
        running = false;
      }
    }, ms);
    this.timers.push(id);
  }

  onCleanup(fn) {
    this.cleanups.push(fn);
  }

  dispose() {
    this.alive = false;
    this.timers.forEach(clearInterval);
    this.cleanups.forEach((fn) => fn());
  }
}

function safeDecode(segment) {
  try {
    return decodeURIComponent(segment);
  } catch (_) {
    return segment;
  }
}

/** Parse location.hash into {page, args, params, nav}. */
function parseRoute() {
  let hash = window.location.hash.replace(/^#\/?/, '');
  let query = '';
  const q = hash.indexOf('?');
  if (q >= 0) {
    query = hash.slice(q + 1);
    hash = hash.slice(0, q);
  }
  const parts = hash.split('/').filter((p) => p !== '').map(safeDecode);
  const params = new URLSearchParams(query);
  const [head, ...args] = parts;
  if (!head || (head === 'charts' && !args.length)) return { page: 'charts', args: [], params, nav: 'charts' };
  if (['system', 'trajectories', 'runs'].includes(head) && !args.length) return { page: head, args, params, nav: head };
  if (head === 'trajectory' && args.length === 2) return { page: 'trajectory', args, params, nav: 'trajectories' };
  if (head === 'group' && args.length === 2) return { page: 'group', args, params, nav: 'trajectories' };
  if (head === 'runs' && args.length === 2 && args[1] === 'config') {
    return { page: 'config', args, params, nav: 'runs' };
  }
  return { page: 'notfound', args: parts, params, nav: null };
}

let currentPage = null;

function route() {
  if (currentPage) currentPage.dispose();
  for (const key of [...banners.keys()]) if (key !== 'nav') clearError(key);
  const where = parseRoute();
  for (const link of document.querySelectorAll('[data-nav]')) {
    link.classList.toggle('active', link.dataset.nav === where.nav);
  }
  const ctx = new PageContext();
  currentPage = ctx;
  const page = el('section', { class: `page page-${where.page}`, 'data-page': where.page });
  document.getElementById('app').replaceChildren(page);
  document.title = `${PAGE_TITLES[where.page] || 'stargym'} · stargym dashboard`;
  window.scrollTo(0, 0);
  PAGES[where.page](ctx, page, where).catch((err) => {
    if (!ctx.alive) return;
    renderFailure(page, err);
    showError('page', errorText(err));
  });
}

// ===== page: charts ===============================================================================

function nextFrame() {
  return new Promise((resolve) => { window.requestAnimationFrame(() => resolve()); });
}

/** '*' matches one or more of any character, as on the server. */
function globToRegExp(pattern) {
  return new RegExp(`^${pattern.split('*').map((part) => part.replace(/[.+?^${}()|[\]\\]/g, '\\$&')).join('.+')}$`);
}

const CHART_MATCHERS = new Map(CHARTS.map((c) => [c.id, {
  keys: c.keys.map(globToRegExp),
  right: (c.right || []).map(globToRegExp),
}]));

/** The concrete keys of `available` a chart shows, in the order of its patterns. */
function chartKeys(chart, available) {
  const matchers = CHART_MATCHERS.get(chart.id).keys;
  const keys = [];
  for (const matcher of matchers) {
    for (const key of [...available].filter((k) => matcher.test(k)).sort()) if (!keys.includes(key)) keys.push(key);
  }
  return keys;
}

function onRightAxis(chart, key) {
  return CHART_MATCHERS.get(chart.id).right.some((m) => m.test(key));
}

function loadPrefs() {
  const prefs = { smooth: false, weight: 0.6, x: 'step' };
  try {
    Object.assign(prefs, JSON.parse(window.localStorage.getItem(PREFS_KEY) || '{}'));
  } catch (_) {
    // private mode or a corrupt value: the defaults do
  }
  return prefs;
}

function savePrefs(prefs) {
  try {
    window.localStorage.setItem(PREFS_KEY, JSON.stringify(prefs));
  } catch (_) {
    // storage unavailable: preferences last for this page only
  }
}

/** Debiased exponential moving average (as TensorBoard's); `state` lets live points continue it. */
function ema(values, state, weight) {
  const out = new Array(values.length);
  for (let i = 0; i < values.length; i += 1) {
    const v = values[i];
    if (v === null || !Number.isFinite(v)) {
      out[i] = null;
      continue;
    }
    state.last = state.last * weight + (1 - weight) * v;
    state.count += 1;
    out[i] = weight === 0 ? v : state.last / (1 - weight ** state.count);
  }
  return out;
}

/** Append the points of `series` (an API answer's series map) that are past each key's last step. */
function mergeSeries(target, series) {
  const changed = new Set();
  for (const [key, incoming] of Object.entries(series || {})) {
    let local = target[key];
    if (!local) {
      local = { step: [], time: [], value: [] };
      target[key] = local;
    }
    const last = local.step.length ? local.step[local.step.length - 1] : -Infinity;
    for (let i = 0; i < incoming.step.length; i += 1) {
      if (incoming.step[i] <= last) continue;
      local.step.push(incoming.step[i]);
      local.time.push(incoming.time[i]);
      local.value.push(incoming.value[i]);
      changed.add(key);
    }
  }
  return changed;
}

async function pageCharts(ctx, page, where) {
  await ensureRuns();
  if (!ctx.alive) return;
  if (typeof Plotly === 'undefined') throw new Error('the chart library (/static/vendor/plotly.min.js) did not load');
  const requested = where.params.getAll('run').filter(Boolean);
  const selected = requested.length ? [...new Set(requested)] : [defaultRun()].filter(Boolean);
  const prefs = loadPrefs();
  if (!selected.length) {
    add(page, pageHeader('Charts'), emptyNote('No runs in this runs directory yet.', { 'data-no-runs': '' }));
    return;
  }

  /** Per run: the points held so far, the server's cursor after them, its events. */
  const data = new Map(selected.map((name) => [name, {
    name,
    cursor: 0,
    series: {},
    events: { stages: [], echo_traps: [] },
    eventsJson: '',
    missing: false,
    polledAfterEnd: !isLive(name), // a run that ends while shown is polled once more
  }]));

  // -- toolbar
  const picker = el('details', { class: 'run-picker', 'data-run-picker': '' },
    el('summary', {}, `Runs: ${selected.join(', ')}`),
    el('div', { class: 'run-picker-menu' },
      (store.runs || []).map((run) => el('label', { class: 'check' },
        el('input', {
          type: 'checkbox', value: run.name, checked: selected.includes(run.name), 'data-run-option': run.name,
        }),
        ` ${run.name}`, run.live ? badge('live', 'live') : null)),
      el('button', {
        type: 'button', class: 'btn primary small', 'data-run-apply': '',
        onclick: () => {
          const chosen = [...picker.querySelectorAll('input[type=checkbox]:checked')].map((i) => i.value);
          if (chosen.length) window.location.hash = chartsHref(chosen);
        },
      }, 'Show')));
  const closePicker = (event) => { if (!picker.contains(event.target)) picker.open = false; };
  document.addEventListener('click', closePicker);
  ctx.onCleanup(() => document.removeEventListener('click', closePicker));
  const weightInput = el('input', {
    type: 'range', min: '0', max: '0.99', step: '0.01', value: String(prefs.weight), 'data-smooth-weight': '',
    title: 'smoothing weight', disabled: !prefs.smooth,
  });
  const smoothInput = el('input', { type: 'checkbox', checked: prefs.smooth, 'data-smooth': '' });
  const xSelect = el('select', { 'data-x-axis': '' },
    el('option', { value: 'step', selected: prefs.x === 'step' }, 'step'),
    el('option', { value: 'time', selected: prefs.x === 'time' }, 'wall time'));
  const liveNote = el('span', { class: 'muted', 'data-live-note': '' });
  add(page,
    pageHeader('Charts'),
    el('div', { class: 'toolbar' },
      picker,
      el('label', { class: 'check' }, smoothInput, ' smooth (EMA)'), weightInput,
      el('label', { class: 'field-inline' }, 'x axis ', xSelect),
      liveNote),
  );
  const rerenderAll = () => charts.forEach((c) => renderChart(c, true));
  smoothInput.addEventListener('change', () => {
    prefs.smooth = smoothInput.checked;
    weightInput.disabled = !prefs.smooth;
    savePrefs(prefs);
    rerenderAll();
  });
  weightInput.addEventListener('change', () => {
    prefs.weight = Number(weightInput.value);
    savePrefs(prefs);
    if (prefs.smooth) rerenderAll();
  });
  xSelect.addEventListener('change', () => {
    prefs.x = xSelect.value;
    savePrefs(prefs);
    rerenderAll();
  });

  // -- chart cards
  const grid = el('div', { class: 'chart-grid' });
  const charts = CHARTS.map((def) => {
    const plot = el('div', { class: 'plot', hidden: true });
    const nodata = el('div', { class: 'nodata', 'data-nodata': '' }, 'no data yet');
    const exportButton = el('button', {
      type: 'button', class: 'btn small', 'data-export-png': def.id, disabled: true,
      title: 'Download this chart as PNG',
    }, 'Export PNG');
    const card = el('div', { class: 'card chart-card', 'data-chart': def.id, 'data-points': '0' },
      el('div', { class: 'card-head' }, el('h3', {}, def.title), exportButton), plot, nodata);
    const chart = { def, card, plot, nodata, exportButton, traces: [], plotted: false };
    exportButton.addEventListener('click', () => {
      const name = `${selected.join('+')}-${def.id}`.replace(/[^A-Za-z0-9._+-]/g, '_');
      const size = { width: plot.clientWidth || 800, height: plot.clientHeight || 320 };
      Plotly.downloadImage(plot, { format: 'png', filename: name, ...size, scale: 2 })
        .catch((err) => showError('export', `PNG export failed: ${errorText(err)}`));
    });
    grid.append(card);
    return chart;
  });
  const echoBox = el('div', { 'data-echo-list': '' });
  add(page, grid, el('section', { class: 'card echo-section' }, el('h2', {}, 'Echo-trap and no-signal warnings'), echoBox));
  ctx.onCleanup(() => charts.forEach((c) => { if (c.plotted) Plotly.purge(c.plot); }));

  // -- x values and event shapes
  const runIndex = (name) => selected.indexOf(name);
  const multi = selected.length > 1;

  /** Wall time of `step` in a run: read off its longest series (events carry steps only). */
  function timeAtStep(run, step) {
    let ref = null;
    for (const s of Object.values(run.series)) if (!ref || s.step.length > ref.step.length) ref = s;
    if (!ref || !ref.step.length) return null;
    let lo = 0;
    let hi = ref.step.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (ref.step[mid] < step) lo = mid + 1;
      else hi = mid;
    }
    return ref.step[lo] >= step ? ref.time[lo] : null;
  }

  function xOf(run, step) {
    if (prefs.x === 'step') return step;
    const t = timeAtStep(run, step);
    return t === null || t === undefined ? null : plotlyDate(t);
  }

  function vline(x, line) {
    return { type: 'line', xref: 'x', yref: 'paper', x0: x, x1: x, y0: 0, y1: 1, line };
  }

  /** Stage starts (dashed, labelled) and echo traps (red, with a hover marker) of the selected runs. */
  function eventDecor() {
    const shapes = [];
    const annotations = [];
    const echo = { x: [], text: [] };
    for (const run of data.values()) {
      const color = multi ? PALETTE[runIndex(run.name) % PALETTE.length] : '#888';
      for (const stage of run.events.stages || []) {
        if (stage.step === 0 && stage.stage === 0) continue;
        const x = xOf(run, stage.step);
        if (x === null) continue;
        shapes.push(vline(x, { color, width: 1, dash: 'dash' }));
        // Written up along the line, below the echo-trap markers at the top.
        annotations.push({
          x, y: 0.9, xref: 'x', yref: 'paper', xanchor: 'right', yanchor: 'top', textangle: -90, showarrow: false,
          text: plotlyText(`${multi ? `${run.name} · ` : ''}stage ${stage.stage}: max_turns ${stage.max_turns}`),
          font: { size: 10, color: '#57606a' },
        });
      }
      for (const trap of run.events.echo_traps || []) {
        const x = xOf(run, trap.step);
        if (x === null) continue;
        shapes.push(vline(x, { color: ECHO_COLOR, width: 1.5 }));
        echo.x.push(x);
        const lines = [`${multi ? `${run.name} · ` : ''}${warningName(trap.kind)} at step ${trap.step}`, trap.message,
          ...Object.entries(trap.details || {}).map(([k, v]) => `${k}: ${fmtNum(v)}`)];
        echo.text.push(lines.map(plotlyText).join('<br>'));
      }
    }
    return { shapes, annotations, echo };
  }

  // -- traces

  /** What a chart plots now: one trace per (selected run, concrete key). */
  function traceSpecs(def) {
    const specs = [];
    for (const run of data.values()) {
      chartKeys(def, Object.keys(run.series)).forEach((key, keyIndex) => {
        if (run.series[key].step.length) specs.push({ run: run.name, key, keyIndex, right: onRightAxis(def, key) });
      });
    }
    return specs;
  }

  function pointsOf(spec, from) {
    const s = data.get(spec.run).series[spec.key];
    const x = prefs.x === 'time' ? s.time.slice(from).map(plotlyDate) : s.step.slice(from);
    const raw = s.value.slice(from);
    const y = prefs.smooth ? ema(raw, spec.ema, prefs.weight) : raw;
    return { x, y };
  }

  function buildTrace(spec) {
    spec.ema = { last: 0, count: 0 };
    const { x, y } = pointsOf(spec, 0);
    spec.n = x.length;
    const color = multi ? PALETTE[runIndex(spec.run) % PALETTE.length] : PALETTE[spec.keyIndex % PALETTE.length];
    const dash = multi ? DASHES[spec.keyIndex % DASHES.length] : 'solid';
    return {
      type: 'scatter', mode: x.length < 3 ? 'lines+markers' : 'lines', x, y,
      name: plotlyText(multi ? `${spec.run} · ${spec.key}` : spec.key),
      line: { color, dash, width: 1.6 }, marker: { size: 5 },
      yaxis: spec.right ? 'y2' : 'y',
    };
  }

  /**
   * Height of the legend under a chart: its rows, estimated from the names and the chart width, so
   * that many traces grow the chart instead of squeezing the plot area.
   */
  function legendHeight(chart, names) {
    const width = Math.max(200, (chart.card.clientWidth || 400) - 40);
    const longest = Math.max(...names.map((n) => n.length));
    const perRow = Math.max(1, Math.floor(width / (longest * 6 + 44)));
    return Math.ceil(names.length / perRow) * 18 + 6;
  }

  function layoutFor(chart, specs, decor, names) {
    const legend = legendHeight(chart, names);
    const axis = prefs.x === 'time' ? 46 : 30; // room for the tick labels (a date adds a line)
    const layout = {
      uirevision: prefs.x,
      autosize: true,
      height: 230 + axis + legend,
      margin: { l: 52, r: specs.some((s) => s.right) ? 52 : 14, t: 8, b: axis + legend },
      font: { family: 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif', size: 11, color: '#24292f' },
      paper_bgcolor: '#ffffff',
      plot_bgcolor: '#ffffff',
      showlegend: true,
      legend: {
        orientation: 'h', x: 0, xref: 'container', y: 0, yref: 'container', yanchor: 'bottom', font: { size: 10 },
      },
      hovermode: 'x unified',
      xaxis: { type: prefs.x === 'time' ? 'date' : 'linear', gridcolor: '#eef0f2', zeroline: false },
      yaxis: { gridcolor: '#eef0f2', zeroline: false },
      shapes: decor.shapes,
      annotations: decor.annotations,
    };
    if (specs.some((s) => s.right)) {
      layout.yaxis2 = { overlaying: 'y', side: 'right', showgrid: false, zeroline: false };
    }
    if (decor.echo.x.length) layout.yaxis3 = { overlaying: 'y', range: [0, 1], visible: false, fixedrange: true };
    return layout;
  }

  const PLOT_CONFIG = {
    responsive: true, displaylogo: false, modeBarButtonsToRemove: ['select2d', 'lasso2d', 'toImage'],
  };

  /** Draw a chart: extend its traces when only points were added, else Plotly.react it whole. */
  function renderChart(chart, full, decor) {
    const specs = traceSpecs(chart.def);
    const total = specs.reduce((n, s) => n + data.get(s.run).series[s.key].step.length, 0);
    chart.card.dataset.points = String(total);
    if (!total) {
      if (chart.plotted) Plotly.purge(chart.plot);
      chart.plotted = false;
      chart.plot.hidden = true;
      chart.nodata.hidden = false;
      chart.exportButton.disabled = true;
      return;
    }
    const same = chart.plotted && !full && specs.length === chart.traces.length
      && specs.every((s, i) => s.run === chart.traces[i].run && s.key === chart.traces[i].key);
    if (same) {
      const xs = [];
      const ys = [];
      const indices = [];
      chart.traces.forEach((spec, i) => {
        const length = data.get(spec.run).series[spec.key].step.length;
        if (length <= spec.n) return;
        const { x, y } = pointsOf(spec, spec.n);
        spec.n = length;
        xs.push(x);
        ys.push(y);
        indices.push(i);
      });
      if (indices.length) Plotly.extendTraces(chart.plot, { x: xs, y: ys }, indices);
      return;
    }
    const d = decor || eventDecor();
    const traces = specs.map(buildTrace);
    if (d.echo.x.length) {
      traces.push({
        type: 'scatter', mode: 'markers', x: d.echo.x, y: d.echo.x.map(() => 0.97), yaxis: 'y3',
        name: 'echo trap', showlegend: false, hovertext: d.echo.text, hoverinfo: 'text',
        marker: { color: ECHO_COLOR, symbol: 'triangle-down', size: 10 },
      });
    }
    chart.traces = specs;
    chart.nodata.hidden = true;
    chart.plot.hidden = false;
    chart.exportButton.disabled = false;
    const names = specs.map((spec) => (multi ? `${spec.run} · ${spec.key}` : spec.key));
    Plotly.react(chart.plot, traces, layoutFor(chart, specs, d, names), PLOT_CONFIG);
    chart.plotted = true;
  }

  function renderEchoList() {
    const rows = [];
    for (const run of data.values()) {
      for (const trap of run.events.echo_traps || []) rows.push({ run: run.name, ...trap });
    }
    rows.sort((a, b) => a.step - b.step);
    if (!rows.length) {
      fill(echoBox, emptyNote('No echo-trap or no-signal warnings.'));
      return;
    }
    fill(echoBox, table(
      [multi ? 'Run' : null, 'Step', 'Kind', 'Message', 'Details'].filter(Boolean),
      rows.map((r) => ({
        attrs: { 'data-echo-event': r.kind },
        cells: [
          multi ? r.run : null, String(r.step), badge(r.kind, 'down'), r.message,
          Object.entries(r.details || {}).map(([k, v]) => `${k}=${fmtNum(v)}`).join(', '),
        ].filter((c) => c !== null),
      })),
      { class: 'data-table echo-table' },
    ));
  }

  // -- loading and live polling

  async function loadRun(run) {
    const answer = await api(runApi(run.name, 'metrics'), { keys: ALL_PATTERNS.join(','), max_points: MAX_POINTS });
    run.series = {};
    mergeSeries(run.series, answer.series);
    run.cursor = answer.cursor || 0;
  }

  async function loadEvents(run) {
    const events = await api(runApi(run.name, 'events'));
    const json = JSON.stringify(events);
    if (json === run.eventsJson) return false;
    run.eventsJson = json;
    run.events = { stages: events.stages || [], echo_traps: events.echo_traps || [] };
    return true;
  }

  await Promise.all([...data.values()].map(async (run) => {
    try {
      await Promise.all([loadRun(run), loadEvents(run)]);
    } catch (err) {
      run.missing = true;
      showError(`run:${run.name}`, `Run ${run.name}: ${errorText(err)}`);
    }
  }));
  if (!ctx.alive) return;
  for (const run of [...data.values()]) if (run.missing) data.delete(run.name);
  renderEchoList();
  // One chart per frame: the first charts show at once and the page stays responsive meanwhile.
  const decor = eventDecor();
  for (const chart of charts) {
    renderChart(chart, true, decor);
    await nextFrame();
    if (!ctx.alive) return;
  }

  /** New points of one run since its cursor (late eval points included): the keys that got some,
   * null if none did, 'reloaded' when the run was loaded afresh: it grew long (downsampling again),
   * or its metrics file was rewritten (a resumed run; the server's cursor went back). */
  async function pollRun(run) {
    const answer = await api(runApi(run.name, 'metrics'), { keys: ALL_PATTERNS.join(','), after: run.cursor });
    if ((answer.cursor || 0) < run.cursor) {
      await loadRun(run);
      return 'reloaded';
    }
    const changed = mergeSeries(run.series, answer.series);
    run.cursor = answer.cursor || run.cursor;
    const longest = Math.max(0, ...Object.values(run.series).map((s) => s.step.length));
    if (longest > REFETCH_FACTOR * MAX_POINTS) {
      await loadRun(run);
      return 'reloaded';
    }
    return changed.size ? changed : null;
  }

  function updateLiveNote() {
    const live = [...data.keys()].filter(isLive);
    liveNote.textContent = live.length ? `live: updating every ${POLL_MS / 1000} s` : '';
  }
  updateLiveNote();
  store.listeners.add(updateLiveNote);
  ctx.onCleanup(() => store.listeners.delete(updateLiveNote));

  ctx.every(POLL_MS, async () => {
    // Poll live runs, and each run once more after it stops so its last points come in.
    const due = [...data.values()].filter((run) => {
      if (isLive(run.name)) {
        run.polledAfterEnd = false;
        return true;
      }
      return !run.polledAfterEnd;
    });
    if (!due.length) return;
    const results = await Promise.all(due.map(async (run) => {
      try {
        const result = await pollRun(run);
        clearError(`poll:${run.name}`);
        if (!isLive(run.name)) run.polledAfterEnd = true;
        return result;
      } catch (err) {
        showError(`poll:${run.name}`, `Live update of ${run.name}: ${errorText(err)}`);
        return null;
      }
    }));
    if (!ctx.alive) return;
    if (results.includes('reloaded')) {
      rerenderAll();
      return;
    }
    const changed = new Set(results.filter(Boolean).flatMap((s) => [...s]));
    if (!changed.size) return;
    for (const chart of charts) if (chartKeys(chart.def, changed).length) renderChart(chart, false);
  });

  ctx.every(EVENTS_POLL_MS, async () => {
    const live = [...data.values()].filter((run) => isLive(run.name));
    let changed = false;
    for (const run of live) {
      try {
        changed = (await loadEvents(run)) || changed;
        clearError(`events:${run.name}`);
      } catch (err) {
        showError(`events:${run.name}`, `Events of ${run.name}: ${errorText(err)}`);
      }
    }
    if (changed && ctx.alive) {
      rerenderAll();
      renderEchoList();
    }
  });
}

// ===== page: system ===============================================================================

function okCell(ok, error) {
  return ok
    ? badge('ok', 'ok')
    : el('span', { class: 'down-text' }, badge('down', 'down'), ' ', error || 'unreachable');
}

function panel(title, ok, ...body) {
  const id = title.toLowerCase().replace(/\s+/g, '-');
  return el('section', { class: `card panel${ok === false ? ' down' : ''}`, 'data-panel': id },
    el('h2', {}, title), body);
}

function renderSnapshot(box, snap) {
  const parts = [];
  const checked = el('p', { class: 'muted', 'data-checked-at': '' }, `checked ${fmtTime(snap.checked_at)}`);
  parts.push(checked);

  if (snap.trainer) {
    const t = snap.trainer;
    parts.push(panel('Trainer', !t.error,
      kvList([
        ['run', t.run], ['state', statusBadge(t.state)], ['step', `${fmtNum(t.step)} / ${fmtNum(t.total_steps)}`],
        ['policy version', fmtNum(t.policy_version)],
        ['max turns (stage)', `${fmtNum(t.max_turns)} (${fmtNum(t.horizon_stage)})`],
        ['last checkpoint', fmtNum(t.last_checkpoint)],
        ['uncommitted trajectories', fmtNum(t.uncommitted_trajectories)],
        ['elapsed', t.elapsed_s === undefined ? '—' : `${fmtNum(t.elapsed_s, 0)} s`],
      ]),
      t.error ? el('p', { class: 'down-text' }, t.error) : null));
  }

  const redis = snap.redis || { ok: false, error: 'no Redis information', streams: [] };
  parts.push(panel('Redis', redis.ok,
    el('p', {}, el('code', {}, redis.url || ''), ' ', okCell(redis.ok, redis.error)),
    (redis.streams || []).length
      ? table(['Stream', 'Length', 'Pending', 'Lag', 'Dead'], redis.streams.map((s) => ({
        attrs: { 'data-stream': s.name },
        cells: [el('code', {}, s.name), fmtNum(s.length), fmtNum(s.pending), fmtNum(s.lag),
          { node: fmtNum(s.dead), attrs: { class: s.dead ? 'warn' : '' } }],
      })), { class: 'data-table' })
      : emptyNote(redis.ok ? 'No streams yet.' : 'Streams unknown while Redis is down.')));

  const envs = snap.env_servers || [];
  parts.push(panel('Env servers', envs.every((e) => e.ok),
    envs.length
      ? table(['Family', 'URL', 'Status', 'Live instances', 'Envs'], envs.map((e) => ({
        attrs: { class: e.ok ? '' : 'down', 'data-env-server': e.url },
        cells: [e.family, el('code', {}, e.url), okCell(e.ok, e.error),
          el('span', { 'data-env-instances': e.url }, fmtNum(e.instances)), (e.envs || []).join(', ')],
      })), { class: 'data-table' })
      : emptyNote('No env servers known.')));

  const workers = snap.workers || [];
  parts.push(panel('Rollout workers', workers.every((w) => w.ok),
    workers.length
      ? table(['Worker', 'Status', 'In flight', 'Policy v', 'Jobs done', 'Jobs failed', 'Env retries', 'Redis errors',
        'Engine backoffs', 'Episodes/s', 'Tokens/s', 'Last seen'], workers.map((w) => ({
        attrs: { class: w.ok ? '' : 'down', 'data-worker': w.worker_id },
        cells: [el('span', {}, w.worker_id, el('br'), el('code', { class: 'muted' }, w.url || 'no URL')), okCell(w.ok, w.error), fmtNum(w.in_flight),
          fmtNum(w.policy_version), fmtNum(w.jobs_done), fmtNum(w.jobs_failed), fmtNum(w.env_retries),
          fmtNum(w.redis_errors), fmtNum(w.engine_backoffs), fmtNum(w.episodes_per_s, 2), fmtNum(w.tokens_per_s, 0),
          fmtAgo(w.last_seen_s)],
      })), { class: 'data-table' })
      : emptyNote('No rollout workers have reported.')));

  const engines = snap.engines || [];
  parts.push(panel('Engines', engines.every((e) => e.ok),
    engines.length
      ? table(['URL', 'Status', 'Weight version', 'Tokens/s', 'In flight'], engines.map((e) => ({
        attrs: { class: e.ok ? '' : 'down', 'data-engine': e.url },
        cells: [el('code', {}, e.url), okCell(e.ok, e.error), fmtNum(e.weight_version), fmtNum(e.tokens_per_s, 0),
          fmtNum(e.in_flight)],
      })), { class: 'data-table' })
      : emptyNote('No engines known.')));

  fill(box, parts);
}

async function pageSystem(ctx, page) {
  const box = el('div', { class: 'system-grid', 'data-system': '' });
  add(page, pageHeader('System'), box);
  let lastJson = '';
  const refresh = async () => {
    let snap;
    try {
      snap = await api('/api/system');
      clearError('system');
    } catch (err) {
      if (lastJson === '') fill(box, emptyNote('The system view is unavailable.'));
      showError('system', `System view: ${errorText(err)}`);
      return;
    }
    if (!ctx.alive) return;
    const json = JSON.stringify(snap);
    if (json === lastJson) return;
    lastJson = json;
    if (!snap.available) {
      fill(box, el('div', { class: 'notice', 'data-system-unavailable': '' },
        el('strong', {}, 'System view unavailable: '), snap.reason || 'no reason given'));
      return;
    }
    renderSnapshot(box, snap);
  };
  await refresh();
  ctx.every(POLL_MS, refresh);
}

// ===== page: trajectories =========================================================================

const FILTER_FIELDS = [
  'env', 'group', 'seed', 'min_reward', 'max_reward', 'success', 'policy_version', 'status', 'error', 'limit',
];

async function pageTrajectories(ctx, page, where) {
  await ensureRuns();
  if (!ctx.alive) return;
  const run = where.params.get('run') || defaultRun();
  add(page, pageHeader('Trajectories'));
  if (!run) {
    add(page, emptyNote('No runs in this runs directory yet.', { 'data-no-runs': '' }));
    return;
  }
  const filters = {};
  for (const name of FILTER_FIELDS) filters[name] = where.params.get(name) || '';

  const go = (params) => {
    const query = new URLSearchParams({ run });
    for (const [k, v] of Object.entries(params)) if (v !== '' && v !== null && v !== undefined) query.set(k, v);
    const target = `#/trajectories?${query.toString()}`;
    if (window.location.hash === target) load();
    else window.location.hash = target;
  };

  const runSelect = el('select', {
    name: 'run', 'data-run-select': '',
    onchange: () => { window.location.hash = `#/trajectories?run=${enc(runSelect.value)}`; },
  }, (store.runs || []).map((r) => el('option', { value: r.name, selected: r.name === run },
    r.name + (r.live ? ' (live)' : ''))));
  if (!findRun(run)) runSelect.append(el('option', { value: run, selected: true }, run));
  const envSelect = el('select', { name: 'env' }, el('option', { value: '' }, 'any'));
  if (filters.env) envSelect.append(el('option', { value: filters.env, selected: true }, filters.env));
  const choice = (name, options) => el('select', { name },
    options.map(([value, label]) => el('option', { value, selected: filters[name] === value }, label)));
  const input = (name, attrs) => el('input', { name, value: filters[name], ...attrs });
  const field = (label, control) => el('label', { class: 'field' }, el('span', {}, label), control);

  const form = el('form', { class: 'filters card', 'data-filters': '' },
    field('Run', runSelect),
    field('Env', envSelect),
    field('Group', input('group', { type: 'text', placeholder: 'group id', size: '18' })),
    field('Seed', input('seed', { type: 'text', size: '8' })),
    field('Min reward', input('min_reward', { type: 'number', step: 'any', size: '6' })),
    field('Max reward', input('max_reward', { type: 'number', step: 'any', size: '6' })),
    field('Success', choice('success', [['', 'any'], ['true', 'yes'], ['false', 'no']])),
    field('Policy v', input('policy_version', { type: 'number', min: '0', step: '1', size: '6' })),
    field('Status', choice('status', [['', 'any'], ['kept', 'kept'], ['filtered', 'filtered'],
      ['dropped', 'dropped']])),
    field('Error', choice('error', [['', 'any'], ['true', 'yes'], ['false', 'no']])),
    field('Limit', choice('limit', [['', '100'], ['50', '50'], ['500', '500'], ['1000', '1000']])),
    el('div', { class: 'filter-buttons' },
      el('button', { type: 'submit', class: 'btn primary', 'data-apply-filters': '' }, 'Apply'),
      el('button', { type: 'button', class: 'btn', 'data-reset-filters': '', onclick: () => go({}) }, 'Reset')));
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    const values = {};
    const formData = new FormData(form);
    for (const name of FILTER_FIELDS) values[name] = String(formData.get(name) || '').trim();
    go(values);
  });

  const autoRefresh = el('input', { type: 'checkbox', checked: isLive(run), 'data-auto-refresh': '' });
  const countNote = el('span', { class: 'muted', 'data-total': '' });
  const listBox = el('div', { 'data-trajectory-list': '' });
  add(page, form,
    el('div', { class: 'toolbar' },
      el('button', { type: 'button', class: 'btn', 'data-refresh': '', onclick: () => load() }, 'Refresh'),
      el('label', { class: 'check' }, autoRefresh, ' auto refresh while live'),
      countNote),
    listBox);

  let lastJson = '';
  async function load() {
    const params = { ...filters };
    let answer;
    try {
      answer = await api(runApi(run, 'trajectories'), params);
      clearError('trajectories');
    } catch (err) {
      showError('trajectories', `Trajectories: ${errorText(err)}`);
      if (!lastJson) fill(listBox, emptyNote('Could not load the trajectories.'));
      return;
    }
    if (!ctx.alive) return;
    for (const env of answer.envs || []) {
      if (![...envSelect.options].some((o) => o.value === env)) {
        envSelect.append(el('option', { value: env, selected: env === filters.env }, env));
      }
    }
    const json = JSON.stringify(answer);
    if (json === lastJson) return;
    lastJson = json;
    const list = answer.trajectories || [];
    countNote.textContent = `showing ${list.length} of ${answer.total} matching`;
    if (!list.length) {
      const note = answer.total ? 'No trajectories on this page.' : 'No trajectories recorded yet (or none match).';
      fill(listBox, emptyNote(note, { 'data-no-trajectories': '' }));
      return;
    }
    fill(listBox, table(
      ['Recorded', 'Job', 'Group', 'Env', 'Seed', 'Step', 'Policy v', 'Reward', 'Success', 'Turns', 'Status', 'Error'],
      list.map((t) => ({
        attrs: { 'data-job-id': t.job_id, class: `status-${t.status}` },
        cells: [
          fmtTime(t.recorded_at),
          el('a', { href: trajectoryHref(run, t.job_id), 'data-trajectory-link': t.job_id }, t.job_id),
          el('a', { href: groupHref(run, t.group_id), 'data-group-link': t.group_id }, t.group_id),
          t.env, String(t.seed), fmtNum(t.step), fmtNum(t.policy_version), fmtNum(t.reward),
          t.success ? badge('yes', 'ok') : badge('no', 'muted'),
          `${fmtNum(t.num_turns)}${t.truncated ? ' (truncated)' : ''}`,
          el('span', { title: t.reason || '' },
            statusBadge(t.status), t.reason ? el('span', { class: 'reason' }, ` ${t.reason}`) : null),
          t.error
            ? el('span', { class: 'down-text', title: t.error },
              t.error.length > 60 ? `${t.error.slice(0, 60)}…` : t.error)
            : '',
        ],
      })),
      { class: 'data-table trajectory-table' },
    ));
  }

  await load();
  ctx.every(LIST_POLL_MS, async () => {
    if (autoRefresh.checked && isLive(run)) await load();
  });
}

// ===== page: trajectory ===========================================================================

/** Make a token's whitespace visible: ↵ for newlines (then the break), · for spaces, → for tabs. */
function visibleToken(text) {
  if (text === '') return '∅';
  return text.replace(/\r/g, '␍').replace(/\t/g, '→').replace(/ /g, '·').replace(/\n/g, '↵\n');
}

function probColor(logprob) {
  const p = Math.min(1, Math.max(0, Math.exp(logprob)));
  return `hsl(${Math.round(120 * p)}, 75%, 80%)`;
}

function advantageColor(value, scale) {
  const x = scale > 0 ? Math.max(-1, Math.min(1, value / scale)) : 0;
  const alpha = (0.12 + 0.68 * Math.abs(x)).toFixed(2);
  return x >= 0 ? `rgba(46, 160, 67, ${alpha})` : `rgba(218, 54, 51, ${alpha})`;
}

function tokenSection(tokens) {
  const ids = (tokens && tokens.ids) || [];
  if (!ids.length) {
    return el('section', { class: 'card' }, el('h2', {}, 'Tokens'), emptyNote('No tokens recorded for this episode.'));
  }
  const texts = tokens.text || [];
  const masks = tokens.mask || [];
  const logprobs = tokens.logprobs || [];
  const advantages = Array.isArray(tokens.advantages) && tokens.advantages.length === ids.length
    ? tokens.advantages : null;
  const advScale = advantages ? Math.max(0, ...advantages.map((a, i) => (masks[i] ? Math.abs(a) : 0))) : 0;

  const view = el('div', { class: 'tokens', 'data-token-view': '' });
  const spans = [];
  const fragment = document.createDocumentFragment();
  let trained = 0;
  let lpSum = 0;
  for (let i = 0; i < ids.length; i += 1) {
    const mask = masks[i] ? 1 : 0;
    const lp = logprobs[i] ?? 0;
    const lines = [`#${i} id ${ids[i]}`, `mask ${mask}`];
    if (mask) {
      trained += 1;
      lpSum += lp;
      lines.push(`logprob ${lp.toFixed(4)} (p ${Math.exp(lp).toFixed(3)})`);
    }
    if (advantages) lines.push(`advantage ${fmtNum(advantages[i], 4)}`);
    const span = document.createElement('span');
    span.className = mask ? 'tok' : 'tok masked';
    span.dataset.mask = String(mask);
    span.title = lines.join('\n');
    span.textContent = visibleToken(texts[i] ?? '');
    fragment.append(span);
    spans.push(span);
  }
  view.append(fragment);

  const legend = el('div', { class: 'token-legend', 'data-token-legend': '' });
  function colour(mode) {
    for (let i = 0; i < spans.length; i += 1) {
      if (!masks[i]) continue;
      spans[i].style.backgroundColor = mode === 'advantage'
        ? advantageColor(advantages[i], advScale) : probColor(logprobs[i] ?? 0);
    }
    view.dataset.colour = mode;
    fill(legend,
      el('span', { class: 'tok masked legend-tok', 'data-mask': '0' }, 'masked'),
      ' prompt / env observation (loss mask 0, not trained) ',
      el('span', { class: 'legend-gap' }),
      mode === 'advantage'
        ? [el('span', { class: 'legend-scale adv' }), advScale > 0
          ? ` trained token background: advantage from −${fmtNum(advScale, 3)} (red) to +${fmtNum(advScale, 3)} (green)`
          : ' trained token background: advantage (all 0 in this episode)']
        : [el('span', { class: 'legend-scale prob' }),
          ' trained token background: behaviour probability from 0 (red) to 1 (green)'],
      el('span', { class: 'legend-gap' }),
      ' ↵ newline · space → tab; hover a token for id, logprob, advantage',
    );
  }
  const modeProb = el('input', {
    type: 'radio', name: 'token-colour', value: 'prob', checked: true, 'data-colour-mode': 'prob',
  });
  const modeAdv = el('input', {
    type: 'radio', name: 'token-colour', value: 'advantage', disabled: !advantages, 'data-colour-mode': 'advantage',
  });
  modeProb.addEventListener('change', () => colour('prob'));
  modeAdv.addEventListener('change', () => colour('advantage'));
  colour('prob');

  return el('section', { class: 'card' },
    el('div', { class: 'card-head' }, el('h2', {}, 'Tokens'),
      el('div', { class: 'toolbar compact' }, 'colour by',
        el('label', { class: 'check' }, modeProb, ' probability'),
        el('label', { class: 'check', title: advantages ? '' : 'no advantages recorded for this episode' },
          modeAdv, ' advantage'))),
    el('p', { class: 'muted' },
      `${ids.length} tokens, ${trained} trained (mask 1)`,
      trained ? `, mean logprob ${(lpSum / trained).toFixed(3)}` : ''),
    legend, view);
}

function turnCard(turn, index) {
  const actions = turn.actions || [];
  return el('article', { class: `card turn${turn.valid === false ? ' invalid' : ''}`, 'data-turn': String(index) },
    el('div', { class: 'card-head' },
      el('h3', {}, `Turn ${index + 1}`),
      el('div', { class: 'badges' },
        turn.valid === false
          ? badge('invalid', 'down', { 'data-valid': 'false' })
          : badge('valid', 'ok', { 'data-valid': 'true' }),
        badge(`reward ${fmtNum(turn.reward)}`, 'muted'),
        turn.done ? badge('done', 'muted') : null,
        (turn.policy_version ?? null) !== null ? badge(`policy v${turn.policy_version}`, 'muted') : null,
        badge(`${fmtNum(turn.prompt_tokens)} prompt / ${fmtNum(turn.response_tokens)} response tokens`, 'muted'))),
    el('div', { class: 'turn-body' },
      el('div', {},
        el('h4', {}, 'Observation'),
        el('pre', { class: 'text-block', 'data-observation': '' }, turn.observation ?? '')),
      el('div', {},
        el('h4', {}, 'Model reply'),
        el('pre', { class: 'text-block', 'data-response': '' }, turn.response ?? ''),
        el('h4', {}, 'Parsed actions'),
        actions.length
          ? el('ul', { class: 'actions' }, actions.map((a) => el('li', {}, el('code', {}, a))))
          : emptyNote('none parsed'))));
}

async function pageTrajectory(ctx, page, where) {
  const [run, jobId] = where.args;
  const t = await api(runApi(run, 'trajectories', jobId));
  if (!ctx.alive) return;
  add(page,
    pageHeader(`Trajectory ${t.job_id}`,
      el('a', { class: 'btn', href: `#/trajectories?run=${enc(run)}` }, '← trajectories'),
      el('a', { class: 'btn', href: groupHref(run, t.group_id), 'data-group-link': t.group_id }, 'Group view'),
      el('a', {
        class: 'btn', href: withQuery(runApi(run, 'trajectories', jobId), { download: 1 }), download: '',
        'data-download-json': '',
      }, 'Download JSON')),
    el('section', { class: 'card', 'data-summary': '' }, kvList([
      ['run', run],
      ['group', el('a', { href: groupHref(run, t.group_id) }, t.group_id)],
      ['env', t.env], ['seed', String(t.seed)],
      ['reward', el('strong', { 'data-reward': '' }, fmtNum(t.reward))],
      ['success', t.success ? badge('yes', 'ok') : badge('no', 'muted')],
      ['status', [statusBadge(t.status), t.reason ? ` ${t.reason}` : '']],
      ['turns', `${fmtNum(t.num_turns)}${t.truncated ? ' (truncated)' : ''}`],
      ['trained at step', fmtNum(t.step)], ['policy version', fmtNum(t.policy_version)],
      ['group reward std', fmtNum(t.group_reward_std)],
      ['recorded', fmtTime(t.recorded_at)],
      t.worker_id ? ['worker', t.worker_id] : null,
      t.error ? ['error', el('span', { class: 'down-text' }, t.error)] : null,
    ].filter(Boolean))),
    el('h2', {}, 'Turns'),
    (t.turns || []).length ? (t.turns || []).map(turnCard) : emptyNote('No turns recorded.'),
    tokenSection(t.tokens),
  );
}

// ===== page: group ================================================================================

async function pageGroup(ctx, page, where) {
  const [run, groupId] = where.args;
  const g = await api(runApi(run, 'groups', groupId));
  if (!ctx.alive) return;
  const members = g.trajectories || [];
  const rewards = members.map((m) => m.reward).filter((r) => Number.isFinite(r));
  const lo = Math.min(0, ...rewards);
  const hi = Math.max(0, ...rewards);
  const span = hi - lo || 1;
  add(page,
    pageHeader(`Group ${g.group_id}`,
      el('a', { class: 'btn', href: `#/trajectories?run=${enc(run)}&group=${enc(groupId)}` },
        'In the trajectory list')),
    el('section', { class: 'card', 'data-group-summary': '' }, kvList([
      ['run', run], ['trained at step', fmtNum(g.step)], ['status', statusBadge(g.status)],
      ['reward std', el('strong', { 'data-reward-std': '' }, fmtNum(g.reward_std))],
      ['episodes', String(members.length)],
      ['mean reward', rewards.length ? fmtNum(rewards.reduce((a, b) => a + b, 0) / rewards.length) : '—'],
    ])),
    el('div', { class: 'group-grid' }, members.map((m) => el('a', {
      class: `card episode status-${m.status}`, href: trajectoryHref(run, m.job_id), 'data-episode': m.job_id,
    },
    el('div', { class: 'episode-head' }, el('code', {}, m.job_id), statusBadge(m.status)),
    el('div', { class: 'episode-reward' }, fmtNum(m.reward)),
    el('div', { class: 'reward-bar' }, el('span', {
      style: {
        left: `${((Math.min(0, m.reward) - lo) / span) * 100}%`, width: `${(Math.abs(m.reward) / span) * 100}%`,
      },
      class: m.reward >= 0 ? 'pos' : 'neg',
    })),
    kvList([
      ['success', m.success ? badge('yes', 'ok') : badge('no', 'muted')],
      ['turns', `${fmtNum(m.num_turns)}${m.truncated ? ' (truncated)' : ''}`],
      ['seed', String(m.seed)], ['policy v', fmtNum(m.policy_version)],
      m.reason ? ['reason', m.reason] : null,
      m.error ? ['error', el('span', { class: 'down-text' }, m.error)] : null,
    ].filter(Boolean)),
    el('ol', { class: 'episode-replies', 'data-replies': '' },
      (m.replies || []).map((reply) => el('li', {}, el('code', {}, reply))))))),
  );
}

// ===== page: runs =================================================================================

async function pageRuns(ctx, page) {
  await ensureRuns();
  if (!ctx.alive) return;
  const selected = new Set();
  const compare = el('button', {
    type: 'button', class: 'btn primary', 'data-compare': '', disabled: true,
    onclick: () => { if (selected.size) window.location.hash = chartsHref([...selected]); },
  }, 'Compare selected');
  const box = el('div', { 'data-runs-table': '' });
  add(page, pageHeader('Runs', compare), box);

  const render = () => {
    const runs = store.runs || [];
    for (const name of [...selected]) if (!findRun(name)) selected.delete(name);
    compare.disabled = selected.size === 0;
    if (!runs.length) {
      fill(box, emptyNote('No runs in this runs directory yet.', { 'data-no-runs': '' }));
      return;
    }
    fill(box, table(
      ['', 'Run', 'Status', 'Started', 'Step', 'Last success', 'Last eval success', 'Algorithm', 'Envs', ''],
      runs.map((r) => ({
        attrs: { 'data-run': r.name },
        cells: [
          el('input', {
            type: 'checkbox', checked: selected.has(r.name), 'data-select-run': r.name,
            'aria-label': `select ${r.name}`,
            onchange: (event) => {
              if (event.target.checked) selected.add(r.name);
              else selected.delete(r.name);
              compare.disabled = selected.size === 0;
            },
          }),
          el('a', { href: chartsHref([r.name]), 'data-run-link': r.name }, r.name),
          [statusBadge(r.status), r.live ? badge('live', 'live') : null],
          fmtTime(r.started),
          `${fmtNum(r.step)}${r.total_steps ? ` / ${r.total_steps}` : ''}`,
          fmtPct(r.last_success), fmtPct(r.last_eval_success), r.algorithm || '—', (r.envs || []).join(', '),
          el('span', { class: 'row-links' },
            el('a', { href: hashFor('runs', r.name, 'config'), 'data-config-link': r.name }, 'config'), ' · ',
            el('a', { href: `#/trajectories?run=${enc(r.name)}` }, 'trajectories')),
        ],
      })),
      { class: 'data-table runs-table' },
    ));
  };
  render();
  store.listeners.add(render);
  ctx.onCleanup(() => store.listeners.delete(render));
}

// ===== page: config ===============================================================================

async function pageConfig(ctx, page, where) {
  const [run] = where.args;
  const answer = await api(runApi(run, 'config'));
  if (!ctx.alive) return;
  add(page,
    pageHeader(`Config of ${run}`, el('a', { class: 'btn', href: '#/runs' }, '← runs'),
      el('a', { class: 'btn', href: chartsHref([run]) }, 'Charts')),
    el('pre', { class: 'card yaml', 'data-config-yaml': '' }, answer.yaml ?? ''),
  );
}

// ===== page: not found ============================================================================

async function pageNotFound(ctx, page) {
  add(page, el('div', { class: 'failure', 'data-failure': 'not-found' },
    el('h2', {}, 'No such page'),
    el('p', {}, 'This address is not a dashboard page.'),
    el('p', {}, el('a', { href: '#/charts' }, 'Go to the charts'))));
}

const PAGES = {
  charts: pageCharts,
  system: pageSystem,
  trajectories: pageTrajectories,
  trajectory: pageTrajectory,
  group: pageGroup,
  runs: pageRuns,
  config: pageConfig,
  notfound: pageNotFound,
};

const PAGE_TITLES = {
  charts: 'Charts',
  system: 'System',
  trajectories: 'Trajectories',
  trajectory: 'Trajectory',
  group: 'Group',
  runs: 'Runs',
  config: 'Config',
  notfound: 'Not found',
};

// ===== boot =======================================================================================

function boot() {
  window.addEventListener('hashchange', route);
  pollNav();
  setInterval(() => { if (!document.hidden) pollNav(); }, NAV_POLL_MS);
  route();
}

boot();
