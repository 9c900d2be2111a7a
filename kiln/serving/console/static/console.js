// The kiln console: playground (chat over /v1/chat/completions, streamed), dashboard (the server's
// metrics as sampled by /console/api/stats/stream) and the artifact card. No framework, no build step.
"use strict";

const $ = id => document.getElementById(id);
const KEY_STORAGE = "kiln.apiKey";
const HISTORY_S = 300;

// -- talking to the server ---------------------------------------------------------------------

const auth = { key: sessionStorage.getItem(KEY_STORAGE) || "", unlocked: false };

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (auth.key) headers.Authorization = `Bearer ${auth.key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    lock("The server refused the key.");
    throw new Unauthorized();
  }
  return response;
}

// Server-sent events from a fetch response (EventSource cannot send an Authorization header).
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { event: "message", data: "" };
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event.event = line.slice(6).trim();
        else if (line.startsWith("data:")) event.data += line.slice(5).trimStart();
      }
      if (event.data) yield event;
    }
  }
}

// -- the API key gate ----------------------------------------------------------------------------

function lock(message) {
  auth.unlocked = false;
  document.body.classList.add("locked");
  $("key-gate").hidden = false;
  $("send").disabled = true;
  $("key-error").textContent = message || "";
  $("api-key").focus();
}

function unlock() {
  auth.unlocked = true;
  document.body.classList.remove("locked");
  $("key-gate").hidden = true;
  $("send").disabled = chat.busy;
}

async function connect() {
  let response;
  try {
    response = await api("/console/api/card");
  } catch (e) {
    if (e instanceof Unauthorized) {
      if (!auth.key) $("key-error").textContent = "";
      return;
    }
    setTimeout(connect, 2000);          // the server is not reachable yet
    return;
  }
  if (auth.key) sessionStorage.setItem(KEY_STORAGE, auth.key);
  unlock();
  renderCard(await response.json());
  followStats();
}

$("key-form").addEventListener("submit", event => {
  event.preventDefault();
  auth.key = $("api-key").value.trim();
  $("key-error").textContent = "";
  connect();
});

// -- tabs -------------------------------------------------------------------------------------------

function showTab(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.hidden = tab.id !== name;
  for (const b of document.querySelectorAll(".tab-button")) b.classList.toggle("active", b.dataset.tab === name);
  if (name === "dashboard") renderDashboard();
}

for (const b of document.querySelectorAll(".tab-button")) {
  b.addEventListener("click", () => { history.replaceState(null, "", `#${b.dataset.tab}`); showTab(b.dataset.tab); });
}

// -- playground -----------------------------------------------------------------------------------

const chat = { messages: [], busy: false, controller: null };

function samplingParams() {
  const number = id => $(id).value === "" ? null : Number($(id).value);
  const params = { temperature: number("temperature"), top_p: number("top-p"), top_k: number("top-k"),
                   max_tokens: number("max-tokens"), seed: number("seed"),
                   ignore_eos: $("ignore-eos").checked };
  const stop = $("stop-strings").value.split("\n").filter(s => s !== "");
  if (stop.length) params.stop = stop;
  return Object.fromEntries(Object.entries(params).filter(([, v]) => v !== null));
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = `message ${role}`;
  el.innerHTML = `<div class="role">${role}</div><div class="text"></div><div class="meta"></div>`;
  el.querySelector(".text").textContent = text;
  $("chat").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setBusy(busy) {
  chat.busy = busy;
  $("send").disabled = busy || !auth.unlocked;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function send(text) {
  const system = $("system").value.trim();
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.classList.add("streaming");
  const messages = system ? [{ role: "system", content: system }, ...chat.messages] : chat.messages;
  chat.controller = new AbortController();
  setBusy(true);
  const run = { t0: performance.now(), tFirst: null, tEnd: null, chunks: 0, usage: null, finish: null, text: "" };
  try {
    await streamReply(run, messages, reply);
  } catch (e) {
    if (e.name === "AbortError") run.finish = "stopped";
    else if (!(e instanceof Unauthorized)) run.error = e.message;
  } finally {
    run.tEnd = performance.now();
    reply.classList.remove("streaming");
    // A refused or failed turn leaves the conversation as it was, so sending again does not repeat it.
    if (run.error) chat.messages.pop();
    else chat.messages.push({ role: "assistant", content: run.text });
    reply.querySelector(".meta").textContent = replyMeta(run);
    reply.dataset.finish = run.finish || (run.error ? "error" : "");
    setBusy(false);
  }
}

async function streamReply(run, messages, reply) {
  const body = { messages, stream: true, stream_options: { include_usage: true }, ...samplingParams() };
  const response = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    signal: chat.controller.signal });
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
  }
  const text = reply.querySelector(".text");
  for await (const { data } of sseEvents(response)) {
    // Stop means no more text, even from events already read into the buffer.
    if (chat.controller.signal.aborted) throw new DOMException("stopped", "AbortError");
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) run.usage = chunk.usage;
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) continue;
    if (choice.delta && choice.delta.content) {
      if (run.tFirst === null) run.tFirst = performance.now();
      run.chunks += 1;
      run.text += choice.delta.content;
      text.textContent = run.text;
    }
    if (choice.finish_reason) run.finish = choice.finish_reason;
  }
}

