// FragmentationView panel: the arena as a memory map (used dark, free light, the largest free run bright green),
// gauges for utilisation / external fragmentation / internal waste / free-space scatter, their time series,
// and the moves of a compaction drawn as arrows from old to new block, animated when they arrive live.

const KV_MAP = { USED: [90, 90, 90], CACHED: [150, 150, 150], FREE: [200, 228, 200], RUN: [56, 160, 60] };
const KV_GAUGES = [["utilisation", "utilisation", [74, 134, 200]], ["external fragmentation", "external", [230, 140, 40]],
  ["internal waste", "waste", [150, 90, 200]], ["free-space scatter", "scatter", [60, 170, 170]]];
const KV_GAUGE_ROW = 20, KV_GAUGE_LABEL = 160;

// Start and length of the longest run of FREE blocks.
function kvLargestRun(f) {
  let best = 0, bestAt = -1, run = 0;
  for (let b = 0; b <= f.n; b++) {
    if (b < f.n && f.state[b] === 0) run++;
    else { if (run > best) { best = run; bestAt = b - run; } run = 0; }
  }
  return [bestAt, best];
}

function kvFragPanel(parent, model, maxWidth = 768) {
  const box = kvEl("div", "kv-frag", parent);
  const map = kvEl("canvas", "kv-map", box), mctx = map.getContext("2d", { willReadFrequently: true });
  const gauges = kvEl("canvas", "kv-gauges", box), gctx = gauges.getContext("2d", { willReadFrequently: true });
  const series = kvEl("canvas", "kv-series", box), sctx = series.getContext("2d", { willReadFrequently: true });
  gauges.width = series.width = Math.min(maxWidth, 480);
  gauges.height = KV_GAUGE_ROW * KV_GAUGES.length + 4; series.height = 110;
  let g = null, anim = 0;

  function drawMap(hist, i, t) {
    const f = hist[i], [at, len] = kvLargestRun(f);
    const free = kvPack(KV_MAP.FREE), run = kvPack(KV_MAP.RUN), used = kvPack(KV_MAP.USED), cached = kvPack(KV_MAP.CACHED);
    kvPaint(mctx, g, kvColors(hist, i, (fr, b) => fr.state[b] === 0 ? (b >= at && b < at + len ? run : free)
      : fr.state[b] === 4 ? cached : used));
    const centre = (b) => [(b % g.cols + 0.5) * g.cell, (Math.floor(b / g.cols) + 0.5) * g.cell];
    for (let age = Math.min(3, i); age >= 0; age--) {
      const moves = hist[i - age].tail.moves || [];
      mctx.strokeStyle = `rgba(0,150,190,${KV_FLASH_WEIGHT[age]})`; mctx.fillStyle = "rgb(0,150,190)";
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
    if (!g || g.n !== f.n) { g = kvLayout(f.n, maxWidth); map.width = g.w; map.height = g.h; }
    cancelAnimationFrame(anim);
    drawMap(hist, i, 1);
    if ((f.tail.moves || []).length && i === hist.length - 1) { // animate fresh moves for 400 ms
      const t0 = performance.now();
      const tick = (now) => { const t = (now - t0) / 400; drawMap(hist, i, t); if (t < 1) anim = requestAnimationFrame(tick); };
      anim = requestAnimationFrame(tick);
    }
    gctx.fillStyle = "#fff"; gctx.fillRect(0, 0, gauges.width, gauges.height);
    gctx.font = "12px sans-serif"; gctx.textBaseline = "middle";
    const room = gauges.width - KV_GAUGE_LABEL - 50;
    KV_GAUGES.forEach(([name, key, rgb], r) => {
      const y = 2 + r * KV_GAUGE_ROW, v = Math.max(0, Math.min(1, f[key]));
      gctx.fillStyle = "#111"; gctx.fillText(name, 4, y + KV_GAUGE_ROW / 2);
      gctx.fillStyle = "#eee"; gctx.fillRect(KV_GAUGE_LABEL, y + 3, room, KV_GAUGE_ROW - 6);
      gctx.fillStyle = `rgb(${rgb})`; gctx.fillRect(KV_GAUGE_LABEL, y + 3, Math.round(room * v), KV_GAUGE_ROW - 6);
      gctx.fillStyle = "#111"; gctx.fillText(`${(100 * v).toFixed(1)}%`, KV_GAUGE_LABEL + room + 6, y + KV_GAUGE_ROW / 2);
    });
    sctx.fillStyle = "#fff"; sctx.fillRect(0, 0, series.width, series.height);
    sctx.strokeStyle = "#ccc"; sctx.strokeRect(0.5, 0.5, series.width - 1, series.height - 1);
    const from = Math.max(0, i - 299), W = series.width - 2, H = series.height - 4;
    for (const [, key, rgb] of KV_GAUGES) {
      sctx.strokeStyle = `rgb(${rgb})`; sctx.lineWidth = 1.5; sctx.beginPath();
      for (let j = from; j <= i; j++) {
        const x = 1 + (i === from ? W : (j - from) * W / (i - from)), y = 2 + H * (1 - hist[j][key]);
        j === from ? sctx.moveTo(x, y) : sctx.lineTo(x, y);
      }
      sctx.stroke();
    }
    box.dataset.largestRun = kvLargestRun(f)[1];
  }
  return { draw, canvas: map, gauges, series, layout: () => g, destroy: () => cancelAnimationFrame(anim) };
}
