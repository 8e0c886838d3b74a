// PoolView panel: one cell per base block. Colour = state (cached blocks bluish green, ALLOCATED darker with more
// references), refcount printed in large cells, size classes outlined, fresh changes flashing; hover for details.

const KV_MIN_TEXT_PX = 14; // numbers in cells are drawn only when they stay readable on a projector

function kvPoolPanel(parent, model, maxWidth = 768) {
  const box = kvEl("div", "kv-pool", parent);
  const canvas = kvEl("canvas", "kv-grid", box), ctx = canvas.getContext("2d", { willReadFrequently: true });
  const tip = kvEl("div", "kv-tip", box);
  kvLegend(box, [...kvStateEntries(), ...kvFlashEntries(), ["OUTLINE", KV_W.OUTLINE, "outline", KV_PALETTE_DATA.outline]]);
  let g = null, shown = null, hover = -1, asked = -1;

  function draw(hist, i) {
    const f = hist[i];
    if (!g || g.n !== f.num_blocks) {
      g = kvLayout(f.num_blocks, kvRoom(box, maxWidth));
      canvas.width = g.w; canvas.height = g.h;
    }
    kvPaint(ctx, g, kvColors(hist, i, kvStateColor));
    const font = Math.floor(g.cell * 0.5);
    if (font >= KV_MIN_TEXT_PX) { // refcounts as numbers when they are readable
      ctx.font = `${font}px sans-serif`; ctx.textAlign = "center"; ctx.textBaseline = "middle";
      for (let b = 0; b < f.num_blocks; b++) if (f.state[b] === 2 || f.state[b] === 4) {
        ctx.fillStyle = f.state[b] === 2 && f.refcount[b] > 2 ? "#fff" : "#111";
        ctx.fillText(String(f.refcount[b]), (b % g.cols + 0.5) * g.cell, (Math.floor(b / g.cols) + 0.55) * g.cell);
      }
    }
    ctx.strokeStyle = kvCss(KV_PALETTE_DATA.outline); ctx.lineWidth = 1; // size classes > 0: outline each span
    for (let b = 0; b < f.num_blocks; b++) {
      const k = f.meta[b] >> KV_FRAME.flashBits;
      if (k && b % (1 << k) === 0) {
        const span = Math.min(1 << k, g.cols), rowsSpan = Math.ceil((1 << k) / g.cols);
        ctx.strokeRect((b % g.cols) * g.cell + 0.5, Math.floor(b / g.cols) * g.cell + 0.5,
          span * g.cell - 1, rowsSpan * g.cell - 1);
      }
    }
    shown = f;
    box.dataset.n = f.num_blocks;
    if (hover >= 0) tipFor(hover);
  }

  function tipFor(b) {
    if (!shown || b < 0 || b >= shown.num_blocks) { tip.style.display = "none"; return; }
    const info = kvBlockInfo(shown, b);
    tip.textContent = kvInfoText(info);
    tip.style.display = "block";
    if (info.tokens === undefined && asked !== b) { asked = b; model.send({ type: "inspect", block: b }); }
  }
  canvas.addEventListener("mousemove", (e) => {
    if (!g) return;
    const r = canvas.getBoundingClientRect();
    const col = Math.floor((e.clientX - r.left) * (canvas.width / r.width) / g.cell);
    const row = Math.floor((e.clientY - r.top) * (canvas.height / r.height) / g.cell);
    const b = col < g.cols ? row * g.cols + col : -1;
    if (b !== hover) { hover = b; tipFor(b); }
  });
  canvas.addEventListener("mouseleave", () => { hover = -1; tip.style.display = "none"; });

  // Large pools carry no per-block details in frames: the kernel answers with the live block's fields.
  function inspect(msg) {
    if (msg.block === hover && shown) {
      tip.textContent = kvInfoText(kvBlockInfo(shown, hover)) +
        ` · 现在 (now)：装着 ${msg.tokens} 个 token，序列 ${msg.owner}，上次使用于池时钟 ${msg.last_access}`;
    }
  }
  return { draw, inspect, canvas, layout: () => g };
}