function replyMeta(run) {
  if (run.error) return `error: ${run.error}`;
  const parts = [];
  const tokens = run.usage ? run.usage.completion_tokens : run.chunks;
  if (run.usage) parts.push(`${run.usage.prompt_tokens} prompt + ${tokens} completion tokens`);
  else parts.push(`~${tokens} tokens received`);
  if (run.tFirst !== null) {
    parts.push(`TTFT ${formatSeconds((run.tFirst - run.t0) / 1000)}`);
    const decode = (run.tEnd - run.tFirst) / 1000;
    if (tokens > 1 && decode > 0) parts.push(`${((tokens - 1) / decode).toFixed(1)} tok/s`);
  }
  parts.push(run.finish === "stopped" ? "stopped by you" : `finish: ${run.finish}`);
  return parts.join(" · ");
}

$("composer").addEventListener("submit", event => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.busy || !auth.unlocked) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", event => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
$("clear").addEventListener("click", () => { chat.messages = []; $("chat").replaceChildren(); });

// -- dashboard --------------------------------------------------------------------------------------

const stats = { points: [], period: 1, connected: false };

async function followStats() {
  if (stats.connected) return;
  stats.connected = true;
  try {
    const response = await api("/console/api/stats/stream");
    for await (const { event, data } of sseEvents(response)) {
      const payload = JSON.parse(data);
      if (event === "history") { stats.points = payload.points; stats.period = payload.period; }
      else stats.points.push(payload);
      const since = stats.points.length ? stats.points[stats.points.length - 1].t - HISTORY_S : 0;
      stats.points = stats.points.filter(p => p.t > since);
      renderLive();
      if (!$("dashboard").hidden) renderDashboard();
    }
  } catch (e) { /* reconnect below */ }
  stats.connected = false;
  $("live-dot").classList.remove("on");
  if (auth.unlocked) setTimeout(followStats, 2000);
}

function setNumber(id, value, text) {
  $(id).dataset.value = value;
  $(id).textContent = text === undefined ? String(value) : text;
}

function renderLive() {
  const p = stats.points[stats.points.length - 1];
  if (!p) return;
  $("live-dot").classList.add("on");
  setNumber("live-running", p.running);
  setNumber("live-waiting", p.waiting);
  setNumber("live-kv", p.kv_used, `${p.kv_used.toLocaleString()} / ${p.kv_total.toLocaleString()}`);
}

const COLORS = { p50: "#2b7bb9", p90: "#e08a1e", p99: "#c0392b", a: "#2b7bb9", b: "#e08a1e" };

function renderDashboard() {
  const pts = stats.points, last = pts[pts.length - 1];
  if (!last) return;
  const times = pts.map(p => p.t), col = key => pts.map(p => p[key]);
  const quantiles = key => ["p50", "p90", "p99"].map(q => ({ name: q, color: COLORS[q], values: pts.map(p => p[key][q]) }));
  const chart = (id, format, series, yTop) =>
    drawChart($(`chart-${id}`), $(`legend-${id}`), { times, span: HISTORY_S, format, series, yTop });
  chart("ttft", formatSeconds, quantiles("ttft"));
  chart("itl", formatSeconds, quantiles("itl"));
  chart("requests", formatCount, [{ name: "running", color: COLORS.a, values: col("running") },
                                  { name: "waiting", color: COLORS.b, values: col("waiting") }]);
  chart("kv", formatCount, [{ name: "used", color: COLORS.a, values: col("kv_used") }], last.kv_total);
  chart("batch", v => v.toFixed(1), [{ name: "mean", color: COLORS.a, values: col("batch") }]);
  chart("tps", formatCount, [{ name: "tokens/s", color: COLORS.a, values: col("tokens_per_s") }]);
  chart("hit", v => `${Math.round(v * 100)}%`, [{ name: "hit rate", color: COLORS.a, values: col("prefix_hit_rate") }], 1);
  chart("429", formatCount, [{ name: "refused", color: COLORS.p99, values: col("rejected_429") }]);
  renderTiles(pts, last);
}

