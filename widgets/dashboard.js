// Dashboard: the pool grid, the fragmentation panel and the eviction panel over one frame stream, plus controls
// for the live run in the kernel (run / pause / step / speed) and its setup (policy, block size, workload).
// Kernel controls go out as messages and are handled between two steps of the run; the player bar under the
// panels works on the frames already received, so it keeps working while the kernel is busy.

function kvDashboardPanels(body, model) {
  const left = kvEl("div", "kv-col", body), right = kvEl("div", "kv-col", body);
  return [kvPoolPanel(left, model, 512), kvFragPanel(right, model, 420), kvEvictionPanel(right, model, 420)];
}

function kvDashboardControls(top, model) {
  const row = kvEl("div", "kv-controls", top);
  for (const [act, label] of [["run", "run"], ["pause", "pause"], ["step", "step"], ["stop", "stop"]]) {
    const b = kvEl("button", "kv-btn", row, label);
    b.dataset.ctl = act;
    b.onclick = () => model.send({ type: "control", action: act });
  }
  const speedBox = kvEl("label", "kv-field", row, "speed ");
  const speed = kvEl("input", "kv-speed", speedBox);
  speed.type = "range"; speed.min = 0; speed.max = 3; speed.step = 0.1; // log10 of steps per second
  const speedText = kvEl("span", null, speedBox);
  const setSpeedUi = () => { const v = model.get("speed"); speed.value = Math.log10(Math.max(1, v)); speedText.textContent = ` ${Math.round(v)} steps/s`; };
  speed.oninput = () => { model.set("speed", Math.round(10 ** Number(speed.value))); model.save_changes(); setSpeedUi(); };
  const selects = {};
  for (const key of ["policy", "block_size", "workload"]) {
    const lab = kvEl("label", "kv-field", row, key.replace("_", " ") + " ");
    const sel = kvEl("select", "kv-select", lab);
    sel.dataset.key = key;
    sel.onchange = () => { model.set(key, key === "block_size" ? Number(sel.value) : sel.value); model.save_changes(); };
    selects[key] = sel;
  }
  const status = kvEl("span", "kv-status", row);
  function sync() {
    const opts = model.get("options") || {};
    for (const [key, sel] of Object.entries(selects)) {
      sel.replaceChildren(...(opts[key] || []).map((v) => { const o = kvEl("option", null, null, String(v)); o.value = v; return o; }));
      sel.value = String(model.get(key));
    }
    status.textContent = model.get("status");
    status.dataset.state = model.get("status");
    setSpeedUi();
  }
  for (const t of ["options", "policy", "block_size", "workload", "status", "speed"]) model.on(`change:${t}`, sync);
  sync();
  return {};
}
