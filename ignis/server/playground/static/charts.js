// Two small SVG charts (a time series and a bar per item), drawn at the element's own size with the theme's colours.

const NS = "http://www.w3.org/2000/svg";
const PAD = { left: 36, right: 8, top: 8, bottom: 20 };

function el(name, attrs, parent) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function size(svg) {
  const box = svg.getBoundingClientRect();
  const w = Math.max(120, Math.round(box.width));
  const h = Math.max(80, Math.round(box.height));
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  return { w, h };
}

// The top of an axis with four equal steps of 1, 2 or 5 times a power of ten.
function niceMax(x) {
  if (!(x > 0)) return 4;
  const step = x / 4;
  const p = 10 ** Math.floor(Math.log10(step));
  for (const m of [1, 2, 5, 10]) if (step <= m * p) return 4 * m * p;
  return 40 * p;
}

function label(value) {
  if (value >= 1000) return `${(value / 1000).toFixed(value >= 10000 ? 0 : 1)}k`;
  return Number.isInteger(value) ? String(value) : value.toFixed(1);
}

// series: [{values: [number|null, ...], color, name}]; `slots` x positions, newest at the right; `seconds` per slot.
export function lineChart(svg, series, { slots, seconds = 1, min = 0, max = null, floor = 4, unit = "" } = {}) {
  const { w, h } = size(svg);
  const plotW = w - PAD.left - PAD.right;
  const plotH = h - PAD.top - PAD.bottom;
  const seen = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
  const top = max ?? niceMax(Math.max(...seen, floor / 1.1) * 1.1);
  const y = (v) => PAD.top + plotH - ((v - min) / (top - min || 1)) * plotH;
  const x = (i) => PAD.left + (i / (slots - 1)) * plotW;
  for (let k = 0; k <= 4; k++) {
    const v = min + ((top - min) * k) / 4;
    el("line", { x1: PAD.left, x2: w - PAD.right, y1: y(v), y2: y(v), class: "gridline" }, svg);
    el("text", { x: PAD.left - 6, y: y(v) + 4, "text-anchor": "end" }, svg).textContent = label(v) + (k === 4 ? unit : "");
  }
  const span = Math.round(((slots - 1) * seconds) / 60);
  el("text", { x: PAD.left, y: h - 4 }, svg).textContent = `${span} min ago`;
  el("text", { x: w - PAD.right, y: h - 4, "text-anchor": "end" }, svg).textContent = "now";
  for (const s of series) {
    const offset = slots - s.values.length;
    let path = "";
    let area = "";
    let run = [];
    const flush = () => {
      if (!run.length) return;
      path += run.map(([px, py], j) => `${j ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`).join("");
      if (s.fill) {
        area += `M${run[0][0].toFixed(1)},${y(min)}` + run.map(([px, py]) => `L${px.toFixed(1)},${py.toFixed(1)}`).join("")
          + `L${run[run.length - 1][0].toFixed(1)},${y(min)}Z`;
      }
      run = [];
    };
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) flush();
      else run.push([x(offset + i), y(Math.min(v, top))]);
    });
    flush();
    if (area) el("path", { d: area, class: "area", fill: s.color }, svg);
    if (path) el("path", { d: path, class: "line", stroke: s.color }, svg);
  }
  if (!seen.length) {
    el("text", { x: PAD.left + plotW / 2, y: PAD.top + plotH / 2, "text-anchor": "middle", class: "nodata" }, svg)
      .textContent = "waiting for data";
  }
}

// bars: [{label, value (0..1), title}]; null value = nothing measured there yet.
export function barChart(svg, bars, { empty = "no data yet", color }) {
  const { w, h } = size(svg);
  const plotW = w - PAD.left - PAD.right;
  const plotH = h - PAD.top - PAD.bottom - 14;
  const top = PAD.top + 14;
  const y = (v) => top + plotH - v * plotH;
  for (let k = 0; k <= 4; k++) {
    el("line", { x1: PAD.left, x2: w - PAD.right, y1: y(k / 4), y2: y(k / 4), class: "gridline" }, svg);
    el("text", { x: PAD.left - 6, y: y(k / 4) + 4, "text-anchor": "end" }, svg).textContent = `${k * 25}%`;
  }
  const slot = plotW / Math.max(bars.length, 1);
  const width = Math.min(56, slot * 0.62);
  bars.forEach((b, i) => {
    const cx = PAD.left + slot * (i + 0.5);
    el("text", { x: cx, y: h - 4, "text-anchor": "middle" }, svg).textContent = b.label;
    el("rect", { x: cx - width / 2, y: top, width, height: plotH, rx: 6, class: "bar-bg" }, svg);
    if (b.value === null) return;
    const bar = el("rect", {
      x: cx - width / 2, y: y(b.value), width, height: Math.max(0, y(0) - y(b.value)), rx: 6, class: "bar", fill: color,
      "data-position": b.label, "data-rate": b.value.toFixed(4),
    }, svg);
    el("title", {}, bar).textContent = b.title;
    el("text", { x: cx, y: y(b.value) - 5, "text-anchor": "middle", class: "barlabel" }, svg)
      .textContent = `${Math.round(b.value * 100)}%`;
  });
  if (!bars.length || bars.every((b) => b.value === null)) {
    el("text", { x: PAD.left + plotW / 2, y: top + plotH / 2, "text-anchor": "middle", class: "nodata" }, svg).textContent = empty;
  }
}