function renderTiles(pts, last) {
  setNumber("tile-running", last.running);
  setNumber("tile-waiting", last.waiting);
  setNumber("tile-kv", last.kv_used, `${last.kv_used.toLocaleString()} / ${last.kv_total.toLocaleString()}`);
  const share = last.kv_total ? last.kv_used / last.kv_total : 0;
  Object.assign($("kv-gauge").dataset, { used: last.kv_used, total: last.kv_total });
  $("kv-gauge").style.width = `${(100 * share).toFixed(1)}%`;
  setNumber("tile-batch", last.batch, last.batch.toFixed(1));
  setNumber("tile-tps", last.tokens_per_s, formatCount(last.tokens_per_s));
  const hit = last.prefix_hit_rate;
  setNumber("tile-hit", hit === null ? "" : hit, hit === null ? "–" : `${Math.round(hit * 100)}%`);
  const ttft = last.ttft.p50, itl = last.itl.p50;
  setNumber("tile-ttft", ttft === null ? "" : ttft, ttft === null ? "–" : formatSeconds(ttft));
  setNumber("tile-itl", itl === null ? "" : itl, itl === null ? "–" : formatSeconds(itl));
  setNumber("tile-429", pts.reduce((sum, p) => sum + p.rejected_429, 0));
}

function formatSeconds(s) {
  return s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms` : `${s.toFixed(2)} s`;
}

function formatCount(v) {
  return v >= 1000 ? `${(v / 1000).toFixed(1)}k` : String(Math.round(v * 10) / 10);
}

// -- artifact card ------------------------------------------------------------------------------------

function table(rows, header) {
  const t = document.createElement("table");
  if (header) t.append(row(header, "th"));
  for (const r of rows) t.append(row(r, "td"));
  return t;
}

function row(cells, tag) {
  const tr = document.createElement("tr");
  for (const cell of cells) tr.append(Object.assign(document.createElement(tag), { textContent: cell }));
  return tr;
}

function renderCard(card) {
  $("model-name").textContent = card.model;
  document.title = `kiln · ${card.model}`;
  const a = card.architecture, q = card.quantization, kv = card.kv;
  const settings = Object.entries(q.settings).map(([k, v]) => `${k}=${v}`).join(", ");
  const check = q.check ? `${q.check.perplexity.toFixed(3)} (fp32 ${q.check.perplexity_fp32.toFixed(3)}, ` +
    `top-1 agreement ${q.check.top1_agreement.toFixed(3)})` : "not measured";
  const summary = table([
    ["model", card.model],
    ["architecture", `${a.family}: ${a.layers} layers, hidden ${a.hidden}, ${a.heads} heads (${a.kv_heads} KV), vocab ${a.vocab}`],
    ["source", card.source],
    ["quantization", settings ? `${q.mode} (${settings})` : q.mode],
    ["perplexity", check],
    ["buckets", `batch [${card.buckets.batch_sizes.join(", ")}] × seq [${card.buckets.seq_lens.join(", ")}]`],
    ["KV layout", `${kv.layers} layers × ${kv.kv_heads} KV heads × head_dim ${kv.head_dim}, blocks of ${kv.block_size} tokens, ${kv.dtype}`],
    ["KV capacity", `${kv.blocks.toLocaleString()} blocks = ${kv.tokens.toLocaleString()} tokens = ` +
                    `${kv.sequences.toLocaleString()} sequences at context ${kv.context_len} (${formatBytes(kv.bytes)})`],
    ["max context", String(card.max_model_len)],
    ["engines", card.engines.map(e => `${e.backend}: ${e.file} (${formatBytes(e.bytes)})`).join("; ")],
    ["toolchain", Object.entries(card.versions).map(([k, v]) => `${k} ${v}`).join(", ")],
  ]);
  const passes = table(card.passes.map(p => [p.name, p.nodes_before, p.nodes_after, p.seconds.toFixed(2),
                                             scientific(p.max_abs_error), scientific(p.max_rel_error)]),
                       ["pass", "nodes before", "nodes after", "seconds", "max abs err", "max rel err"]);
  passes.id = "passes";
  $("card").replaceChildren(summary, Object.assign(document.createElement("h3"), { textContent: "Build passes" }), passes);
}

function scientific(x) { return x === null || x === undefined ? "-" : x.toExponential(2); }

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// -- start ------------------------------------------------------------------------------------------------

const TABS = ["playground", "dashboard", "artifact"];
const tabInUrl = () => TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "playground";
window.addEventListener("hashchange", () => showTab(tabInUrl()));
showTab(tabInUrl());
connect();
