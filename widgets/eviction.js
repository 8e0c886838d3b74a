// EvictionView panel: for the latest eviction up to the shown frame, the candidates the policy ranked with what
// their score means for that policy (bars drawn from zero, the victim black), the reason the caller gave, and a
// list of the recent evictions in words.

const KV_EV_LIST = 8;
const KV_REASONS = { "allocation pressure": "an allocation needed room", explicit: "asked for directly" };

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
const kvReason = (r) => KV_REASONS[r] || r;
// When an eviction happened: the workload's step when a run recorded it, else the pool's clock.
const kvWhen = (e) => e.at !== undefined && e.at !== null ? `step ${e.at}` : `pool tick ${e.step}`;
function kvFmt(x) {
  if (!Number.isFinite(x)) return x > 0 ? "∞" : "-∞";
  return Number.isInteger(x) ? String(x) : x.toFixed(3);
}

function kvEvictionPanel(parent, model) {
  const box = kvEl("div", "kv-evictions", parent);
  const title = kvEl("div", "kv-title", box, "no eviction yet");
  const explain = kvEl("div", "kv-explain", box);
  const bars = kvEl("div", "kv-bars", box);
  kvLegend(box, [["VICTIM", KV_W.VICTIM, "swatch", KV_PALETTE_DATA.victim],
    ["CANDIDATE", KV_W.CANDIDATE, "swatch", KV_PALETTE_DATA.candidate]]);
  kvEl("div", "kv-caption", box, "recent evictions, newest first");
  const list = kvEl("ol", "kv-evlist", box);

  function draw(hist, i) {
    const recent = kvRecentEvictions(hist, i, KV_EV_LIST), last = recent[recent.length - 1];
    let total = 0;
    for (let j = i; j >= 0; j--) if (hist[j].tail.evictions_total !== undefined) { total = hist[j].tail.evictions_total; break; }
    box.dataset.victim = last ? last.victim : "";
    if (!last) {
      title.textContent = "no eviction yet"; explain.textContent = ""; bars.replaceChildren(); list.replaceChildren();
      return;
    }
    const words = kvScoreWords(last.policy);
    title.textContent = `${kvWhen(last)}: ${last.policy.toUpperCase()} evicted block ${last.victim} · ` +
      `reason: ${kvReason(last.reason)} · ${total} eviction${total === 1 ? "" : "s"} so far`;
    const shown = last.candidates.map(([, s]) => words.sign * Number(s));
    const top = Math.max(...shown.map((v) => Number.isFinite(v) ? Math.abs(v) : 0), 0);
    const base = Number(last.axis) || 0; // computed in Python (palette.bar_axis): 0, or below close scores
    explain.textContent = `score = ${words.what}; ${words.order}. ` +
      (base ? `Bars start at ${kvFmt(base)}, not zero: the scores are close.` : "Bars start at zero.");
    bars.replaceChildren(...last.candidates.map(([b], r) => {
      const victim = b === last.victim, v = shown[r];
      const row = kvEl("div", "kv-bar-row");
      row.dataset.block = b; row.dataset.victim = victim ? "1" : "0";
      kvEl("span", "kv-bar-name", row, `${victim ? "evicted" : "#" + (r + 1)} · block ${b}`);
      const track = kvEl("span", "kv-bar-track", row), fill = kvEl("span", "kv-bar", track);
      fill.style.background = kvCss(victim ? KV_PALETTE_DATA.victim : KV_PALETTE_DATA.candidate);
      const frac = !Number.isFinite(v) ? 1 : top > base ? (Math.abs(v) - base) / (top - base) : 0;
      fill.style.width = `${Math.max(0.5, 100 * frac)}%`; // a zero score still shows a sliver at the axis
      kvEl("span", "kv-bar-value", row, kvFmt(v));
      return row;
    }));
    list.replaceChildren(...recent.slice().reverse().map((e) => {
      const rank = e.candidates.findIndex(([b]) => b === e.victim) + 1, n = e.candidates.length;
      return kvEl("li", null, null, `${kvWhen(e)}: ${e.policy.toUpperCase()} evicted block ${e.victim} ` +
        `(${kvReason(e.reason)})` + (rank ? `, ranked ${rank} of the ${n} candidate${n === 1 ? "" : "s"} shown` : ""));
    }));
  }
  return { draw, bars };
}
