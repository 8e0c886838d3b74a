// kvlab widgets, shared part: frame decoding, colours, legends, the block grid and the player.
// The Python side puts generated constants first, the palette (KV_PALETTE_DATA, from kvlab/viz/palette.py), the
// frame layout (KV_FRAME, from the tables in kvlab/viz/frames.py) and the saved run's (KV_REPLAY, from
// kvlab/viz/saved.py), then this file and the view files, then the `export default` line, so anywidget receives
// one self-contained ES module (no build step).

const KV_STATES = KV_FRAME.states;
const KV_FLASHES = KV_FRAME.flashes;
const KV_FLASH_MASK = (1 << KV_FRAME.flashBits) - 1; // meta = size_class << flashBits | flash
const KV_RGB = KV_PALETTE_DATA.state;
const KV_FLASH_RGB = KV_PALETTE_DATA.flash;
const KV_FLASH_WEIGHT = KV_PALETTE_DATA.flashWeight; // a flash fades over the 3 frames after the one it happened in
const KV_MAX_HISTORY_BYTES = 192 * 1024 * 1024;
const KV_PLAY_FPS = 12; // replaying received pictures in the browser
const KV_NO_ANSWER_MS = 3000; // a click the kernel has not answered by then: no kernel is behind this view
const KV_UTF8 = new TextDecoder();

function kvBytes(v) {
  if (!v) return new Uint8Array(0);
  if (v instanceof Uint8Array) return v;
  if (v instanceof ArrayBuffer) return new Uint8Array(v);
  return new Uint8Array(v.buffer, v.byteOffset, v.byteLength); // DataView from the widget manager
}

// A frame as KV_FRAME lays it out, with Python's names: every header field (seq, num_blocks, block_size, step, the
// four gauges, flags, tail_len), the body sections as byte arrays (state, refcount, meta), where each details
// section starts (read per block by kvBlockInfo) and the parsed tail.
function kvDecode(v) {
  const u8 = kvBytes(v), L = KV_FRAME;
  if (u8.length < L.headerSize) return null;
  if (String.fromCharCode(...u8.subarray(0, L.magic.length)) !== L.magic) throw new Error("kvlab: not a frame");
  const dv = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  const f = { bytes: u8.length, dv, details: null };
  for (const [name, at, type] of L.header) f[name] = dv[`get${type}`](at, true);
  const n = f.num_blocks;
  let o = L.headerSize;
  for (const [name, size] of L.body) { f[name] = u8.subarray(o, o + n * size); o += n * size; } // one byte each
  if (f.flags & L.flagDetails) {
    f.details = {};
    for (const [name, size, type] of L.details) { f.details[name] = { at: o, size, type }; o += n * size; }
  }
  f.tail = f.tail_len ? JSON.parse(KV_UTF8.decode(u8.subarray(o, o + f.tail_len))) : {};
  return f;
}

// Where a frame stands, in the words the cells use: the workload's step (and of how many), or for a frame built
// outside a run, how many operations the pool has done (its clock).
function kvStepText(f) {
  const r = f.tail.run;
  if (r) return r.steps ? `第 ${r.step} / ${r.steps} 步 (step)` : `第 ${r.step} 步 (step)`;
  return `池的 ${f.step} 次操作之后 (after pool operations)`;
}

function kvBlockInfo(f, i) {
  const k = f.meta[i] >> KV_FRAME.flashBits, info = {
    block: i, state: KV_STATES[f.state[i]], refcount: f.refcount[i], size_class: k,
    capacity: f.block_size << k, flash: KV_FLASHES[f.meta[i] & KV_FLASH_MASK],
  };
  if (f.details) { // tokens, owner, last_access
    for (const [name, d] of Object.entries(f.details)) info[name] = f.dv[`get${d.type}`](d.at + d.size * i, true);
  }
  return info;
}

