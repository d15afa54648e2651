// Monitor: the engine's own counters (/metrics.json, the numbers /metrics exposes) polled each second and charted,
// the resolved config, and the control panel (live sampling settings; the `ignis serve` line for the rest).

import { header, showEngine, getJSON, postJSON, settingsForm, escapeHtml, fmt } from "./common.js";
import { barChart, lineChart } from "./charts.js";

const POLL_MS = 1000;
const SLOTS = 120; // two minutes of one-second samples
const WINDOW = 30; // tiles average over the last 30 s that saw work

const samples = []; // {time, stats}
const series = { tpr: [], tps: [], rps: [], running: [], waiting: [] };
let engine = null;

const $ = (sel) => document.querySelector(sel);
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

function push(name, value) {
  series[name].push(value);
  if (series[name].length > SLOTS) series[name].shift();
}

function sum(values) {
  return values.reduce((a, b) => a + b, 0);
}

// ---- sampling ---------------------------------------------------------------------------------------------

async function poll() {
  let snap;
  try {
    snap = await getJSON("/metrics.json");
  } catch {
    showEngine(null);
    return;
  }
  if (!engine) {
    engine = snap.engine;
    showEngine(engine);
  }
  const prev = samples[samples.length - 1];
  samples.push(snap);
  if (samples.length > SLOTS + 1) samples.shift();
  const s = snap.stats;
  if (prev) {
    const dt = snap.time - prev.time || 1;
    const p = prev.stats;
    const rounds = s.rounds - p.rounds;
    push("tps", (s.generation_tokens_total - p.generation_tokens_total) / dt);
    push("rps", rounds / dt);
    push("tpr", rounds > 0 ? 1 + (s.accepted - p.accepted) / rounds : null);
  }
  push("running", s.running);
  push("waiting", s.waiting);
  draw();
}

// ---- drawing ----------------------------------------------------------------------------------------------

function tile(id, value, small = "") {
  $(`[data-testid="tile-${id}"] .value`).innerHTML = `<span data-value>${value}</span>${small ? `<small>${small}</small>` : ""}`;
}

function draw() {
  const last = samples[samples.length - 1];
  if (!last) return;
  const s = last.stats;
  const lanes = engine?.lanes ?? 0;

  // Tiles: recent rates over the last WINDOW seconds with work; tokens per round since start when idle so far.
  const busy = series.rps.map((r, i) => [r, series.tps[i]]).slice(-WINDOW).filter(([r, t]) => r > 0 || t > 0);
  const tpsNow = busy.length ? sum(busy.map(([, t]) => t)) / busy.length : 0;
  const rpsNow = busy.length ? sum(busy.map(([r]) => r)) / busy.length : 0;
  const overall = s.rounds > 0 ? 1 + s.accepted / s.rounds : null;
  const recent = samples.slice(-WINDOW - 1);
  const dRounds = recent.length > 1 ? s.rounds - recent[0].stats.rounds : 0;
  const tprNow = dRounds > 0 ? 1 + (s.accepted - recent[0].stats.accepted) / dRounds : overall;
  tile("tpr", fmt(tprNow, 2), overall !== null ? `all ${fmt(overall, 2)}` : "");
  tile("tps", fmt(tpsNow, 0));
  tile("rps", fmt(rpsNow, 1));
  tile("lanes", String(s.running), `/ ${lanes}`);
  tile("queue", String(s.waiting));
  tile("requests", s.requests_total.toLocaleString("en-US"), `${fmt(s.generation_tokens_total, 0)} tokens`);

  const lastOf = (name) => series[name][series[name].length - 1];
  $('[data-now="tpr"]').textContent = lastOf("tpr") ? fmt(lastOf("tpr"), 2) : "";
  $('[data-now="tps"]').textContent = `${fmt(lastOf("tps") ?? 0, 0)} tok/s`;
  $('[data-now="rps"]').textContent = `${fmt(lastOf("rps") ?? 0, 1)} /s`;
  $('[data-now="lanes"]').innerHTML = `<span style="color:var(--chart-1)">●</span> ${s.running} busy · `
    + `<span style="color:var(--chart-4)">●</span> ${s.waiting} queued`;

  const k = engine?.draft_tokens ?? 0;
  lineChart($('[data-testid="chart-tpr"]'), [{ values: series.tpr, color: css("--chart-1"), fill: true }],
    { slots: SLOTS, max: Math.max(2, k + 1), floor: 0 });
  lineChart($('[data-testid="chart-tps"]'), [{ values: series.tps, color: css("--chart-2"), fill: true }], { slots: SLOTS });
  lineChart($('[data-testid="chart-rps"]'), [{ values: series.rps, color: css("--chart-3"), fill: true }], { slots: SLOTS });
  lineChart($('[data-testid="chart-lanes"]'), [
    { values: series.running, color: css("--chart-1"), fill: true },
    { values: series.waiting, color: css("--chart-4") },
  ], { slots: SLOTS, max: Math.max(lanes, ...series.waiting, 1) });

  const drafted = s.position_drafted;
  const accepted = s.position_accepted;
  const bars = drafted.map((d, i) => ({
    label: String(i + 1),
    value: d > 0 ? accepted[i] / d : null,
    title: `position ${i + 1}: ${accepted[i]} of ${d} drafts accepted`,
  }));
  const totalDrafted = sum(drafted);
  $('[data-now="acc"]').textContent = totalDrafted ? `${fmt((100 * sum(accepted)) / totalDrafted, 0)}% overall` : "";
  barChart($('[data-testid="chart-acceptance"]'), bars, {
    color: css("--chart-1"),
    empty: k ? "no speculative request yet" : "speculation is off (spec.backend = off)",
  });
}

