// Chat: a conversation streamed through the server's own /v1/chat/completions, each reply with its timings and the
// backend that served it. The conversation lives in the browser's storage, so a reload keeps it.

import {
  FLAME, header, showEngine, engineInfo, loadSettings, settingsForm, saveSettings, postJSON, store, escapeHtml, fmt, ms,
} from "./common.js";
import { highlight } from "./highlight.js";

const SETTINGS_ICON = `<svg viewBox="0 0 24 24" fill="none" stroke="currentColor" stroke-width="2" stroke-linecap="round"><path d="M4 6h10M18 6h2M4 12h4M12 12h8M4 18h12M20 18h0"/><circle cx="16" cy="6" r="2"/><circle cx="10" cy="12" r="2"/><circle cx="18" cy="18" r="2"/></svg>`;
const SUGGESTIONS = [
  ["Binary search tree", "Write a Python class for a binary search tree with insert, delete and search."],
  ["Parse a log file", "Write a Python function that counts the lines of a log file by level."],
  ["Retry with backoff", "Write a Python decorator that retries a function with exponential backoff."],
  ["LRU cache", "Implement an LRU cache in Python without functools."],
];

let conversation = store.get("conversation", []);
let controller = null; // the AbortController of the reply being streamed

const $ = (sel) => document.querySelector(sel);
const list = () => $(".messages-inner");

// ---- rendering --------------------------------------------------------------------------------------------

function renderText(text) {
  const inline = (s) => escapeHtml(s).replace(/`([^`\n]+)`/g, "<code>$1</code>");
  const paragraphs = (s) =>
    s.split(/\n{2,}/).filter((p) => p.trim()).map((p) => `<p>${inline(p.replace(/^\n+|\n+$/g, ""))}</p>`).join("");
  let html = "";
  let rest = text;
  const fence = /```([\w+.#-]*)[^\n]*\n?([\s\S]*?)(```|$)/;
  for (let m = fence.exec(rest); m; m = fence.exec(rest)) {
    html += paragraphs(rest.slice(0, m.index));
    const lang = m[1] || "code";
    html += `<div class="codeblock"><header><span>${escapeHtml(lang)}</span><button type="button" data-copy>Copy</button></header>`
      + `<pre><code>${highlight(m[2].replace(/\n$/, ""))}</code></pre></div>`;
    rest = rest.slice(m.index + m[0].length);
  }
  return html + paragraphs(rest);
}

function timingsHtml(msg) {
  const t = msg.timings;
  const parts = [];
  if (msg.served) {
    const spec = msg.served.backend === "off" ? "off" : `${msg.served.backend} × ${msg.served.draft_tokens}`;
    parts.push(`<span class="served" data-k="backend" title="speculation backend × draft tokens">backend <b>${escapeHtml(spec)}</b></span>`);
  }
  if (t) {
    const perRound = t.rounds > 0 ? 1 + t.draft_n_accepted / t.rounds : null;
    parts.push(
      `<span data-k="ttft" title="time to first token (queue + prefill)">TTFT <b>${ms(t.prompt_ms)}</b></span>`,
      `<span data-k="tps" title="decode tokens per second">decode <b>${fmt(t.predicted_per_second)} tok/s</b></span>`,
      `<span data-k="tpr" title="tokens committed per round: 1 + accepted / rounds">per round <b>${fmt(perRound, 2)}</b></span>`,
      `<span data-k="accepted" title="drafts accepted / drafted">accepted <b>${t.draft_n_accepted} / ${t.draft_n}</b></span>`,
      `<span data-k="rounds" title="verify rounds">rounds <b>${t.rounds}</b></span>`,
      `<span data-k="tokens" title="prompt → generated tokens">tokens <b>${t.prompt_n} → ${t.predicted_n}</b></span>`,
    );
  } else if (msg.first_ms !== undefined) {
    parts.push(`<span data-k="ttft" title="time to first token, seen by this browser">TTFT <b>${ms(msg.first_ms)}</b></span>`);
  }
  if (msg.stopped) parts.push(`<span class="note" data-k="stopped">stopped</span>`);
  if (msg.finish === "length") parts.push(`<span class="note" data-k="finish" title="reached max tokens">length</span>`);
  return parts.join("");
}

function messageHtml(msg, i) {
  if (msg.role === "user") {
    return `<div class="msg user" data-testid="message" data-role="user" data-index="${i}"><div class="bubble">${escapeHtml(msg.content)}</div></div>`;
  }
  const body = msg.error
    ? `<div class="error" data-testid="error">${escapeHtml(msg.error)}</div>`
    : `<div class="content ${msg.pending ? "cursor" : ""}" data-testid="reply">${renderText(msg.content)}</div>`;
  return `<div class="msg assistant" data-testid="message" data-role="assistant" data-index="${i}" data-done="${!msg.pending}">
    <div class="who">${FLAME}<span>ignis</span></div>${body}
    <div class="timings" data-testid="timings">${timingsHtml(msg)}</div></div>`;
}

function render() {
  const root = list();
  if (!conversation.length) {
    root.innerHTML = `<div class="empty"><h1>What shall we write?</h1>
      <p>Replies stream from this server; each one shows how fast it came and how many drafted tokens the model kept.</p>
      <div class="suggestions">${SUGGESTIONS.map(([title, text]) =>
        `<button type="button" data-suggest="${escapeHtml(text)}">${escapeHtml(title)}<small>${escapeHtml(text)}</small></button>`).join("")}</div></div>`;
    return;
  }
  root.innerHTML = conversation.map(messageHtml).join("");
  scrollDown();
}

function renderLast() {
  const i = conversation.length - 1;
  const node = list().querySelector(`[data-index="${i}"]`);
  if (!node) return render();
  node.outerHTML = messageHtml(conversation[i], i);
  scrollDown();
}

function scrollDown() {
  const box = $(".messages");
  box.scrollTop = box.scrollHeight;
}

function save() {
  store.set("conversation", conversation);
}

// ---- sending ----------------------------------------------------------------------------------------------

function setBusy(busy) {
  const button = $(".composer button");
  button.textContent = busy ? "Stop" : "Send";
  button.classList.toggle("stop", busy);
  button.dataset.testid = busy ? "stop" : "send";
  button.type = busy ? "button" : "submit";
}

function requestBody(settings) {
  const messages = [];
  if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
  for (const m of conversation) {
    if (m.pending || m.error || (m.role === "assistant" && !m.content)) continue;
    messages.push({ role: m.role, content: m.content });
  }
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: settings.temperature,
    top_p: settings.top_p,
    max_tokens: settings.max_tokens,
  };
  if (settings.top_k) body.top_k = settings.top_k;
  if (settings.seed !== "" && settings.seed !== null) body.seed = settings.seed;
  return body;
}

