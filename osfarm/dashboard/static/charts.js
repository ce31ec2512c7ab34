// Training curves: one small SVG line chart per metric, from the JSON the page embeds.
// Hover shows the nearest point of each line; a legend entry hides or shows its line.
"use strict";

const NS = "http://www.w3.org/2000/svg";
const W = 420, H = 220, PAD = {l: 46, r: 10, t: 8, b: 26};

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(v) {
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 0.001 || a >= 1e5)) return v.toExponential(2);
  return String(Math.round(v * 1000) / 1000);
}

function ticks(lo, hi, n) {
  if (lo === hi) { lo -= 1; hi += 1; }
  const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
  const err = (hi - lo) / n / step;
  const s = step * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
  const out = [];
  for (let v = Math.ceil(lo / s) * s; v <= hi + s * 1e-9; v += s) out.push(v);
  return out;
}

function chart(spec) {
  const box = document.createElement("div");
  box.className = "chart";
  box.dataset.metric = spec.key;
  const title = document.createElement("h3");
  title.textContent = spec.title;
  const legend = document.createElement("div");
  legend.className = "legend";
  const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": spec.title});
  const tip = document.createElement("div");
  tip.className = "tip";
  tip.hidden = true;
  box.append(title, svg, legend, tip);

  const hidden = new Set();
  function draw() {
    svg.replaceChildren();
    const lines = spec.lines.filter(l => !hidden.has(l.name) && l.points.length);
    const all = lines.flatMap(l => l.points);
    if (!all.length) { svg.append(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "tick"}, "no data")); return; }
    let x0 = Math.min(...all.map(p => p[0])), x1 = Math.max(...all.map(p => p[0]));
    let y0 = Math.min(...all.map(p => p[1])), y1 = Math.max(...all.map(p => p[1]));
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const sx = x => PAD.l + (x - x0) / (x1 - x0) * (W - PAD.l - PAD.r);
    const sy = y => H - PAD.b - (y - y0) / (y1 - y0) * (H - PAD.t - PAD.b);
    for (const t of ticks(y0, y1, 4)) {
      svg.append(svgEl("line", {class: "grid", x1: PAD.l, x2: W - PAD.r, y1: sy(t), y2: sy(t)}));
      svg.append(svgEl("text", {class: "tick", x: PAD.l - 4, y: sy(t) + 3, "text-anchor": "end"}, fmt(t)));
    }
    for (const t of ticks(x0, x1, 6)) {
      svg.append(svgEl("text", {class: "tick", x: sx(t), y: H - PAD.b + 14, "text-anchor": "middle"}, fmt(t)));
    }
    svg.append(svgEl("line", {class: "axis", x1: PAD.l, x2: PAD.l, y1: PAD.t, y2: H - PAD.b}));
    svg.append(svgEl("line", {class: "axis", x1: PAD.l, x2: W - PAD.r, y1: H - PAD.b, y2: H - PAD.b}));
    svg.append(svgEl("text", {class: "tick", x: W - PAD.r, y: H - 2, "text-anchor": "end"}, spec.x_label || "policy version"));
    spec.lines.forEach((l, i) => {
      if (hidden.has(l.name) || !l.points.length) return;
      const d = l.points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join("");
      svg.append(svgEl("path", {class: `line s${i % 3}`, d}));
      if (l.points.length < 60) l.points.forEach(p => svg.append(svgEl("circle", {class: `pt${i % 3}`, cx: sx(p[0]), cy: sy(p[1]), r: 2.5})));
    });
    const hover = svgEl("line", {class: "hover", y1: PAD.t, y2: H - PAD.b, visibility: "hidden"});
    svg.append(hover);
    svg.onmousemove = ev => {
      const r = svg.getBoundingClientRect();
      const x = x0 + ((ev.clientX - r.left) / r.width * W - PAD.l) / (W - PAD.l - PAD.r) * (x1 - x0);
      const parts = [];
      let at = null;
      lines.forEach(l => {
        let best = l.points[0];
        for (const p of l.points) if (Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
        at = at === null ? best[0] : at;
        parts.push(l.name + " " + fmt(best[1]) + " @ " + fmt(best[0]));
      });
      hover.setAttribute("x1", sx(at)); hover.setAttribute("x2", sx(at)); hover.setAttribute("visibility", "visible");
      tip.textContent = parts.join(" · ");
      tip.hidden = false;
      tip.style.left = Math.min(ev.clientX - box.getBoundingClientRect().left + 8, box.clientWidth - tip.offsetWidth - 4) + "px";
      tip.style.top = (ev.clientY - box.getBoundingClientRect().top - 28) + "px";
    };
    svg.onmouseleave = () => { tip.hidden = true; hover.setAttribute("visibility", "hidden"); };
  }
  spec.lines.forEach((l, i) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = `s${i % 3}`;
    b.textContent = "● " + l.name;
    b.onclick = () => { if (hidden.has(l.name)) hidden.delete(l.name); else hidden.add(l.name); b.classList.toggle("off"); draw(); };
    legend.append(b);
  });
  draw();
  return box;
}

document.addEventListener("DOMContentLoaded", () => {
  const host = document.getElementById("charts");
  if (!host) return;
  const data = JSON.parse(document.getElementById(host.dataset.source).textContent);
  data.charts.forEach(spec => host.append(chart(spec)));
});
