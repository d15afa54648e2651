// What both pages share: theme, the header, browser storage, the per-request settings, and calls to the server.

export const FLAME = `<svg viewBox="0 0 24 24" fill="none" aria-hidden="true"><path d="M12 2.5c.6 3.2-1.1 5-2.8 6.9C7.6 11.1 6 12.9 6 15.6 6 19 8.7 21.5 12 21.5s6-2.5 6-5.9c0-2.6-1.3-4.3-2.5-5.6-.2 1.5-.9 2.6-2 3.1.5-3.6-.2-7.4-1.5-10.6Z" fill="var(--accent)"/><path d="M12 21.5c-1.9 0-3.3-1.4-3.3-3.2 0-1.9 1.6-2.8 2.6-4.4.5 1.3 1.4 1.9 2.3 2.4.9.6 1.7 1.1 1.7 2.2 0 1.7-1.4 3-3.3 3Z" fill="#ffc069"/></svg>`;
const SUN = `<svg viewBox="0 0 24 24" fill="none" stroke="currentColor" stroke-width="2" stroke-linecap="round"><circle cx="12" cy="12" r="4"/><path d="M12 2v2M12 20v2M4.9 4.9l1.4 1.4M17.7 17.7l1.4 1.4M2 12h2M20 12h2M4.9 19.1l1.4-1.4M17.7 6.3l1.4-1.4"/></svg>`;
const MOON = `<svg viewBox="0 0 24 24" fill="none" stroke="currentColor" stroke-width="2" stroke-linecap="round" stroke-linejoin="round"><path d="M21 12.8A9 9 0 1 1 11.2 3a7 7 0 0 0 9.8 9.8Z"/></svg>`;

const PREFIX = "ignis.playground.";

export const store = {
  get(key, fallback) {
    try {
      const raw = localStorage.getItem(PREFIX + key);
      return raw === null ? fallback : JSON.parse(raw);
    } catch {
      return fallback;
    }
  },
  set(key, value) {
    localStorage.setItem(PREFIX + key, JSON.stringify(value));
  },
  remove(key) {
    localStorage.removeItem(PREFIX + key);
  },
};

// ---- theme: the system's unless the user picked one --------------------------------------------------------

function systemTheme() {
  return matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
}

export function applyTheme() {
  document.documentElement.dataset.theme = store.get("theme", null) || systemTheme();
}

function toggleTheme(button) {
  const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
  store.set("theme", next);
  applyTheme();
  button.innerHTML = next === "dark" ? SUN : MOON;
  window.dispatchEvent(new Event("themechange"));
}

// ---- header -----------------------------------------------------------------------------------------------

export function header(page, extra = "") {
  const top = document.querySelector("header.top");
  top.innerHTML = `
    <a class="brand" href="/playground">${FLAME}<span>ignis</span></a>
    <nav class="tabs">
      <a href="/playground" ${page === "chat" ? 'aria-current="page"' : ""}>Chat</a>
      <a href="/playground/monitor" ${page === "monitor" ? 'aria-current="page"' : ""}>Monitor</a>
    </nav>
    <span class="spacer"></span>
    <span class="chip model" data-testid="engine-chip"><span class="dot"></span><span>connecting…</span></span>
    ${extra}
    <button class="icon-btn" data-testid="theme" title="Light or dark" aria-label="Switch light or dark"></button>`;
  const button = top.querySelector('[data-testid="theme"]');
  button.innerHTML = document.documentElement.dataset.theme === "dark" ? SUN : MOON;
  button.addEventListener("click", () => toggleTheme(button));
}

export function showEngine(info) {
  const chip = document.querySelector('[data-testid="engine-chip"]');
  if (!chip) return;
  if (!info) {
    chip.innerHTML = `<span class="dot down"></span><span>engine unavailable</span>`;
    return;
  }
  const spec = info.backend === "off" ? "no speculation" : `${info.backend} × ${info.draft_tokens}`;
  chip.innerHTML = `<span class="dot ok"></span><b>${escapeHtml(info.model_name)}</b><span>${escapeHtml(spec)}</span>`;
}

