// Dashboard: the panels its preset names (pool grid, fragmentation, evictions) over one frame stream, plus controls
// for the live run in the kernel (step, stop, speed) and its setup (the preset's menus of policy, block size,
// workload). Run / pause is the player's one button; kernel controls go out as messages and are handled between
// two steps of the run. The player works on the frames already received, so it keeps working while the kernel
// is busy.

const KV_PANELS = { pool: kvPoolPanel, fragmentation: kvFragPanel, eviction: kvEvictionPanel };

function kvDashboardPanels(body, model) {
  const names = (model.get("panels") || ["pool", "fragmentation", "eviction"]).filter((p) => KV_PANELS[p]);
  body.classList.add("kv-dash");
  // Two columns: the pool (with the eviction panel under it when there are three) beside the rest, so neither
  // column leaves a large empty area.
  const left = kvEl("div", "kv-col", body), right = kvEl("div", "kv-col", body);
  return names.map((name, k) => {
    const col = k === 0 || (names.length === 3 && name === "eviction") ? left : right;
    return KV_PANELS[name](kvEl("div", "kv-cell", col), model, 560);
  });
}

const KV_CONTROL_WORDS = { policy: "淘汰策略", block_size: "块大小", workload: "工作负载" };

function kvDashboardControls(top, model, ask) {
  const row = kvEl("div", "kv-controls", top);
  for (const [act, label, title] of [["step", "走一步 one step", "暂停工作负载并走一步 (pause, then one step)"],
    ["stop", "停止 stop", "结束这次运行，再运行从头开始 (end this run)"]]) {
    const b = kvEl("button", "kv-btn", row, label);
    b.dataset.ctl = act; b.title = title;
    b.onclick = () => ask({ type: "control", action: act });
  }
  const speedBox = kvEl("label", "kv-field", row, "速度 speed ");
  const speed = kvEl("input", "kv-speed", speedBox);
  speed.type = "range"; speed.min = 0; speed.max = 3; speed.step = 0.1; // log10 of steps per second
  const speedText = kvEl("span", null, speedBox);
  const setSpeedUi = () => {
    const v = Number(model.get("speed")) || 1;
    speed.value = Math.log10(Math.max(1, v)); speedText.textContent = ` ${Math.round(v)} 步/秒 (steps/s)`;
  };
  speed.oninput = () => { model.set("speed", Math.round(10 ** Number(speed.value))); model.save_changes(); setSpeedUi(); };
  const selects = {};
  for (const key of model.get("controls") || ["policy", "block_size", "workload"]) {
    const lab = kvEl("label", "kv-field", row, `${KV_CONTROL_WORDS[key] || ""} ${key.replace("_", " ")} `);
    const sel = kvEl("select", "kv-select", lab);
    sel.dataset.key = key;
    sel.onchange = () => { model.set(key, key === "block_size" ? Number(sel.value) : sel.value); model.save_changes(); };
    selects[key] = sel;
  }
  function sync() {
    const opts = model.get("options") || {};
    for (const [key, sel] of Object.entries(selects)) {
      sel.replaceChildren(...(opts[key] || []).map((v) => { const o = kvEl("option", null, null, String(v)); o.value = v; return o; }));
      sel.value = String(model.get(key));
    }
    setSpeedUi();
  }
  for (const t of ["options", "policy", "block_size", "workload", "speed"]) model.on(`change:${t}`, sync);
  sync();
  return {};
}
