// kvlab widgets, shared part: frame decoding, colours, the block grid and the frame history player.
// The Python side concatenates this file with the view files and appends the `export default` line, so
// anywidget receives one self-contained ES module (no build step, no relative imports).

const KV_HEADER = 48; // see kvlab/viz/frames.py for the layout
const KV_STATES = ["FREE", "PENDING", "ALLOCATED", "EVICTING", "CACHED"];
const KV_FLASHES = ["", "allocated", "freed", "evicted", "moved in", "moved out"];
const KV_RGB = {
  FREE: [232, 232, 232], PENDING: [242, 193, 78], ALLOC1: [74, 134, 200], ALLOC8: [20, 52, 110],
  EVICTING: [214, 69, 69], CACHED: [127, 191, 127], GAP: [255, 255, 255],
};
const KV_FLASH_RGB = [null, [255, 212, 0], [255, 255, 255], [255, 0, 255], [0, 229, 255], [255, 255, 255]];
const KV_FLASH_WEIGHT = [1, 0.6, 0.35, 0.15]; // a flash fades over the 3 frames after the one it happened in
const KV_MAX_HISTORY_BYTES = 192 * 1024 * 1024;

function kvBytes(v) {
  if (!v) return new Uint8Array(0);
  if (v instanceof Uint8Array) return v;
  if (v instanceof ArrayBuffer) return new Uint8Array(v);
  return new Uint8Array(v.buffer, v.byteOffset, v.byteLength); // DataView from the widget manager
}

function kvDecode(v) {
  const u8 = kvBytes(v);
  if (u8.length < KV_HEADER) return null;
  if (String.fromCharCode(u8[0], u8[1], u8[2], u8[3]) !== "KVF1") throw new Error("kvlab: not a frame");
  const dv = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  const n = dv.getUint32(8, true), flags = dv.getUint32(40, true), tailLen = dv.getUint32(44, true);
  const f = {
    seq: dv.getUint32(4, true), n, blockSize: dv.getUint32(12, true), step: dv.getFloat64(16, true),
    utilisation: dv.getFloat32(24, true), external: dv.getFloat32(28, true), waste: dv.getFloat32(32, true),
    scatter: dv.getFloat32(36, true), bytes: u8.length, dv, details: -1,
    state: u8.subarray(KV_HEADER, KV_HEADER + n), refs: u8.subarray(KV_HEADER + n, KV_HEADER + 2 * n),
    meta: u8.subarray(KV_HEADER + 2 * n, KV_HEADER + 3 * n),
  };
  let o = KV_HEADER + 3 * n;
  if (flags & 1) { f.details = o; o += 14 * n; }
  f.tail = tailLen ? JSON.parse(new TextDecoder().decode(u8.subarray(o, o + tailLen))) : {};
  return f;
}

function kvBlockInfo(f, i) {
  const k = f.meta[i] >> 3, info = {
    block: i, state: KV_STATES[f.state[i]], refcount: f.refs[i], size_class: k,
    capacity: f.blockSize << k, flash: KV_FLASHES[f.meta[i] & 7],
  };
  if (f.details >= 0) {
    info.tokens = f.dv.getUint16(f.details + 2 * i, true);
    info.owner = f.dv.getInt32(f.details + 2 * f.n + 4 * i, true);
    info.last_access = f.dv.getFloat64(f.details + 6 * f.n + 8 * i, true);
  }
  return info;
}

function kvInfoText(info) {
  const parts = [`block ${info.block}`, info.state, `refcount ${info.refcount}${info.refcount === 255 ? "+" : ""}`,
    `class ${info.size_class} (${info.capacity} tokens)`];
  if (info.tokens !== undefined) parts.push(`tokens ${info.tokens}`, `owner ${info.owner}`, `last access ${info.last_access}`);
  if (info.flash) parts.push(`just ${info.flash}`);
  return parts.join(" · ");
}

const kvPack = (c) => (255 << 24 | c[2] << 16 | c[1] << 8 | c[0]) >>> 0; // RGBA bytes in a little-endian u32
const kvMix = (a, b, w) => a.map((x, j) => Math.round(x + (b[j] - x) * w));

// Colour of (state, refcount) as packed RGBA; ALLOCATED darkens with its refcount (1 .. 8+).
const KV_PALETTE = (() => {
  const p = new Uint32Array(5 * 256), base = [KV_RGB.FREE, KV_RGB.PENDING, null, KV_RGB.EVICTING, KV_RGB.CACHED];
  for (let s = 0; s < 5; s++) for (let r = 0; r < 256; r++)
    p[s * 256 + r] = kvPack(s === 2 ? kvMix(KV_RGB.ALLOC1, KV_RGB.ALLOC8, Math.min(Math.max(r, 1) - 1, 7) / 7) : base[s]);
  return p;
})();

function kvLayout(n, maxWidth) {
  let cols = 1;
  while (cols * cols < n) cols <<= 1; // power-of-two columns: an aligned buddy block never wraps a row
  const cell = Math.max(1, Math.min(40, Math.floor(maxWidth / cols)));
  const rows = Math.ceil(n / cols);
  return { n, cols, rows, cell, gap: cell >= 6 ? 1 : 0, w: cols * cell, h: rows * cell };
}

