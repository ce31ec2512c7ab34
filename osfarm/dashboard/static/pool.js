// The pool page: desktop cards kept current by server-sent events (state every second, a
// thumbnail every few seconds). The server captures thumbnails only while such a page is open.
"use strict";

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function age(s) {
  if (s === null || s === undefined) return "–";
  if (s < 90) return Math.round(s) + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}

document.addEventListener("DOMContentLoaded", () => {
  const pool = document.getElementById("pool");
  const summary = document.getElementById("pool-summary");
  const cards = new Map();

  function card(d) {
    let c = cards.get(d.id);
    if (!c) {
      c = {root: el("article", "desk")};
      c.root.dataset.id = d.id;
      c.link = el("a", "thumb");
      c.link.href = pool.dataset.desktopBase + encodeURIComponent(d.id);
      c.img = el("img");
      c.img.alt = "desktop " + d.id;
      c.img.hidden = true;
      c.placeholder = el("span", "", "no picture yet");
      c.link.append(c.img, c.placeholder);
      c.meta = el("dl", "meta");
      c.root.append(c.link, c.meta);
      cards.set(d.id, c);
      pool.appendChild(c.root);
    }
    const rows = [["desktop", d.id], ["state", d.state], ["provider", d.provider || "–"],
                  ["lease", d.owner ? d.owner : (d.lease ? "yes" : "–")], ["task", d.task_id || "–"],
                  ["age", age(d.age_s)], ["resets", String(d.resets)]];
    if (d.controlled_by) rows.push(["control", d.controlled_by]);
    c.meta.replaceChildren();
    rows.forEach(([k, v]) => {
      const dd = el("dd", k === "state" ? "state " + v : "", v);
      dd.title = v;
      c.meta.append(el("dt", "", k), dd);
    });
    return c;
  }

  function connect() {
    const es = new EventSource(pool.dataset.events);
    es.addEventListener("pool", ev => {
      const p = JSON.parse(ev.data);
      const seen = new Set();
      p.desktops.forEach(d => { card(d); seen.add(d.id); });
      for (const [id, c] of cards) if (!seen.has(id)) { c.root.remove(); cards.delete(id); }
      summary.textContent = p.desktops.length + " desktops · " +
        Object.entries(p.counts).filter(([, n]) => n).map(([k, n]) => n + " " + k).join(", ") +
        (p.waiting ? " · " + p.waiting + " waiting" : "");
    });
    es.addEventListener("thumb", ev => {
      const t = JSON.parse(ev.data);
      const c = cards.get(t.id);
      if (!c) return;
      c.img.src = "data:image/jpeg;base64," + t.jpeg;
      c.img.hidden = false;
      c.placeholder.hidden = true;
      c.root.dataset.thumbs = String((parseInt(c.root.dataset.thumbs || "0", 10)) + 1);
    });
    es.onerror = () => { summary.textContent = "reconnecting…"; };
  }
  connect();
});
