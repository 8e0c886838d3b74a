// ChatView: the pool grid (kvPoolPanel) beside the conversation. Every frame's tail carries the chat as it stood
// (tail.chat: turns with prompt, answers and status line; tail.tables: the block tables of the latest request), so
// the player and an exported replay step through the answer token by token. The tables are drawn by kvTableRows
// (blocktable.js, shared with the BlockTableView): a chip per entry in its grid cell's colour, entries the prefix
// cache served, entries shared by two or more references and blocks copied on write marked.
// The controls (prompt, answers, temperature, Send, Stop) send messages; the kernel answers between two tokens.

const KV_CHAT_CSS = `
.kv-chat > .kv-col { flex: 1 1 380px; }
.kv-chat .kv-turns { max-height: 420px; overflow: auto; display: flex; flex-direction: column; gap: 6px; }
.kv-chat .kv-you { font-weight: 600; }
.kv-chat .kv-answer { white-space: pre-wrap; font-size: 15px; }
.kv-chat .kv-answer.kv-live::after { content: "\\258D"; }
.kv-chat .kv-status { font-size: 14px; color: #333; border-left: 3px solid #888; padding-left: 6px; }
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
  kvEl("div", "kv-title", box, "块表 (block tables)");
  const tables = kvEl("div", "kv-tables", box);
  kvTableLegend(box, false);

  function draw(hist, i) {
    const f = hist[i], chat = f.tail.chat || { turns: [] };
    const scrolled = turns.scrollTop + turns.clientHeight >= turns.scrollHeight - 4;
    turns.replaceChildren();
    if (!chat.turns.length) kvEl("div", "kv-explain", turns, "问一个问题：回答逐字出现，池随之填满。(Ask a question.)");
    chat.turns.forEach((t, k) => {
      const turn = kvEl("div", "kv-turn", turns);
      turn.dataset.turn = k;
      kvEl("div", "kv-you", turn, `你 (you)：${t.prompt}`);
      t.answers.forEach((a, j) => {
        const who = t.answers.length === 1 ? "模型 (model)" : `回答 ${j + 1} (answer)`;
        kvEl("div", "kv-answer" + (t.live ? " kv-live" : ""), turn, `${who}：${a}`);
      });
      kvEl("div", "kv-status", turn, t.status);
    });
    if (scrolled) turns.scrollTop = turns.scrollHeight;
    const shown = kvTableRows(tables, f, false, "已结束，块已释放 (ended)").length;
    const last = chat.turns[chat.turns.length - 1];
    if (!shown && !tables.childElementCount) kvEl("div", "kv-explain", tables, "还没有请求 (no request yet)");
    else if (last && !last.live) tables.prepend(kvEl("div", "kv-explain", null, "停在最后一个 token：请求已结束，" +
      "它的块已释放，装满的块留作缓存 (at the last token)"));
  }
  return { draw };
}

function kvChatPanels(body, model) {
  kvChatStyle();
  kvTableStyle();
  body.classList.add("kv-chat");
  const left = kvEl("div", "kv-col", body), right = kvEl("div", "kv-col", body);
  return [kvPoolPanel(left, model, 480), kvChatPanel(right, model)];
}

function kvChatControls(top, model, ask) {
  kvChatStyle();
  const row = kvEl("div", "kv-controls kv-chat-form", top);
  const prompt = kvEl("input", "kv-prompt", row);
  prompt.type = "text"; prompt.placeholder = "问模型一个问题 (ask the model)"; prompt.setAttribute("aria-label", "question");
  const field = (words, min, max, step, key) => {
    const lab = kvEl("label", "kv-field", row, words + " ");
    const inp = kvEl("input", "kv-num", lab);
    inp.type = "number"; inp.min = min; inp.max = max; inp.step = step; inp.dataset.key = key;
    return inp;
  };
  const n = field("回答数 answers", 1, 8, 1, "n"), temp = field("温度 temperature", 0, 2, 0.1, "temperature");
  const send = kvEl("button", "kv-btn", row, "发送 Send"), stop = kvEl("button", "kv-btn", row, "停止 Stop");
  send.dataset.ctl = "send"; stop.dataset.ctl = "stop";
  stop.title = "停止回答，它的块被释放 (stop the answer)";
  const msg = kvEl("span", "kv-message", row);
  const go = () => {
    if (model.get("busy")) return;
    ask({ type: "send", prompt: prompt.value, n: Number(n.value), temperature: Number(temp.value) });
  };
  send.onclick = go;
  prompt.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); go(); } });
  stop.onclick = () => ask({ type: "control", action: "stop" });
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