// ---- the server -------------------------------------------------------------------------------------------

export function authHeaders() {
  const key = store.get("settings", {}).api_key;
  return key ? { Authorization: `Bearer ${key}` } : {};
}

export async function getJSON(path) {
  const res = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  const body = await res.json().catch(() => null);
  if (!res.ok) throw new Error(body?.error?.message || `${path}: HTTP ${res.status}`);
  return body;
}

export async function postJSON(path, payload, signal) {
  const res = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(payload),
    signal,
  });
  if (!res.ok) {
    const body = await res.json().catch(() => null);
    const err = new Error(body?.error?.message || `HTTP ${res.status}`);
    err.param = body?.error?.param;
    throw err;
  }
  return res;
}

// What the engine runs, as /v1/models reports it (backend and draft width beside the model's name).
export async function engineInfo() {
  const body = await getJSON("/v1/models");
  const m = body.data[0];
  return { model_name: m.id, backend: m.backend, draft_tokens: m.draft_tokens, context: m.max_model_len };
}

// ---- per-request settings: they change live, with no restart (the Chat sends them with every request) ----------

export const SETTINGS = [
  { key: "temperature", label: "Temperature", kind: "range", min: 0, max: 2, step: 0.05, value: 0, hint: "0 = greedy" },
  { key: "top_p", label: "Top p", kind: "range", min: 0.05, max: 1, step: 0.05, value: 1 },
  { key: "top_k", label: "Top k", kind: "number", min: 0, max: 1000, step: 1, value: 0, hint: "0 = off" },
  { key: "max_tokens", label: "Max tokens", kind: "number", min: 1, max: 100000, step: 1, value: 512 },
  { key: "seed", label: "Seed", kind: "number", min: 0, step: 1, value: "", hint: "empty = random" },
];

export function loadSettings() {
  const saved = store.get("settings", {});
  const out = { system: "", api_key: "" };
  for (const s of SETTINGS) out[s.key] = s.value;
  return { ...out, ...saved };
}

export function saveSettings(settings) {
  store.set("settings", settings);
  window.dispatchEvent(new Event("settingschange"));
}

// The fields of one setting, bound to storage; `root` receives them.
export function settingsForm(root, { system = true, pair = true } = {}) {
  const settings = loadSettings();
  const html = [];
  const pairs = SETTINGS.map((s) => {
    const value = settings[s.key];
    const shown = s.kind === "range" ? `<output>${value}</output>` : s.hint ? `<span class="hint">${s.hint}</span>` : "";
    return `<label class="field"><span class="row">${s.label}${shown}</span>
      <input class="input" data-setting="${s.key}" type="${s.kind}" min="${s.min}" ${s.max !== undefined ? `max="${s.max}"` : ""}
        step="${s.step}" value="${value}"></label>`;
  });
  html.push(...(pair ? [pairs[0], pairs[1], `<div class="pair">${pairs[2]}${pairs[3]}</div>`, pairs[4]] : pairs));
  if (system) {
    html.push(`<label class="field"><span class="row">System prompt</span>
      <textarea class="input" data-setting="system" rows="4" placeholder="Optional instructions for the model">${escapeHtml(settings.system)}</textarea></label>`);
  }
  root.innerHTML = html.join("");
  root.querySelectorAll("[data-setting]").forEach((el) => {
    el.addEventListener("input", () => {
      const now = loadSettings();
      const spec = SETTINGS.find((s) => s.key === el.dataset.setting);
      now[el.dataset.setting] = spec && el.value !== "" ? Number(el.value) : el.value;
      const out = el.closest("label").querySelector("output");
      if (out) out.textContent = el.value;
      saveSettings(now);
    });
  });
}

// ---- formatting ---------------------------------------------------------------------------------------------

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

export function fmt(x, digits = 1) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en-US");
  return x.toFixed(digits);
}

export function ms(x) {
  if (x === null || x === undefined) return "–";
  return x >= 1000 ? `${(x / 1000).toFixed(2)} s` : `${Math.round(x)} ms`;
}

applyTheme();
