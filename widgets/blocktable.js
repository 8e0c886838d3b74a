// Block tables: every frame's tail.tables (kvlab/viz/tables.py writes it) lists live sequences, each with its
// physical block ids in logical order, how many leading blocks were prefix-cache hits and which positions hold a
// copy made on write. kvTableRows draws them as rows of chips, one per logical block in its grid cell's colour: the
// ChatView lists its answers' tables with it, and kvBlockTablePanel (the BlockTableView) puts the pool grid beside
// the rows and an SVG line from every chip to the cell of its physical block: the PagedAttention picture.

const KV_SVG = "http://www.w3.org/2000/svg";
const KV_TABLE_CSS = `
.kv-tables { display: flex; flex-direction: column; gap: 4px; font-size: 14px; }
.kv-table { display: flex; flex-wrap: wrap; gap: 3px; align-items: center; }
.kv-chip { display: inline-block; min-width: 26px; padding: 1px 4px; text-align: center; font-size: 14px;
  font-variant-numeric: tabular-nums; border: 3px solid transparent; border-radius: 3px; box-sizing: border-box; }
.kv-chip.kv-out { background: #fff; border-style: dashed; }
.kv-bt { position: relative; display: flex; gap: 16px 56px; align-items: flex-start; flex-wrap: wrap; }
.kv-bt > .kv-col { flex: 1 1 300px; }
.kv-bt .kv-title, .kv-bt .kv-explain, .kv-bt .kv-tables, .kv-bt .kv-legend { position: relative; z-index: 2; }
.kv-bt .kv-chip { display: inline-flex; flex-direction: column; line-height: 1.2; min-width: 40px; }
.kv-bt .kv-lidx { color: #555; }
.kv-bt .kv-rowlabel { min-width: 6.5em; }
.kv-bt .kv-table.kv-hot .kv-chip { outline: 2px solid #111; }
.kv-bt-lines { position: absolute; left: 0; top: 0; z-index: 1; pointer-events: none; overflow: visible; }
.kv-bt-line { stroke-width: 1.5; opacity: 0.8; }
.kv-bt-lines.kv-hover .kv-bt-line, .kv-bt-lines.kv-hover .kv-bt-end { opacity: 0.12; }
.kv-bt-lines.kv-hover .kv-hot { opacity: 1; stroke-width: 3; }
.kv-bt-mark { fill: none; stroke: #111; stroke-width: 2; }
`;

function kvTableStyle() {
  if (document.getElementById("kv-table-style")) return;
  const s = kvEl("style", null, document.head, KV_TABLE_CSS);
  s.id = "kv-table-style";
}

// The CSS colour of block b's grid cell (its state; ALLOCATED darker with more references).
function kvCellCss(f, b) {
  const c = kvStateColor(f, b); // packed RGBA, red in the low byte
  return `rgb(${c & 255}, ${c >> 8 & 255}, ${c >> 16 & 255})`;
}

// The legend of what the rows draw; `lines` adds the BlockTableView's lines.
function kvTableLegend(parent, lines) {
  const P = KV_PALETTE_DATA;
  return kvLegend(parent, [["HIT", KV_W.HIT, "outline", P.hit], ["SHARED", KV_W.SHARED, "ramp", KV_RGB.ALLOC1,
    KV_RGB.ALLOC8], ["COPIED", KV_W.COPIED, "outline", P.copied], ...(lines ? [["MAP", KV_W.MAP, "line",
    KV_RGB.ALLOC1], ["COPYLINE", KV_W.COPYLINE, "line", P.copied, P.copyDash],
    ["HOST", KV_W.HOST, "outline", KV_RGB.EVICTING]] : [])]);
}

// One logical block: its physical block b (-1: on the host) in the colour of b's cell, "×n" when n references share
// it, outlined when it was a prefix hit or is a copy made on write; `logical` shows its position above.
function kvChip(parent, f, b, pos, hit, copied, logical) {
  const out = b < 0, refs = out ? 0 : f.refcount[b];
  const c = kvEl("span", "kv-chip" + (out ? " kv-out" : ""), parent);
  if (logical) kvEl("span", "kv-lidx", c, String(pos));
  kvEl("span", "kv-pid", c, out ? "主机 host" : String(b) + (refs >= 2 ? ` ×${refs}` : ""));
  if (out) {
    c.style.borderColor = kvCss(KV_RGB.EVICTING);
    c.title = `逻辑块 ${pos} (logical block)：${KV_W.HOST}`;
  } else {
    c.style.background = kvCellCss(f, b);
    c.style.color = f.state[b] === 2 && refs > 2 ? "#fff" : "#111";
    c.title = `逻辑块 ${pos} (logical block) → ${kvInfoText(kvBlockInfo(f, b))}`;
  }
  if (hit) c.style.borderColor = kvCss(KV_PALETTE_DATA.hit);
  if (copied) c.style.borderColor = kvCss(KV_PALETTE_DATA.copied);
  Object.assign(c.dataset, { pos, block: b, refs, hit: hit ? "1" : "0", shared: refs >= 2 ? "1" : "0",
    copied: copied ? "1" : "0" });
  return c;
}

// The rows of frame f's tables in `box` (emptied first): a label, then one chip per logical block; `none` is said
// of a row with no block. Returns the chips ({row, pos, b, copied, el}), for lines to be drawn from them.
function kvTableRows(box, f, logical, none) {
  const t = f.tail.tables || { rows: [], left_out: 0 }, chips = [];
  box.replaceChildren();
  for (const r of t.rows) {
    const row = kvEl("div", "kv-table", box);
    row.dataset.row = r.id;
    kvEl("span", "kv-rowlabel", row, `${r.label}:`);
    if (!r.blocks.length) kvEl("span", "kv-explain", row, none);
    const copied = new Set(r.copied);
    r.blocks.forEach((b, pos) => chips.push({ row: String(r.id), pos, b, copied: copied.has(pos),
      el: kvChip(row, f, b, pos, pos < r.hits, copied.has(pos), logical) }));
    if (r.more) kvEl("span", "kv-explain", row, `另有 ${r.more} 块 (+${r.more} more)`);
  }
  if (t.left_out) kvEl("div", "kv-explain", box, `另有 ${t.left_out} 个序列未显示 (not shown)`);
  return chips;
}

