// relay's live dashboard: charts from GET /v1/metrics (the series GET /v1/dashboard names, the
// same ones the orchestrator's Prometheus /metrics exports), the services' health from
// GET /v1/status, and a rollout browser over GET /v1/rollouts and /v1/rollouts/{id}.
// Plain script, no build step; uPlot is vendored next to it.
"use strict";

const POLL_MS = 2000;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const MARK_COLOR = "#9aa3ad";

const state = {
  spec: null,
  records: [],
  charts: [], // {def, plot, el}
  cursor: null, // the rollout browser's next page
};

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "dataset") Object.assign(e.dataset, v);
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// The run's token (the "token" of RUN_DIR/secrets.json): the rollout browser's routes need it;
// charts and status do not. It comes once per tab, in the address (#token=...; removed from it at
// once) or, on a 401, from a prompt, and is kept in this tab's sessionStorage.
const TOKEN_KEY = "relay-token";

function takeTokenFromAddress() {
  const params = new URLSearchParams(location.hash.slice(1));
  const t = params.get("token");
  if (!t) return;
  sessionStorage.setItem(TOKEN_KEY, t);
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", rest ? `#${rest}` : location.pathname + location.search);
}

async function getJSON(url, asked = false) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const r = await fetch(url, { cache: "no-store", headers });
  if (r.status === 401 && !asked) {
    const t = window.prompt('This run\'s token (the "token" of RUN_DIR/secrets.json):');
    if (t) {
      sessionStorage.setItem(TOKEN_KEY, t.trim());
      return getJSON(url, true);
    }
  }
  if (!r.ok) {
    let detail = `${r.status} ${r.statusText}`;
    try { detail = (await r.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(detail);
  }
  return r.json();
}

const fmt = (v, digits = 3) => (v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(digits));

function valueOf(rec, key) {
  let v = rec;
  for (const part of key.split(".")) {
    if (v === null || typeof v !== "object" || !(part in v)) return null;
    v = v[part];
  }
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

// ------------------------------------------------------------------ charts

function chartWidth(box) {
  return Math.max(280, box.clientWidth - 16);
}

function buildCharts(spec) {
  const root = $("#charts");
  for (const def of spec.charts) {
    const box = el("div", { class: "chart", id: `chart-${def.id}`, dataset: { points: "0" } },
      el("h3", {}, def.title, " ", el("span", { class: "unit" }, `(${def.unit})`)));
    root.append(box);
    const series = [{ label: "step" }];
    def.series.forEach((s, i) => series.push({ label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true }));
    for (const [label] of def.marks) series.push({ label, stroke: MARK_COLOR, width: 1, dash: [6, 4], points: { show: false } });
    const opts = {
      width: chartWidth(box),
      height: 200,
      series,
      scales: { x: { time: false }, ...(def.y_range ? { y: { range: def.y_range } } : {}) },
      axes: [{ label: "step", size: 40 }, { size: 56 }],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
    };
    const data = [[], ...series.slice(1).map(() => [])];
    state.charts.push({ def, box, plot: new uPlot(opts, data, box) });
  }
  window.addEventListener("resize", () => {
    for (const c of state.charts) c.plot.setSize({ width: chartWidth(c.box), height: 200 });
  });
}

function chartData(def, records) {
  const xs = records.map((r) => r.step);
  const cols = def.series.map((s) => {
    const raw = records.map((r) => valueOf(r, s.key));
    if (!s.total) return raw;
    // A running total (decode idle seconds): plot the increase over each step.
    return raw.map((v, i) => (i === 0 || v === null || raw[i - 1] === null ? null : Math.max(0, v - raw[i - 1])));
  });
  for (const [, value] of def.marks) cols.push(xs.map(() => value));
  return [xs, ...cols];
}

function updateCharts() {
  for (const c of state.charts) {
    const data = chartData(c.def, state.records);
    c.plot.setData(data);
    // Away from the cursor, the legend shows the latest step's values.
    if (c.plot.cursor.idx === null || c.plot.cursor.idx === undefined) c.plot.setLegend({ idx: data[0].length - 1 });
    // Drawn points (the test reads this after the page's scripts ran).
    const points = data.slice(1, 1 + c.def.series.length).reduce((n, col) => n + col.filter((v) => v !== null).length, 0);
    c.box.dataset.points = String(points);
  }
}

async function pollMetrics() {
  const last = state.records.length ? state.records[state.records.length - 1].step : 0;
  const fresh = await getJSON(`/v1/metrics?after=${last}`);
  if (fresh.length) {
    state.records.push(...fresh);
    updateCharts();
  }
}

// ------------------------------------------------------------------ status and health

function ranges(rs) {
  return rs.map(([a, b]) => (a === b ? `v${a}` : `v${a}–v${b}`)).join(", ");
}

function renderStatus(st) {
  $("#step").textContent = `step ${st.step} / ${st.max_steps}`;
  const pill = $("#state");
  pill.className = `pill ${st.paused ? "paused" : "running"}`;
  pill.textContent = st.paused ? `paused${st.paused_reason ? `: ${st.paused_reason}` : ""}` : "running";
  const served = st.versions_served || [];
  $("#versions").textContent = `policy v${st.policy_version}${served.length ? ` · served ${ranges(served)}` : ""}`;
  $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  const body = $("#health tbody");
  body.replaceChildren(...st.health.map((h) => el("tr", { class: h.ok ? "ok" : "bad", dataset: { name: h.name } },
    el("td", {}, h.name),
    el("td", { class: "state" }, h.state + (h.last_exit !== null && h.last_exit !== undefined ? ` (last exit ${h.last_exit})` : "")),
    el("td", { class: "num" }, h.restarts === null ? "–" : h.restarts),
    el("td", { class: "num" }, h.up_s === null ? "–" : `${Math.round(h.up_s)} s`),
    el("td", { class: "num" }, h.version === null ? "–" : `v${h.version}`),
    el("td", {}, h.url || "–"))));
  $("#health").dataset.services = String(st.health.length);
}

async function pollStatus() {
  try {
    renderStatus(await getJSON("/v1/status"));
  } catch (e) {
    const pill = $("#state");
    pill.className = "pill down";
    pill.textContent = `orchestrator unreachable (${e.message})`;
  }
}

// ------------------------------------------------------------------ rollout browser

function rolloutQuery(form, cursor) {
  const p = new URLSearchParams();
  for (const [k, v] of new FormData(form)) if (v !== "") p.set(k, v);
  if (cursor) p.set("cursor", cursor);
  return p;
}

async function loadRollouts(append) {
  const form = $("#filters");
  const err = $("#browser-error");
  err.textContent = "";
  let page;
  try {
    page = await getJSON(`/v1/rollouts?${rolloutQuery(form, append ? state.cursor : null)}`);
  } catch (e) {
    err.textContent = e.message;
    return;
  }
  const body = $("#rollouts tbody");
  const rows = page.rollouts.map((r) => el("tr", { dataset: { id: r.id }, onclick: () => openRollout(r.id) },
    el("td", {}, r.id),
    el("td", {}, r.task),
    el("td", { class: "num" }, fmt(r.reward)),
    el("td", { class: "num" }, r.version === null ? "–" : `v${r.version}`),
    el("td", { class: "num" }, r.staleness === null ? "–" : r.staleness),
    el("td", { class: "num" }, fmt(r.length, 1)),
    el("td", { class: `status ${r.status}`, title: r.reason }, r.status + (r.reason ? ` (${r.reason.split(":")[0]})` : "")),
    el("td", {}, new Date(r.finished * 1000).toLocaleTimeString())));
  if (append) body.append(...rows);
  else body.replaceChildren(...rows);
  $("#rollouts").dataset.rows = String(body.children.length);
  state.cursor = page.next_cursor;
  $("#older").hidden = !page.next_cursor;
}

// Advantage -> background: green pushed up, red pushed down, stronger the larger |A|.
function advColor(a) {
  const alpha = Math.min(1, Math.abs(a)) * 0.55 + 0.08;
  return a >= 0 ? `rgba(26,127,55,${alpha})` : `rgba(198,40,40,${alpha})`;
}

function renderSegment(seg) {
  if (seg.role !== "model") return el("span", { class: `seg ${seg.role}` }, seg.text);
  const toks = seg.pieces.map((piece, i) => el("span", {
    class: "tok",
    style: `background:${advColor(seg.advantages[i])}`,
    title: `advantage ${fmt(seg.advantages[i])} · log-prob ${fmt(seg.logprobs[i])} · v${seg.versions[i]}`,
    dataset: { adv: String(seg.advantages[i]) },
  }, piece));
  return el("span", { class: "seg model" }, ...toks);
}

async function openRollout(id) {
  const art = $("#rollout");
  for (const tr of document.querySelectorAll("#rollouts tbody tr")) tr.classList.toggle("open", tr.dataset.id === id);
  let g;
  try {
    g = await getJSON(`/v1/rollouts/${encodeURIComponent(id)}`);
  } catch (e) {
    art.hidden = false;
    art.replaceChildren(el("h3", {}, id), el("p", { class: "error" }, e.message));
    return;
  }
  history.replaceState(null, "", `#rollout=${encodeURIComponent(id)}`);
  const fate = g.fate.status + (g.fate.trainer_version !== null ? ` at v${g.fate.trainer_version}` : "") + (g.fate.reason ? ` (${g.fate.reason})` : "");
  const samples = g.samples.map((s, i) => el("div", { class: "sample", dataset: { sample: String(i) } },
    el("div", { class: "meta" }, `sample ${i} · reward ${fmt(s.reward)} · advantage ${fmt(s.advantage)} · ${s.turns} turn(s) · ${s.finish_reason} · min version v${s.min_version}`),
    el("div", { class: "turns" }, ...s.segments.map(renderSegment))));
  art.hidden = false;
  art.dataset.id = id;
  art.replaceChildren(
    el("h3", {}, `${g.group_id} · ${g.env} · seed ${g.seed} · mean reward ${fmt(g.reward)} · ${fate}`),
    el("p", { class: "legend" }, "grey: prompt · purple: environment · model tokens shaded by their advantage (green up, red down); hover a token for its log-prob and version"),
    ...samples);
}

// ------------------------------------------------------------------ start

async function start() {
  takeTokenFromAddress();
  state.spec = await getJSON("/v1/dashboard");
  $("#run").textContent = state.spec.run;
  document.title = `relay · ${state.spec.run}`;
  const task = $("#filters select[name=task]");
  for (const t of state.spec.tasks) task.append(el("option", {}, t.env));
  buildCharts(state.spec);
  $("#filters").addEventListener("submit", (ev) => { ev.preventDefault(); loadRollouts(false); });
  $("#older").addEventListener("click", () => loadRollouts(true));
  await Promise.all([pollMetrics(), pollStatus(), loadRollouts(false)]);
  const linked = new URLSearchParams(location.hash.slice(1)).get("rollout");
  if (linked) await openRollout(linked);
  document.body.dataset.ready = "1";
  setInterval(() => pollMetrics().catch(() => {}), POLL_MS);
  setInterval(pollStatus, POLL_MS);
}

start().catch((e) => {
  document.body.dataset.error = e.message;
  $("#state").textContent = `dashboard failed to start: ${e.message}`;
});