async function send(text) {
  if (controller || !text.trim()) return;
  const settings = loadSettings();
  conversation.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", pending: true };
  conversation.push(reply);
  render();
  save();
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  try {
    reply.served = await engineInfo().catch(() => null);
    const res = await postJSON("/v1/chat/completions", requestBody(settings), controller.signal);
    await readStream(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        if (choice.delta?.content) {
          if (reply.first_ms === undefined) reply.first_ms = performance.now() - started;
          reply.content += choice.delta.content;
        }
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
      if (chunk.timings) reply.timings = chunk.timings;
      renderLast();
    });
  } catch (err) {
    if (err.name === "AbortError") reply.stopped = true;
    else reply.error = err.message;
  } finally {
    reply.pending = false;
    controller = null;
    setBusy(false);
    renderLast();
    save();
  }
}

// Server-sent events: one JSON object per `data:` line, ended by `data: [DONE]`.
async function readStream(res, onChunk) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

// ---- wiring -----------------------------------------------------------------------------------------------

function init() {
  header("chat", `<button class="icon-btn settings-toggle" data-testid="settings-toggle" title="Settings" aria-label="Settings">${SETTINGS_ICON}</button>`);
  engineInfo().then(showEngine, () => showEngine(null));
  settingsForm($(".settings-fields"));
  const key = $('[data-testid="api-key"]');
  key.value = loadSettings().api_key || "";
  key.addEventListener("input", () => saveSettings({ ...loadSettings(), api_key: key.value }));
  $('[data-testid="settings-toggle"]').addEventListener("click", () => $(".settings").classList.toggle("open"));
  $('[data-testid="clear"]').addEventListener("click", () => {
    if (controller) controller.abort();
    conversation = [];
    save();
    render();
  });

  const prompt = $('[data-testid="prompt"]');
  const grow = () => {
    prompt.style.height = "auto";
    prompt.style.height = `${Math.min(prompt.scrollHeight, 200)}px`;
  };
  const submit = () => {
    const text = prompt.value;
    prompt.value = "";
    grow();
    send(text);
  };
  prompt.addEventListener("input", grow);
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      if (!controller) submit();
    }
  });
  $("form").addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  $(".composer button").addEventListener("click", (e) => {
    if (controller) {
      e.preventDefault();
      controller.abort();
    }
  });
  list().addEventListener("click", (e) => {
    const suggestion = e.target.closest("[data-suggest]");
    if (suggestion) send(suggestion.dataset.suggest);
    const copy = e.target.closest("[data-copy]");
    if (copy) {
      navigator.clipboard?.writeText(copy.closest(".codeblock").querySelector("code").textContent);
      copy.textContent = "Copied";
      setTimeout(() => { copy.textContent = "Copy"; }, 1200);
    }
  });
  // A reply that was streaming when the page went away ends there; say so rather than show a cursor forever.
  for (const m of conversation) if (m.role === "assistant" && m.pending) { m.pending = false; m.stopped = true; }
  render();
}

init();
