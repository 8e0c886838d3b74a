// FragmentationView panel: the arena as a memory map (the pool's state colours, the largest free run in yellow),
// gauges for blocks held / unusable free memory / internal waste / external fragmentation, their time series,
// and the moves of a compaction drawn as arrows from old to new block, animated when they arrive live.

const KV_GAUGES = KV_PALETTE_DATA.gauges; // [label, frame field, colour, dash]
const KV_SERIES_LEN = 300; // pictures in the time series

// Start and length of the longest run of FREE blocks.
function kvLargestRun(f) {
  let best = 0, bestAt = -1, run = 0;
  for (let b = 0; b <= f.num_blocks; b++) {
    if (b < f.num_blocks && f.state[b] === 0) run++;
    else { if (run > best) { best = run; bestAt = b - run; } run = 0; }
  }
  return [bestAt, best];
}

// The share of blocks that are cached (no reference, reusable): counted from the state bytes.
function kvCachedShare(f) {
  const cached = KV_STATES.indexOf("CACHED");
  let n = 0;
  for (let b = 0; b < f.num_blocks; b++) n += f.state[b] === cached;
  return f.num_blocks ? n / f.num_blocks : 0;
}

function kvFragPanel(parent, model, maxWidth = 768) {
  const box = kvEl("div", "kv-frag", parent);
  const caption = kvEl("div", "kv-title", box, "内存布局 (memory map)");
  const map = kvEl("canvas", "kv-map", box), mctx = map.getContext("2d", { willReadFrequently: true });
  kvLegend(box, [...kvStateEntries().slice(0, 1), ["RUN", KV_W.RUN, "swatch", KV_PALETTE_DATA.run],
    ...kvStateEntries().slice(1), ...kvFlashEntries(), ["MOVE", KV_W.MOVE, "arrow", KV_PALETTE_DATA.move]]);
  const gauges = kvEl("div", "kv-gauges", box), rows = {};
  // The bars: the gauges, with the cached share right under blocks held (which counts cached blocks too).
  for (const [name, key, rgb] of [KV_GAUGES[0], KV_PALETTE_DATA.cachedGauge, ...KV_GAUGES.slice(1)]) {
    const row = kvEl("div", "kv-gauge", gauges);
    row.dataset.key = key;
    kvEl("span", "kv-gauge-name", row, name).title = KV_PALETTE_DATA.gaugeWords[key];
    const track = kvEl("span", "kv-track", row), fill = kvEl("span", "kv-fill", track);
    track.style.background = kvCss(KV_PALETTE_DATA.track); fill.style.background = kvCss(rgb);
    rows[key] = [fill, kvEl("span", "kv-gauge-value", row)];
  }
  kvEl("div", "kv-caption", box, `四个仪表在最近 ${KV_SERIES_LEN} 幅画面里的变化（0 到 100%）(the four gauges)`);
  const series = kvEl("canvas", "kv-series", box), sctx = series.getContext("2d", { willReadFrequently: true });
  kvLegend(box, KV_GAUGES.map(([name, key, rgb, dash]) => [`LINE_${key}`, name, "line", rgb, dash]));
  let g = null, anim = 0;

  function drawMap(hist, i, t) {
    const f = hist[i], [at, len] = kvLargestRun(f), run = kvPack(KV_PALETTE_DATA.run);
    kvPaint(mctx, g, kvColors(hist, i, (fr, b) => fr.state[b] === 0 && b >= at && b < at + len ? run : kvStateColor(fr, b)));
    const centre = (b) => [(b % g.cols + 0.5) * g.cell, (Math.floor(b / g.cols) + 0.5) * g.cell];
    const move = KV_PALETTE_DATA.move;
    for (let age = kvSettled(hist, i) ? -1 : Math.min(3, i); age >= 0; age--) {
      const moves = hist[i - age].tail.moves || [];
      mctx.strokeStyle = `rgba(${move[0]},${move[1]},${move[2]},${KV_FLASH_WEIGHT[age]})`; mctx.fillStyle = kvCss(move);
      mctx.lineWidth = Math.max(1, g.cell / 6);
      for (const [s, d] of moves) {
        const [x0, y0] = centre(s), [x1, y1] = centre(d);
        mctx.beginPath(); mctx.moveTo(x0, y0); mctx.lineTo(x1, y1); mctx.stroke();
        if (age === 0 && t < 1) { // the data travelling from the old block to the new one
          mctx.beginPath(); mctx.arc(x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, Math.max(2, g.cell / 3), 0, 7); mctx.fill();
        }
      }
    }
  }

  function draw(hist, i) {
    const f = hist[i];
    if (!g || g.n !== f.num_blocks) {
      g = kvLayout(f.num_blocks, kvRoom(box, maxWidth)); map.width = g.w; map.height = g.h;
      series.width = Math.max(200, Math.min(g.w, 480)); series.height = 120;
    }
    cancelAnimationFrame(anim);
    drawMap(hist, i, 1);
    if ((f.tail.moves || []).length && i === hist.length - 1) { // animate fresh moves for 400 ms
      const t0 = performance.now();
      const tick = (now) => { const t = (now - t0) / 400; drawMap(hist, i, t); if (t < 1) anim = requestAnimationFrame(tick); };
      anim = requestAnimationFrame(tick);
    }
    const [, len] = kvLargestRun(f);
    caption.textContent = `内存布局 (memory map) · 最长空闲段 (largest free run) ${len} 块`;
    const shares = { cached: kvCachedShare(f) };
    for (const key of Object.keys(rows)) {
      const v = Math.max(0, Math.min(1, shares[key] ?? f[key])), [fill, value] = rows[key];
      fill.style.width = `${100 * v}%`; value.textContent = `${(100 * v).toFixed(1)}%`;
    }
    sctx.fillStyle = "#fff"; sctx.fillRect(0, 0, series.width, series.height);
    sctx.strokeStyle = "#ccc"; sctx.setLineDash([]); sctx.lineWidth = 1; sctx.strokeRect(0.5, 0.5, series.width - 1, series.height - 1);
    const from = Math.max(0, i - KV_SERIES_LEN + 1), W = series.width - 2, H = series.height - 4;
    for (const [, key, rgb, dash] of KV_GAUGES) {
      sctx.strokeStyle = kvCss(rgb); sctx.lineWidth = 2; sctx.setLineDash(dash); sctx.beginPath();
      for (let j = from; j <= i; j++) {
        const x = 1 + (i === from ? W : (j - from) * W / (i - from)), y = 2 + H * (1 - hist[j][key]);
        j === from ? sctx.moveTo(x, y) : sctx.lineTo(x, y);
      }
      sctx.stroke();
    }
    sctx.setLineDash([]);
    box.dataset.largestRun = len;
  }
  return { draw, canvas: map, gauges, series, layout: () => g, destroy: () => cancelAnimationFrame(anim) };
}