function kvInfoText(info) {
  const parts = [`块 ${info.block} (block)`, info.state,
    `${info.refcount}${info.refcount === 255 ? "+" : ""} 个引用 (references)`, `最多装 ${info.capacity} 个 token`];
  if (info.tokens !== undefined) {
    parts.push(`装着 ${info.tokens} 个 token`, info.owner >= 0 ? `序列 ${info.owner} (sequence)` : "无主 (no owner)",
      `上次使用于池时钟 ${info.last_access} (last used)`);
  }
  if (info.flash) parts.push(`${KV_PALETTE_DATA.flashVerbs[info.flash]} (just ${info.flash})`);
  return parts.join(" · ");
}

const kvPack = (c) => (255 << 24 | c[2] << 16 | c[1] << 8 | c[0]) >>> 0; // RGBA bytes in a little-endian u32
const kvMix = (a, b, w) => a.map((x, j) => Math.round(x + (b[j] - x) * w));
const kvCss = (c) => `rgb(${c[0]}, ${c[1]}, ${c[2]})`;

// Colour of (state, refcount) as packed RGBA; ALLOCATED darkens with its refcount (1 .. 8+).
const KV_PALETTE = (() => {
  const p = new Uint32Array(5 * 256), base = [KV_RGB.FREE, KV_RGB.PENDING, null, KV_RGB.EVICTING, KV_RGB.CACHED];
  for (let s = 0; s < 5; s++) for (let r = 0; r < 256; r++)
    p[s * 256 + r] = kvPack(s === 2 ? kvMix(KV_RGB.ALLOC1, KV_RGB.ALLOC8, Math.min(Math.max(r, 1) - 1, 7) / 7) : base[s]);
  return p;
})();
const kvStateColor = (f, b) => KV_PALETTE[f.state[b] << 8 | f.refcount[b]];

function kvLayout(n, maxWidth) {
  let cols = 1;
  while (cols * cols < n) cols <<= 1; // power-of-two columns: an aligned buddy block never wraps a row
  const cell = Math.max(1, Math.min(40, Math.floor(maxWidth / cols)));
  const rows = Math.ceil(n / cols);
  return { n, cols, rows, cell, gap: cell >= 6 ? 1 : 0, w: cols * cell, h: rows * cell };
}

// The width a panel may use: its container's, once it is on the page (views scale to the notebook cell).
function kvRoom(el, maxWidth) {
  const w = el.getBoundingClientRect().width;
  return w > 0 ? Math.min(maxWidth, Math.floor(w)) : maxWidth;
}

// A flash's blend, precomputed: for each flash code and age, each channel value 0..255 moved towards the flash
// colour by the age's weight (as kvMix does), so tinting a block is three table reads, no allocation.
const KV_TINT = (() => {
  const t = new Uint8Array(KV_FLASH_RGB.length * 4 * 768);
  for (let code = 1; code < KV_FLASH_RGB.length; code++) for (let age = 0; age < 4; age++) for (let ch = 0; ch < 3; ch++)
    for (let x = 0; x < 256; x++)
      t[(code * 4 + age) * 768 + ch * 256 + x] = kvMix([x], [KV_FLASH_RGB[code][ch]], KV_FLASH_WEIGHT[age])[0];
  return t;
})();
function kvTint(c, code, age) {
  const o = (code * 4 + age) * 768;
  return (255 << 24 | KV_TINT[o + 512 + (c >> 16 & 255)] << 16 | KV_TINT[o + 256 + (c >> 8 & 255)] << 8 |
    KV_TINT[o + (c & 255)]) >>> 0;
}

