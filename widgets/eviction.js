// EvictionView panel: for the latest eviction up to the shown frame, the candidates the policy ranked (bar length
// = score, normalised) with the victim in red; below, a list of the recent evictions.

const KV_VICTIM = [214, 69, 69], KV_CANDIDATE = [160, 160, 160];
const KV_EV_ROW = 22, KV_EV_BAR_X = 170;

// The evictions recorded in frames 0..i, newest last (at most `limit`).
function kvRecentEvictions(hist, i, limit) {
  const out = [];
  for (let j = i; j >= 0 && out.length < limit; j--) {
    const ev = hist[j].tail.evictions || [];
    for (let k = ev.length - 1; k >= 0 && out.length < limit; k--) out.push(ev[k]);
  }
  return out.reverse();
}

function kvEvictionPanel(parent, model, width = 480) {
  const box = kvEl("div", "kv-evictions", parent);
  const title = kvEl("div", "kv-title", box, "evictions");
  const canvas = kvEl("canvas", "kv-bars", box), ctx = canvas.getContext("2d", { willReadFrequently: true });
  const list = kvEl("ol", "kv-evlist", box);
  canvas.width = width; canvas.height = KV_EV_ROW * 9 + 8;

  function draw(hist, i) {
    const recent = kvRecentEvictions(hist, i, 8), last = recent[recent.length - 1];
    let total = 0;
    for (let j = i; j >= 0; j--) if (hist[j].tail.evictions_total !== undefined) { total = hist[j].tail.evictions_total; break; }
    title.textContent = last ? `eviction at step ${last.step}: policy ${last.policy} chose block ${last.victim} ` +
      `(${last.reason}) · ${total} evictions so far` : "no eviction yet";
    box.dataset.victim = last ? last.victim : "";
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.font = "12px sans-serif"; ctx.textBaseline = "middle";
    if (last) {
      const scores = last.candidates.map((c) => c[1]);
      const lo = Math.min(...scores), hi = Math.max(...scores), span = hi - lo || 1, room = canvas.width - KV_EV_BAR_X - 10;
      last.candidates.forEach(([b, s], r) => {
        const y = 4 + r * KV_EV_ROW, victim = b === last.victim;
        ctx.fillStyle = "#111";
        ctx.fillText(`${victim ? "victim" : "#" + (r + 1)}  block ${b}  score ${+s.toFixed(3)}`, 4, y + KV_EV_ROW / 2);
        ctx.fillStyle = `rgb(${victim ? KV_VICTIM : KV_CANDIDATE})`;
        ctx.fillRect(KV_EV_BAR_X, y + 3, 12 + Math.round((room - 12) * (s - lo) / span), KV_EV_ROW - 6);
      });
    }
    list.replaceChildren(...recent.slice().reverse().map((e) =>
      kvEl("li", null, null, `step ${e.step}: ${e.policy} evicted block ${e.victim} of ${e.candidates.length} ranked`)));
  }
  return { draw, canvas };
}
