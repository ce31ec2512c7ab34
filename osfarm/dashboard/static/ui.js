// osfarm dashboard: sortable tables, the task filter, the a11y tree shown in place.
// Plain DOM, no library; every text goes in through textContent, never innerHTML.
"use strict";

function cellValue(td, numeric) {
  const v = td.dataset.v !== undefined ? td.dataset.v : td.textContent.trim();
  if (!numeric) return v.toLowerCase();
  const n = parseFloat(v);
  return Number.isNaN(n) ? -Infinity : n;
}

function makeSortable(table) {
  const heads = Array.from(table.tHead ? table.tHead.rows[0].cells : []);
  heads.forEach((th, col) => {
    th.tabIndex = 0;
    const sort = () => {
      const numeric = th.dataset.sort === "num";
      const current = th.getAttribute("aria-sort");
      const dir = current === "descending" ? "ascending" : (current === "ascending" ? "descending"
                  : (numeric ? "descending" : "ascending"));
      heads.forEach(h => h.removeAttribute("aria-sort"));
      th.setAttribute("aria-sort", dir);
      const body = table.tBodies[0];
      const rows = Array.from(body.rows);
      rows.sort((a, b) => {
        const x = cellValue(a.cells[col], numeric), y = cellValue(b.cells[col], numeric);
        const c = x < y ? -1 : (x > y ? 1 : 0);
        return dir === "ascending" ? c : -c;
      });
      rows.forEach(r => body.appendChild(r));
    };
    th.addEventListener("click", sort);
    th.addEventListener("keydown", e => { if (e.key === "Enter") sort(); });
  });
}

function makeFilter(box) {
  const table = document.getElementById(box.dataset.filterTable);
  if (!table) return;
  const text = box.querySelector("[data-filter-text]");
  const status = box.querySelector("[data-filter-status]");
  const count = box.querySelector("[data-filter-count]");
  const apply = () => {
    const q = (text.value || "").toLowerCase();
    const s = status.value;
    let shown = 0;
    Array.from(table.tBodies[0].rows).forEach(r => {
      const ok = (!q || r.textContent.toLowerCase().includes(q)) && (!s || r.dataset.status === s);
      r.hidden = !ok;
      if (ok) shown++;
    });
    count.textContent = shown + " of " + table.tBodies[0].rows.length;
  };
  text.addEventListener("input", apply);
  status.addEventListener("change", apply);
  apply();
}

function inlineA11y(link) {
  link.addEventListener("click", async e => {
    const pre = document.getElementById(link.dataset.target);
    if (!pre) return;
    e.preventDefault();
    if (!pre.hidden) { pre.hidden = true; return; }
    if (!pre.dataset.loaded) {
      try {
        const r = await fetch(link.href, {credentials: "same-origin"});
        if (!r.ok) throw new Error(r.status + " " + r.statusText);
        pre.textContent = await r.text();
        pre.dataset.loaded = "1";
      } catch (err) {
        window.location = link.href;  // a static copy opened from disk: open the file instead
        return;
      }
    }
    pre.hidden = false;
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("table.sortable").forEach(makeSortable);
  document.querySelectorAll("[data-filter-table]").forEach(makeFilter);
  document.querySelectorAll("a.a11y-link").forEach(inlineA11y);
});