// ---- config and control -----------------------------------------------------------------------------------

const SUMMARY = [
  ["model", (c) => c.engine?.model_name ?? (c.config.model.path || "built-in")],
  // What the engine runs: "auto" backend and draft head and context 0 in the config are settled by the engine at
  // start-up.
  ["backend", (c) => c.engine?.backend ?? c.config.spec.backend],
  ["draft tokens", (c) => c.engine?.draft_tokens ?? c.config.spec.draft_tokens],
  ["draft head", (c) => c.engine?.draft_head || c.config.spec.draft_head],
  ["profile", (c) => c.profile ?? "none"],
  ["lanes", (c) => c.config.engine.lanes],
  ["context", (c) => (c.engine?.context ?? c.config.engine.context).toLocaleString("en-US")],
  ["device", (c) => c.config.model.device],
];

function rows(pairs) {
  return pairs.map(([k, v]) => `<tr><td>${escapeHtml(k)}</td><td>${escapeHtml(v === "" ? '""' : String(v))}</td></tr>`).join("");
}

function showConfig(c) {
  $('[data-testid="config-summary"]').innerHTML = rows(SUMMARY.map(([k, f]) => [k, f(c)]));
  const all = Object.entries(c.config).flatMap(([section, table]) =>
    Object.entries(table).map(([key, v]) => [`${section}.${key}`, v]));
  $('[data-testid="config-all"]').innerHTML = rows(all);
  $('[data-testid="profile"]').textContent = c.profile ? `follows profile ${c.profile}` : "";

  const b = c.backends;
  const why = {
    off: "plain decoding",
    mtp: b.mtp ? "model has MTP layers" : "model has no mtp.* weights",
    dflash2: b.drafter_width ? `drafter trained for ${b.drafter_width}` : "no drafter",
  };
  $('[data-testid="backends"]').innerHTML = b.installed.map((name) => {
    const running = name === c.config.spec.backend;
    return `<span class="backend ${running ? "running" : ""}" data-backend="${escapeHtml(name)}" data-running="${running}">
      ${escapeHtml(name)}<small>${running ? "running" : escapeHtml(why[name] ?? "installed")}</small></span>`;
  }).join("");

  $('[data-testid="restart-fields"]').innerHTML = c.settings.map((s) => {
    const input = s.choices
      ? `<select class="input" data-key="${s.key}">${s.choices.map((o) =>
        `<option ${String(o) === String(s.value) ? "selected" : ""}>${escapeHtml(o)}</option>`).join("")}</select>`
      : `<input class="input" data-key="${s.key}" type="number" value="${s.value}" ${s.min !== null ? `min="${s.min}"` : ""} ${s.max !== null ? `max="${s.max}"` : ""}>`;
    return `<label class="field"><span class="row">${escapeHtml(s.key)}</span>${input}</label>`;
  }).join("");
  document.querySelectorAll("[data-key]").forEach((node) => node.addEventListener("change", plan));
  // "off" drafts nothing: clear the draft count with it, as the config requires.
  $('[data-key="spec.backend"]').addEventListener("change", (e) => {
    const drafts = $('[data-key="spec.draft_tokens"]');
    if (e.target.value === "off") drafts.value = 0;
    else if (Number(drafts.value) === 0) drafts.value = c.backends.drafter_width ?? 1;
  }, { capture: true });
  $('[data-testid="command"]').textContent = c.command;
  $('[data-testid="command-note"]').textContent = "This line serves what runs now.";
}

async function plan() {
  const wanted = {};
  document.querySelectorAll("[data-key]").forEach((node) => { wanted[node.dataset.key] = node.value; });
  const note = $('[data-testid="command-note"]');
  document.querySelectorAll("[data-key]").forEach((node) => node.removeAttribute("aria-invalid"));
  try {
    const res = await postJSON("/playground/command", { set: wanted });
    const body = await res.json();
    $('[data-testid="command"]').textContent = body.command;
    note.className = "cmd-note";
    note.textContent = body.restart
      ? `Restart ignis serve with this line to change ${body.changed.join(", ")}.`
      : "This line serves what runs now.";
  } catch (err) {
    note.className = "cmd-note bad";
    note.textContent = err.message;
    const field = document.querySelector(`[data-key="${err.param}"]`);
    if (field) field.setAttribute("aria-invalid", "true");
  }
}

function init() {
  header("monitor");
  settingsForm($(".live-fields"), { system: false, pair: false });
  getJSON("/playground/config").then(showConfig, (err) => { $('[data-testid="command-note"]').textContent = err.message; });
  $('[data-testid="copy-command"]').addEventListener("click", () => {
    navigator.clipboard?.writeText($('[data-testid="command"]').textContent);
  });
  window.addEventListener("resize", draw);
  window.addEventListener("themechange", draw);
  poll();
  setInterval(poll, POLL_MS);
}

init();
