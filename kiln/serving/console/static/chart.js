// A small SVG line chart for the dashboard: a fixed time axis (the last few minutes), a y axis from
// zero to a rounded maximum, one path per series (gaps where a value is null) and an HTML legend
// with each series' latest value. Each path carries data-series, data-max and data-last, so what a
// chart shows can be read back from the page.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = { width: 480, height: 130, left: 46, right: 8, top: 8, bottom: 20 };

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function svgElement(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// spec: {times: [unix s], span: seconds shown, format: v => text, yTop: optional fixed top of the axis
//        (a pool's size, 100 %), series: [{name, color, values: [number|null]}]}
function drawChart(svg, legend, spec) {
  const c = CHART, w = c.width - c.left - c.right, h = c.height - c.top - c.bottom;
  svg.setAttribute("viewBox", `0 0 ${c.width} ${c.height}`);
  svg.replaceChildren();
  const finite = spec.series.flatMap(s => s.values.filter(v => v !== null && isFinite(v)));
  const top = spec.yTop || niceMax(Math.max(...finite, 0));
  const end = spec.times.length ? spec.times[spec.times.length - 1] : 0, start = end - spec.span;
  const x = t => c.left + w * (t - start) / spec.span, y = v => c.top + h * (1 - v / top);
  for (const frac of [0, 0.5, 1]) {
    svg.append(svgElement("line", { x1: c.left, x2: c.left + w, y1: y(top * frac), y2: y(top * frac), class: "grid" }));
    svg.append(svgElement("text", { x: c.left - 4, y: y(top * frac) + 4, class: "axis", "text-anchor": "end" },
                          spec.format(top * frac)));
  }
  for (const [label, t] of [[`-${Math.round(spec.span / 60)} min`, start], ["now", end]]) {
    svg.append(svgElement("text", { x: x(t), y: c.height - 4, class: "axis",
                                   "text-anchor": t === start ? "start" : "end" }, label));
  }
  legend.replaceChildren();
  for (const s of spec.series) {
    svg.append(seriesPath(s, spec.times, x, y, start));
    legend.append(legendItem(s, spec.format));
  }
}

function seriesPath(s, times, x, y, start) {
  let d = "", pen = "M", max = 0, last = null;
  s.values.forEach((v, i) => {
    if (v === null || !isFinite(v) || times[i] < start) { pen = "M"; return; }
    d += `${pen}${x(times[i]).toFixed(1)},${y(v).toFixed(1)} `;
    pen = "L";
    max = Math.max(max, v);
    last = v;
  });
  return svgElement("path", { d, stroke: s.color, class: "series", "data-series": s.name,
                              "data-max": max, "data-last": last === null ? "" : last });
}

function legendItem(s, format) {
  const item = document.createElement("span");
  const latest = [...s.values].reverse().find(v => v !== null && isFinite(v));
  item.innerHTML = `<i style="background:${s.color}"></i>`;
  item.append(`${s.name} `, Object.assign(document.createElement("b"),
                                          { textContent: latest === undefined ? "–" : format(latest) }));
  return item;
}
