// The dashboard: points from /console/api/stats/stream (the server samples its own metrics once a
// second), drawn as tiles, charts (chart.js) and the live counters in the header.
"use strict";

const HISTORY_S = 300;

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