function kvSvgEl(tag, parent, attrs) {
  const e = document.createElementNS(KV_SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  parent.appendChild(e);
  return e;
}

// The BlockTableView's panel: rows of logical blocks (left), the pool grid (right, kvPoolPanel) and the lines. The
// SVG lies under the rows and over the grid, so a line leaves its chip from under the row and ends on its cell.
function kvBlockTablePanel(parent, model) {
  kvTableStyle();
  const box = kvEl("div", "kv-bt", parent);
  const left = kvEl("div", "kv-col", box), right = kvEl("div", "kv-col", box);
  kvEl("div", "kv-title", left, "块表 (block tables)：逻辑块 → 物理块");
  kvEl("div", "kv-explain", left, "每个序列一行。第 i 格是它的逻辑块 i（它的第 i·B 到 i·B+B−1 个 token），" +
    "格里写着存这些 token 的物理块，连线终点就是它；×n：n 个引用共享它。鼠标移到一行上可以突出它的块。");
  const rows = kvEl("div", "kv-tables", left);
  kvTableLegend(left, true);
  const pool = kvPoolPanel(right, model, 480);
  const svg = kvSvgEl("svg", box, { class: "kv-bt-lines" });
  let chips = [], shown = null, hot = null;

  function cellAt(b, at) { // block b's cell in the panel's coordinates (the canvas may be drawn scaled)
    const g = pool.layout(), c = pool.canvas.getBoundingClientRect();
    const sx = c.width / pool.canvas.width, sy = c.height / pool.canvas.height;
    return { x: c.left - at.left + (b % g.cols) * g.cell * sx, y: c.top - at.top + Math.floor(b / g.cols) * g.cell * sy,
      w: g.cell * sx, h: g.cell * sy };
  }
  function lines() {
    const at = box.getBoundingClientRect();
    svg.setAttribute("width", Math.ceil(at.width));
    svg.setAttribute("height", Math.ceil(at.height));
    svg.replaceChildren();
    if (!shown || !pool.layout()) return;
    for (const ch of chips) {
      ch.line = ch.end = null;
      if (ch.b < 0) continue; // on the host: no block of the pool holds it
      const r = ch.el.getBoundingClientRect(), cell = cellAt(ch.b, at);
      const colour = ch.copied ? kvCss(KV_PALETTE_DATA.copied) : kvCellCss(shown, ch.b);
      const x2 = cell.x + cell.w / 2, y2 = cell.y + cell.h / 2;
      const attrs = { x1: r.left - at.left + r.width / 2, y1: r.top - at.top + r.height / 2, x2, y2, stroke: colour,
        class: "kv-bt-line" + (ch.copied ? " kv-copy" : ""), "data-row": ch.row, "data-pos": ch.pos, "data-block": ch.b };
      if (ch.copied) attrs["stroke-dasharray"] = KV_PALETTE_DATA.copyDash.join(" ");
      ch.line = kvSvgEl("line", svg, attrs);
      ch.end = kvSvgEl("circle", svg, { cx: x2, cy: y2, r: 3, fill: colour, class: "kv-bt-end", "data-row": ch.row });
    }
    mark();
  }
  function mark() { // the hovered row: its chips outlined, its lines on top, its cells framed
    svg.classList.toggle("kv-hover", hot !== null);
    for (const e of svg.querySelectorAll(".kv-hot")) e.classList.remove("kv-hot");
    for (const e of svg.querySelectorAll(".kv-bt-mark")) e.remove();
    for (const row of rows.querySelectorAll(".kv-table")) row.classList.toggle("kv-hot", row.dataset.row === hot);
    if (hot === null || !shown) return;
    const at = box.getBoundingClientRect(), framed = new Set();
    for (const ch of chips) {
      if (ch.row !== hot || !ch.line) continue;
      ch.line.classList.add("kv-hot");
      ch.end.classList.add("kv-hot");
      if (framed.has(ch.b)) continue;
      framed.add(ch.b);
      const c = cellAt(ch.b, at);
      kvSvgEl("rect", svg, { x: c.x, y: c.y, width: c.w, height: c.h, class: "kv-bt-mark", "data-block": ch.b });
    }
  }
  rows.addEventListener("mouseover", (e) => {
    const row = e.target.closest(".kv-table"), id = row ? row.dataset.row : null;
    if (id !== hot) { hot = id; mark(); }
  });
  rows.addEventListener("mouseleave", () => { hot = null; mark(); });
  const resized = new ResizeObserver(() => lines()); // on the page late, or the cell narrowed: the chips moved
  resized.observe(box);

  function draw(hist, i) {
    pool.draw(hist, i);
    shown = hist[i];
    const t = shown.tail.tables;
    chips = kvTableRows(rows, shown, true, "还没有块 (no blocks yet)");
    if (!t || !t.rows.length) {
      kvEl("div", "kv-explain", rows, t ? "这幅画面里没有活着的序列 (no live sequence)" : "这幅画面不带块表 (no block tables)");
    }
    box.dataset.rows = t ? t.rows.length : 0;
    lines();
  }
  return { draw, inspect: pool.inspect, canvas: pool.canvas, layout: pool.layout, destroy: () => resized.disconnect() };
}
