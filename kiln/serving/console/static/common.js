// The console's shared pieces: element lookup, the API key, requests with it, server-sent events
// read from a fetch, and number formats. Loaded first; the other scripts use these.
"use strict";

const $ = id => document.getElementById(id);
const KEY_STORAGE = "kiln.apiKey";

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

// -- number formats ----------------------------------------------------------------------

function formatSeconds(s) {
  return s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms` : `${s.toFixed(2)} s`;
}

function formatCount(v) {
  return v >= 1000 ? `${(v / 1000).toFixed(1)}k` : String(Math.round(v * 10) / 10);
}

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
