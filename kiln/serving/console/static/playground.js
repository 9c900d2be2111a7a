// The playground: chat over /v1/chat/completions, streamed, with the sampling controls; Stop
// aborts the request; under each reply its token counts, TTFT and decode tokens/s.
"use strict";

const chat = { messages: [], busy: false, controller: null };

function samplingParams() {
  const number = id => $(id).value === "" ? null : Number($(id).value);
  const params = { temperature: number("temperature"), top_p: number("top-p"), top_k: number("top-k"),
                   repetition_penalty: number("repetition-penalty"), max_tokens: number("max-tokens"),
                   seed: number("seed"), ignore_eos: $("ignore-eos").checked };
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