// Paint one packed colour per block into an ImageData-backed canvas (fast for 65,536 blocks).
function kvPaint(ctx, g, colors) {
  const img = ctx.createImageData(g.w, g.h), px = new Uint32Array(img.data.buffer);
  px.fill(kvPack(KV_RGB.GAP));
  const inner = g.cell - g.gap;
  for (let i = 0; i < g.n; i++) {
    const x0 = (i % g.cols) * g.cell, y0 = Math.floor(i / g.cols) * g.cell, c = colors[i];
    for (let y = 0; y < inner; y++) { const r = (y0 + y) * g.w + x0; px.fill(c, r, r + inner); }
  }
  ctx.putImageData(img, 0, 0);
}

// Colours of frame hist[i]: state/refcount palette, then flashes of frames i-3..i (newest wins).
function kvColors(hist, i, palette) {
  const f = hist[i], out = new Uint32Array(f.n);
  for (let b = 0; b < f.n; b++) out[b] = palette(f, b);
  for (let age = Math.min(3, i); age >= 0; age--) {
    const meta = hist[i - age].meta;
    if (hist[i - age].n !== f.n) continue;
    for (let b = 0; b < f.n; b++) {
      const fl = meta[b] & 7;
      if (fl) {
        const base = palette(f, b), rgb = [base & 255, base >> 8 & 255, base >> 16 & 255];
        out[b] = kvPack(kvMix(rgb, KV_FLASH_RGB[fl], KV_FLASH_WEIGHT[age]));
      }
    }
  }
  return out;
}

function kvEl(tag, cls, parent, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

// Mount panels on a model: keep every received frame (pause, step back and scrub work while Python is busy),
// count frames, and draw the selected one. Returns the cleanup function anywidget calls on removal.
function kvMount(model, el, makePanels, extra) {
  const root = kvEl("div", "kv-root", el), top = kvEl("div", "kv-top", root);
  const body = kvEl("div", "kv-body", root), bar = kvEl("div", "kv-player", root);
  const hist = [];
  let idx = -1, live = true, received = 0, histBytes = 0;
  const btn = (act, label, title) => { const b = kvEl("button", "kv-btn", bar, label); b.dataset.act = act; b.title = title; return b; };
  const back = btn("back", "◀", "step back"), toggle = btn("toggle", "pause", "pause / follow live");
  const fwd = btn("fwd", "▶", "step forward");
  const slider = kvEl("input", "kv-slider", bar);
  slider.type = "range"; slider.min = 0; slider.max = 0; slider.value = 0;
  const label = kvEl("span", "kv-label", bar);
  const panels = makePanels(body, model);
  const ctl = extra ? extra(top, model) : null;

  function report() {
    root.dataset.framesReceived = received;
    root.dataset.framesSent = model.get("frames_sent") ?? received;
    root.dataset.index = idx;
    root.dataset.live = live ? "1" : "0";
    const f = hist[idx];
    label.textContent = f ? `frame ${idx + 1}/${hist.length} · step ${f.step} · seq ${f.seq} · received ${received}/${root.dataset.framesSent}` : "no frame yet";
    toggle.textContent = live ? "pause" : "live";
  }
  function show(i) {
    if (!hist.length) return report();
    idx = Math.max(0, Math.min(hist.length - 1, i));
    slider.max = hist.length - 1; slider.value = idx;
    for (const p of panels) p.draw(hist, idx);
    if (ctl && ctl.draw) ctl.draw(hist, idx);
    report();
  }
  function push(v, draw) {
    const f = kvDecode(v);
    if (!f) return;
    if (hist.length && hist[hist.length - 1].n !== f.n) { hist.length = 0; histBytes = 0; } // new pool
    hist.push(f); histBytes += f.bytes;
    while (histBytes > KV_MAX_HISTORY_BYTES && hist.length > 1) { histBytes -= hist.shift().bytes; idx--; }
    if (draw) { if (live) show(hist.length - 1); else { slider.max = hist.length - 1; report(); } }
  }
  const onFrame = () => {
    received++;
    push(model.get("frame"), true);
    model.set("frames_received", received);
    model.save_changes();
  };
  const onMsg = (msg, buffers) => {
    if (msg.type === "history") {
      if (msg.reset) { hist.length = 0; histBytes = 0; }
      for (const b of buffers || []) push(b, false);
      live = false; show(msg.index ?? 0);
    } else if (msg.type === "inspect") for (const p of panels) if (p.inspect) p.inspect(msg);
  };
  const onSent = () => report();
  back.onclick = () => { live = false; show(idx - 1); };
  fwd.onclick = () => { live = false; show(idx + 1); };
  toggle.onclick = () => { live = !live; show(live ? hist.length - 1 : idx); };
  slider.oninput = () => { live = Number(slider.value) === hist.length - 1 && live; if (!live) show(Number(slider.value)); };
  slider.onchange = slider.oninput;
  model.on("change:frame", onFrame);
  model.on("change:frames_sent", onSent);
  model.on("msg:custom", onMsg);
  if (kvBytes(model.get("frame")).length) { received++; push(model.get("frame"), true); }
  else report();
  model.send({ type: "ready" });
  root.kv = { hist, show, get index() { return idx; }, get live() { return live; }, panels };
  return () => {
    model.off("change:frame", onFrame); model.off("change:frames_sent", onSent); model.off("msg:custom", onMsg);
    for (const p of panels) if (p.destroy) p.destroy();
  };
}
