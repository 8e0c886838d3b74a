// EvictionView panel: for the latest eviction up to the shown frame, the candidates the policy ranked with what
// their score means for that policy (bars drawn from zero, the victim black), the reason the caller gave, and a
// list of the recent evictions in words.

const KV_EV_LIST = 8;

// The evictions recorded in frames 0..i, newest last (at most `limit`).
function kvRecentEvictions(hist, i, limit) {
  const out = [];
  for (let j = i; j >= 0 && out.length < limit; j--) {
    const ev = hist[j].tail.evictions || [];
    for (let k = ev.length - 1; k >= 0 && out.length < limit; k--) out.push(ev[k]);
  }
  return out.reverse();
}

const kvScoreWords = (policy) => KV_PALETTE_DATA.scores[policy] || KV_PALETTE_DATA.unknownScore;
const kvReason = (r) => KV_PALETTE_DATA.reasons[r] || r;
// When an eviction happened: the workload's step when a run recorded it, else the pool's clock.
const kvWhen = (e) => e.at !== undefined && e.at !== null ? `第 ${e.at} 步 (step)` : `池时钟 ${e.step} (pool tick)`;
function kvFmt(x) {
  if (!Number.isFinite(x)) return x > 0 ? "∞" : "-∞";
  return Number.isInteger(x) ? String(x) : x.toFixed(3);
}

function kvEvictionPanel(parent, model) {
  const box = kvEl("div", "kv-evictions", parent);
  const title = kvEl("div", "kv-title", box, KV_PALETTE_DATA.noEviction);
  const explain = kvEl("div", "kv-explain", box);
  const bars = kvEl("div", "kv-bars", box);
  kvLegend(box, [["VICTIM", KV_W.VICTIM, "swatch", KV_PALETTE_DATA.victim],
    ["CANDIDATE", KV_W.CANDIDATE, "swatch", KV_PALETTE_DATA.candidate]]);
  kvEl("div", "kv-caption", box, "最近的淘汰，新的在前 (recent evictions, newest first)");
  const list = kvEl("ol", "kv-evlist", box);

  function draw(hist, i) {
    const recent = kvRecentEvictions(hist, i, KV_EV_LIST), last = recent[recent.length - 1];
    let total = 0;
    for (let j = i; j >= 0; j--) if (hist[j].tail.evictions_total !== undefined) { total = hist[j].tail.evictions_total; break; }
    box.dataset.victim = last ? last.victim : "";
    if (!last) {
      title.textContent = KV_PALETTE_DATA.noEviction; explain.textContent = ""; bars.replaceChildren(); list.replaceChildren();
      return;
    }
    const words = kvScoreWords(last.policy);
    title.textContent = `${kvWhen(last)}：${last.policy.toUpperCase()} 淘汰了块 ${last.victim} (evicted) · ` +
      `原因：${kvReason(last.reason)} · 到目前共淘汰 ${total} 次`;
    const shown = last.candidates.map(([, s]) => words.sign * Number(s));
    const top = Math.max(...shown.map((v) => Number.isFinite(v) ? Math.abs(v) : 0), 0);
    const base = Number(last.axis) || 0; // computed in Python (palette.bar_axis): 0, or below close scores
    explain.textContent = `分数 (score) = ${words.what}；${words.order}。` +
      (base ? `条形从 ${kvFmt(base)} 起而不是从 0 起：分数太接近。` : "条形从 0 起。");
    bars.replaceChildren(...last.candidates.map(([b], r) => {
      const victim = b === last.victim, v = shown[r];
      const row = kvEl("div", "kv-bar-row");
      row.dataset.block = b; row.dataset.victim = victim ? "1" : "0";
      kvEl("span", "kv-bar-name", row, `${victim ? "淘汰" : "#" + (r + 1)} · 块 ${b}`);
      const track = kvEl("span", "kv-bar-track", row), fill = kvEl("span", "kv-bar", track);
      fill.style.background = kvCss(victim ? KV_PALETTE_DATA.victim : KV_PALETTE_DATA.candidate);
      const frac = !Number.isFinite(v) ? 1 : top > base ? (Math.abs(v) - base) / (top - base) : 0;
      fill.style.width = `${Math.max(0.5, 100 * frac)}%`; // a zero score still shows a sliver at the axis
      kvEl("span", "kv-bar-value", row, kvFmt(v));
      return row;
    }));
    list.replaceChildren(...recent.slice().reverse().map((e) => {
      const rank = e.candidates.findIndex(([b]) => b === e.victim) + 1, n = e.candidates.length;
      return kvEl("li", null, null, `${kvWhen(e)}：${e.policy.toUpperCase()} 淘汰了块 ${e.victim} ` +
        `（${kvReason(e.reason)}）` + (rank ? `，在显示的 ${n} 个候选中排第 ${rank}` : ""));
    }));
  }
  return { draw, bars };
}
