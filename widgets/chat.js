// ChatView: the pool grid (kvPoolPanel) beside the conversation. Every frame's tail carries the chat as it stood
// (tail.chat: turns with prompt, answers and status line; the block tables of the latest request), so the player
// and an exported replay step through the answer token by token. A table entry is a chip in its grid cell's colour;
// entries the prefix cache served, entries shared by two or more references and blocks copied on write are marked.
// The controls (prompt, answers, temperature, Send, Stop) send messages; the kernel answers between two tokens.

const KV_CHAT_CSS = `
.kv-chat > .kv-col { flex: 1 1 380px; }
.kv-chat .kv-turns { max-height: 420px; overflow: auto; display: flex; flex-direction: column; gap: 6px; }
.kv-chat .kv-you { font-weight: 600; }
.kv-chat .kv-answer { white-space: pre-wrap; font-size: 15px; }
.kv-chat .kv-answer.kv-live::after { content: "\\258D"; }
.kv-chat .kv-status { font-size: 14px; color: #333; border-left: 3px solid #888; padding-left: 6px; }
.kv-chat .kv-tables { display: flex; flex-direction: column; gap: 4px; font-size: 14px; }
.kv-chat .kv-table { display: flex; flex-wrap: wrap; gap: 3px; align-items: center; }
.kv-chat .kv-chip { display: inline-block; min-width: 26px; padding: 1px 4px; text-align: center; font-size: 14px;
  font-variant-numeric: tabular-nums; border: 3px solid transparent; border-radius: 3px; }
.kv-prompt { flex: 1 1 260px; font-size: 15px; padding: 3px 6px; min-width: 0; }
.kv-num { width: 4.5em; font-size: 15px; }
.kv-message { font-size: 14px; }
`;

function kvChatStyle() {
  if (document.getElementById("kv-chat-style")) return;
  const s = kvEl("style", null, document.head, KV_CHAT_CSS);
  s.id = "kv-chat-style";
}

function kvChatPanel(parent, model) {
  const box = kvEl("div", "kv-chatlog", parent);
  const turns = kvEl("div", "kv-turns", box);
  kvEl("div", "kv-title", box, "block tables");
  const tables = kvEl("div", "kv-tables", box);
  const hitRgb = KV_RGB.CACHED, copyRgb = KV_FLASH_RGB[1];
  kvLegend(box, [["HIT", "prefix hit: served by the cache, not recomputed", "outline", hitRgb],
    ["SHARED", "shared: 2 or more references (×n)", "ramp", KV_RGB.ALLOC1, KV_RGB.ALLOC8],
    ["COPIED", "copied on write", "outline", copyRgb]]);

  function chip(parent, f, b, isHit, isCopied) {
    const c = kvEl("span", "kv-chip", parent, String(b) + (f.refcount[b] >= 2 ? ` ×${f.refcount[b]}` : ""));
    const rgb = f.state[b] === 2 ? kvMix(KV_RGB.ALLOC1, KV_RGB.ALLOC8, Math.min(Math.max(f.refcount[b], 1) - 1, 7) / 7)
      : KV_RGB[KV_STATES[f.state[b]]];
    c.style.background = kvCss(rgb);
    c.style.color = f.state[b] === 2 && f.refcount[b] > 2 ? "#fff" : "#111";
    if (isHit) c.style.borderColor = kvCss(hitRgb);
    if (isCopied) c.style.borderColor = kvCss(copyRgb);
    c.dataset.block = b;
    c.dataset.refs = f.refcount[b];
    c.dataset.hit = isHit ? "1" : "0";
    c.dataset.shared = f.refcount[b] >= 2 ? "1" : "0";
    c.dataset.copied = isCopied ? "1" : "0";
    c.title = kvInfoText(kvBlockInfo(f, b));
  }

  function draw(hist, i) {
    const f = hist[i], chat = f.tail.chat || { turns: [], tables: [] };
    const scrolled = turns.scrollTop + turns.clientHeight >= turns.scrollHeight - 4;
    turns.replaceChildren();
    if (!chat.turns.length) kvEl("div", "kv-explain", turns, "Ask a question: the answer streams in while the pool fills.");
    chat.turns.forEach((t, k) => {
      const turn = kvEl("div", "kv-turn", turns);
      turn.dataset.turn = k;
      kvEl("div", "kv-you", turn, `you: ${t.prompt}`);
      t.answers.forEach((a, j) => {
        const who = t.answers.length === 1 ? "model" : `answer ${j + 1}`;
        kvEl("div", "kv-answer" + (t.live ? " kv-live" : ""), turn, `${who}: ${a}`);
      });
      kvEl("div", "kv-status", turn, t.status);
    });
    if (scrolled) turns.scrollTop = turns.scrollHeight;
    tables.replaceChildren();
    const copied = new Set((chat.copied || []).map(([j, pos]) => `${j}:${pos}`)); // [answer, position, block]
    const last = chat.turns[chat.turns.length - 1];
    if (!chat.tables.length) kvEl("div", "kv-explain", tables, "no request yet");
    else if (last && !last.live) kvEl("div", "kv-explain", tables, "at the last token (the request has ended: its " +
      "blocks are released, full ones stay cached)");
    chat.tables.forEach((table, j) => {
      const row = kvEl("div", "kv-table", tables);
      row.dataset.answer = j;
      kvEl("span", null, row, chat.tables.length === 1 ? "request:" : `answer ${j + 1}:`);
      if (!table.length) kvEl("span", "kv-explain", row, "ended (blocks released)");
      table.forEach((b, pos) => chip(row, f, b, pos < (chat.hit_blocks || 0), copied.has(`${j}:${pos}`)));
    });
  }
  return { draw };
}