// Paint one packed colour per block. With small cells (no gap) each block is one pixel of a reused image, scaled
// up without smoothing (nearest neighbour, so every cell stays one exact colour): filling every cell's pixels
// made the 65,536-block PoolView's draw take 5.7 ms in headless Chromium, this 0.4 ms. Large cells are filled
// one by one, with a gap between them.
const KV_SCRATCH = new WeakMap(); // canvas context -> the image it paints from, reused while its size holds
function kvPaint(ctx, g, colors) {
  const small = g.gap === 0, w = small ? g.cols : g.w, h = small ? g.rows : g.h;
  let s = KV_SCRATCH.get(ctx);
  if (!s || s.small !== small || s.img.width !== w || s.img.height !== h) {
    const canvas = small ? kvEl("canvas") : null;
    if (canvas) { canvas.width = w; canvas.height = h; }
    const img = (canvas ? canvas.getContext("2d", { willReadFrequently: true }) : ctx).createImageData(w, h);
    s = { small, canvas, img, px: new Uint32Array(img.data.buffer) };
    KV_SCRATCH.set(ctx, s);
  }
  const px = s.px, gap = kvPack(KV_RGB.GAP);
  if (small) {
    px.set(colors);
    px.fill(gap, g.n); // the rest of the last row
    s.canvas.getContext("2d").putImageData(s.img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(s.canvas, 0, 0, g.w, g.h);
    return;
  }
  px.fill(gap);
  const inner = g.cell - g.gap;
  for (let i = 0; i < g.n; i++) {
    const x0 = (i % g.cols) * g.cell, y0 = Math.floor(i / g.cols) * g.cell, c = colors[i];
    for (let y = 0; y < inner; y++) { const r = (y0 + y) * g.w + x0; px.fill(c, r, r + inner); }
  }
  ctx.putImageData(s.img, 0, 0);
}

// Whether frame hist[i] is the settled end of a run (it ended, or it is a saved run's last picture): a flash
// fades over the pictures after it, and none will come, so the end shows states only.
const kvSettled = (hist, i) => !!hist.settled && i === hist.length - 1;

// Colours of frame hist[i]: the panel's base colour, then flashes of frames i-3..i (newest wins).
function kvColors(hist, i, color) {
  const f = hist[i], n = f.num_blocks, out = new Uint32Array(n);
  for (let b = 0; b < n; b++) out[b] = color(f, b);
  if (kvSettled(hist, i)) return out;
  for (let age = Math.min(3, i); age >= 0; age--) {
    const meta = hist[i - age].meta;
    if (hist[i - age].num_blocks !== n) continue;
    for (let b = 0; b < n; b++) {
      const fl = meta[b] & KV_FLASH_MASK;
      if (fl) out[b] = kvTint(color(f, b), fl, age);
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

// A legend: one entry per colour, flash, blend, line or outline the panel can draw. Each entry is
// [key, words, kind, colour(s)]; kind is "swatch", "ramp" [from, to], "flash" [colour], "outline", "line" [colour,
// dash], "arrow" or "note". data-key names the palette entry, so tests can match a swatch to the cells it explains.
function kvLegend(parent, entries) {
  const box = kvEl("div", "kv-legend", parent);
  for (const [key, words, kind, a, b] of entries) {
    const item = kvEl("span", "kv-key", box);
    item.dataset.key = key; item.dataset.kind = kind;
    const sw = kvEl(kind === "line" || kind === "arrow" ? "canvas" : "span", "kv-swatch", item);
    if (kind === "swatch") sw.style.background = kvCss(a);
    else if (kind === "ramp") sw.style.background = `linear-gradient(90deg, ${kvCss(a)}, ${kvCss(b)})`;
    else if (kind === "flash") { sw.style.background = kvCss(a); sw.classList.add("kv-flash"); }
    else if (kind === "outline") { sw.style.border = `2px solid ${kvCss(a)}`; sw.style.background = "transparent"; }
    else if (kind === "note") sw.classList.add("kv-note");
    else { // a line (dash pattern from the palette) or an arrow, drawn as the panel draws it
      sw.width = 28; sw.height = 14;
      const c = sw.getContext("2d");
      c.strokeStyle = c.fillStyle = kvCss(a); c.lineWidth = 2; c.setLineDash(b || []);
      c.beginPath(); c.moveTo(1, 7); c.lineTo(kind === "arrow" ? 21 : 27, 7); c.stroke();
      if (kind === "arrow") { c.setLineDash([]); c.beginPath(); c.moveTo(27, 7); c.lineTo(20, 3); c.lineTo(20, 11); c.fill(); }
    }
    kvEl("span", "kv-words", item, words);
  }
  return box;
}

const KV_W = KV_PALETTE_DATA.words, KV_SW = KV_PALETTE_DATA.stateWords;
const kvStateEntries = () => [["FREE", KV_SW.FREE, "swatch", KV_RGB.FREE],
  ["PENDING", KV_SW.PENDING, "swatch", KV_RGB.PENDING], ["ALLOC1", KV_SW.ALLOC1, "swatch", KV_RGB.ALLOC1],
  ["ALLOC8", KV_SW.ALLOC8, "ramp", KV_RGB.ALLOC1, KV_RGB.ALLOC8], ["EVICTING", KV_SW.EVICTING, "swatch", KV_RGB.EVICTING],
  ["CACHED", KV_SW.CACHED, "swatch", KV_RGB.CACHED]];
const kvFlashEntries = () => [...KV_PALETTE_DATA.flashWords.map(([words, code]) =>
  [`FLASH${code}`, words, "flash", KV_FLASH_RGB[code]]), ["FADE", KV_W.FADE, "note"]];

// A run packed into the `replay` trait (kvlab/viz/saved.py lays it out; KV_REPLAY is that layout): { frames,
// every, total }, or null for anything else. The frames inflate with the browser's own zlib (DecompressionStream),
// so this is async.
async function kvUnpackReplay(v) {
  const u8 = kvBytes(v), L = KV_REPLAY, [lenSize, lenType] = L.length;
  if (u8.length < L.headSize || String.fromCharCode(...u8.subarray(0, L.magic.length)) !== L.magic) return null;
  const head = new DataView(u8.buffer, u8.byteOffset, L.headSize), out = { frames: [] };
  for (const [name, at, type] of L.head) out[name] = head[`get${type}`](at, true);
  const inflated = new Blob([u8.subarray(L.headSize)]).stream().pipeThrough(new DecompressionStream("deflate"));
  const body = new Uint8Array(await new Response(inflated).arrayBuffer()), dv = new DataView(body.buffer);
  for (let at = 0; at + lenSize <= body.length;) {
    const n = dv[`get${lenType}`](at, true);
    out.frames.push(body.subarray(at + lenSize, at + lenSize + n));
    at += lenSize + n;
  }
  return out;
}

// A saved run's label: where its pictures came from and, for a long run, which of them were kept.
const kvSavedWords = (p) =>
  `保存的运行 (saved run)${p.every > 1 ? `：${p.total} 幅画面每 ${p.every} 幅留一幅 (every ${p.every})` : ""}`;

const KV_STATUS_WORDS = { idle: "就绪 (ready to run)", running: "运行中 (running)", paused: "已暂停 (paused)",
  stopping: "正在停止 (stopping)", done: "已完成 (finished)", stopped: "已停止 (stopped)",
  failed: "失败：见单元格的报错 (failed)" };
const kvKernelRun = (status) => ["idle", "running", "paused", "stopping"].includes(status);

// Mount panels on a model: keep every received frame (step back and scrub work while Python is busy), count
// frames, and draw the selected one. The one play / pause button pauses the workload in the kernel when a live run
// drives the view (its `status` trait), and otherwise plays the received pictures in the browser.
// Where no kernel is behind the model (a saved notebook reopened, a static page: its widget state came from the
// file), the run saved in `replay` becomes the history, and kernel controls go once a click is not answered (at
// once on a page that says it has no kernel: globalThis.kvlabNoKernel): the view is then a player of the saved run.
// `extra(top, model, ask)` adds controls; `ask(msg)` sends one to the kernel, watching for that answer.
// Returns the cleanup function anywidget calls on removal.
function kvMount(model, el, makePanels, extra) {
  const root = kvEl("div", "kv-root", el), top = kvEl("div", "kv-top", root);
  const body = kvEl("div", "kv-body", root), bar = kvEl("div", "kv-player", root);
  const hist = [];
  let idx = -1, live = true, received = 0, histBytes = 0, timer = 0;
  let answers = 0, noKernel = globalThis.kvlabNoKernel === true, saved = null, fromKernel = false;
  const btn = (act, label, title) => { const b = kvEl("button", "kv-btn", bar, label); b.dataset.act = act; b.title = title; return b; };
  const back = btn("back", "◀", "后退一幅画面 (one picture back)");
  const toggle = btn("toggle", "暂停 pause", "暂停或继续 (pause or resume)");
  const fwd = btn("fwd", "▶", "前进一幅画面；暂停的运行停在最新画面时：工作负载走一步 (one picture forward)");
  const slider = kvEl("input", "kv-slider", bar);
  slider.type = "range"; slider.min = 0; slider.max = 0; slider.value = 0;
  const label = kvEl("span", "kv-label", bar);
  const panels = makePanels(body, model);
  const setNoKernel = (v) => { noKernel = v; root.classList.toggle("kv-no-kernel", v); };
  const heard = () => { answers++; if (noKernel && globalThis.kvlabNoKernel !== true) setNoKernel(false); };
  const ask = (msg) => {
    const before = answers;
    model.send(msg);
    setTimeout(() => { if (answers === before && !noKernel) { setNoKernel(true); show(idx); } }, KV_NO_ANSWER_MS);
  };
  const ctl = extra ? extra(top, model, ask) : null;
  const status = () => noKernel ? "" : model.get("status") || "";

  function report() {
    root.dataset.framesReceived = received;
    root.dataset.framesSent = model.get("frames_sent") ?? received;
    root.dataset.index = idx;
    root.dataset.live = live ? "1" : "0";
    root.dataset.status = status();
    root.dataset.playing = timer ? "1" : "0";
    const f = hist[idx], s = status();
    const orphan = noKernel && globalThis.kvlabNoKernel !== true ? " · 没有内核应答：▶ 播放保存的画面 (no kernel answers)" : "";
    const words = [s ? KV_STATUS_WORDS[s] || s : "", saved ? kvSavedWords(saved) : !s && hist.length > 1 ? "回放 (replay)" : ""]
      .filter(Boolean).join(" · ") + orphan;
    const where = idx < hist.length - 1 ? ` · 较早的画面 ${idx + 1} / ${hist.length} (an earlier picture)` : "";
    label.textContent = f ? `${kvStepText(f)}${words ? " · " + words : ""}${where}` : "等待第一幅画面 (waiting for the first picture)";
    for (const e of [back, toggle, fwd, slider]) e.hidden = noKernel && hist.length <= 1; // nothing to replay
    toggle.textContent = kvKernelRun(s) ? (s === "running" ? "❚❚ 暂停 pause" : "▶ 运行 run") : (timer ? "❚❚ 暂停 pause" : "▶ 播放 play");
    toggle.dataset.does = kvKernelRun(s) ? (s === "running" ? "pause" : "run") : (timer ? "stop-replay" : "replay");
  }
  function show(i) {
    if (!hist.length) return report();
    hist.settled = ["done", "stopped", "failed"].includes(model.get("status")) || noKernel || !!saved;
    idx = Math.max(0, Math.min(hist.length - 1, i));
    slider.max = hist.length - 1; slider.value = idx;
    for (const p of panels) p.draw(hist, idx);
    if (ctl && ctl.draw) ctl.draw(hist, idx);
    report();
  }
  function push(v, draw) {
    const f = kvDecode(v);
    if (!f) return;
    const last = hist[hist.length - 1];
    if (last && last.num_blocks !== f.num_blocks) { hist.length = 0; histBytes = 0; } // a new pool
    hist.push(f); histBytes += f.bytes;
    while (histBytes > KV_MAX_HISTORY_BYTES && hist.length > 1) { histBytes -= hist.shift().bytes; idx--; }
    if (draw) { if (live && !timer) show(hist.length - 1); else { slider.max = hist.length - 1; report(); } }
  }
  const stopReplay = () => { clearInterval(timer); timer = 0; };
  const control = (action) => { stopReplay(); live = true; ask({ type: "control", action }); show(hist.length - 1); };
  const onFrame = () => {
    heard();
    received++;
    push(model.get("frame"), true);
    model.set("frames_received", received);
    model.save_changes();
  };
  const onMsg = (msg, buffers) => {
    heard();
    if (msg.type === "history") { // every frame the view sent so far: they count as received
      if (msg.reset) { hist.length = 0; histBytes = 0; received = 0; saved = null; fromKernel = true; }
      for (const b of buffers || []) { push(b, false); received++; }
      const at = msg.index ?? hist.length - 1;
      live = at >= hist.length - 1; show(at);
      model.set("frames_received", received);
      model.save_changes();
    } else if (msg.type === "inspect") for (const p of panels) if (p.inspect) p.inspect(msg);
  };
  const onStatus = () => { heard(); report(); };
  const onRunState = () => { heard(); show(idx); }; // a run that ended settles its last picture
  // The saved run, unless a kernel's history came first: its frames, then the latest frame if it is newer.
  const loadSaved = (packed) => {
    if (!packed || fromKernel || packed.frames.length <= 1) return;
    const latest = kvDecode(model.get("frame"));
    hist.length = 0; histBytes = 0;
    for (const b of packed.frames) push(b, false);
    if (latest && latest.seq !== hist[hist.length - 1].seq) push(model.get("frame"), false);
    saved = packed; live = true; show(hist.length - 1);
  };
  back.onclick = () => { stopReplay(); live = false; show(idx - 1); };
  fwd.onclick = () => {
    stopReplay();
    if (idx < hist.length - 1) { live = idx + 1 === hist.length - 1; show(idx + 1); }
    else if (kvKernelRun(status()) && status() !== "running") control("step");
  };
  toggle.onclick = () => {
    const does = toggle.dataset.does;
    if (does === "pause" || does === "run") return control(does);
    if (does === "stop-replay") { stopReplay(); return report(); }
    live = false;
    if (idx >= hist.length - 1) show(0);
    timer = setInterval(() => {
      if (idx >= hist.length - 1) { stopReplay(); live = true; report(); } else show(idx + 1);
    }, 1000 / KV_PLAY_FPS);
    report();
  };
  slider.oninput = () => { stopReplay(); const i = Number(slider.value); live = i === hist.length - 1; show(i); };
  slider.onchange = slider.oninput;
  model.on("change:frame", onFrame);
  model.on("change:frames_sent", onStatus);
  model.on("change:status", onRunState);
  model.on("msg:custom", onMsg);
  if (kvBytes(model.get("frame")).length) { received++; push(model.get("frame"), true); }
  else report();
  setNoKernel(noKernel);
  if (kvBytes(model.get("replay")).length) kvUnpackReplay(model.get("replay")).then(loadSaved, () => {});
  model.send({ type: "ready" });
  root.kv = { hist, show, get index() { return idx; }, get live() { return live; }, get saved() { return saved; },
    panels };
  return () => {
    stopReplay();
    model.off("change:frame", onFrame); model.off("change:frames_sent", onStatus); model.off("change:status", onRunState);
    model.off("msg:custom", onMsg);
    for (const p of panels) if (p.destroy) p.destroy();
  };
}