function kvChatPanels(body, model) {
  kvChatStyle();
  body.classList.add("kv-chat");
  const left = kvEl("div", "kv-col", body), right = kvEl("div", "kv-col", body);
  return [kvPoolPanel(left, model, 480), kvChatPanel(right, model)];
}

function kvChatControls(top, model) {
  kvChatStyle();
  const row = kvEl("div", "kv-controls kv-chat-form", top);
  const prompt = kvEl("input", "kv-prompt", row);
  prompt.type = "text"; prompt.placeholder = "Ask the model something"; prompt.setAttribute("aria-label", "question");
  const field = (words, min, max, step, key) => {
    const lab = kvEl("label", "kv-field", row, words + " ");
    const inp = kvEl("input", "kv-num", lab);
    inp.type = "number"; inp.min = min; inp.max = max; inp.step = step; inp.dataset.key = key;
    return inp;
  };
  const n = field("answers", 1, 8, 1, "n"), temp = field("temperature", 0, 2, 0.1, "temperature");
  const send = kvEl("button", "kv-btn", row, "Send"), stop = kvEl("button", "kv-btn", row, "Stop");
  send.dataset.ctl = "send"; stop.dataset.ctl = "stop";
  stop.title = "stop the answer (its blocks are released)";
  const msg = kvEl("span", "kv-message", row);
  const go = () => {
    if (model.get("busy")) return;
    model.send({ type: "send", prompt: prompt.value, n: Number(n.value), temperature: Number(temp.value) });
  };
  send.onclick = go;
  prompt.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); go(); } });
  stop.onclick = () => model.send({ type: "control", action: "stop" });
  function sync() {
    row.style.display = model.get("interactive") ? "" : "none"; // a replay has no kernel to ask
    n.value = model.get("n") ?? 1; temp.value = model.get("temperature") ?? 0;
    const busy = !!model.get("busy");
    send.disabled = busy; stop.disabled = !busy;
    send.textContent = busy ? "answering…" : "Send";
    msg.textContent = model.get("message") || "";
    if (busy && row.dataset.busy === "0") prompt.value = ""; // the question was taken: ready for the next one
    row.dataset.busy = busy ? "1" : "0";
  }
  for (const t of ["busy", "interactive", "n", "temperature", "message"]) model.on(`change:${t}`, sync);
  sync();
  return {};
}
