"""The ChatView in Chromium: its module in the harness page with recorded frames (the answer token by token, block
table chips in their grid cells' colours, prefix hits, sharing and copy-on-write marked, the controls sending a
question, hidden in a replay), and end to end in JupyterLab with the real model: type a question, press Send, the
answer streams in while the pool grid changes, a cell runs while the answer streams (the turn is a task on the
kernel's loop), and a second turn with two answers shows prefix hits shared by the forks and a copy on write."""
from __future__ import annotations

import base64
import re

import pytest
from conftest import wait_until

from kvlab import ChatSession, TinyLlama
from kvlab.viz.browser import open_notebook, run_cell, write_notebook
from kvlab.viz.chat import ChatView
from kvlab.viz.palette import FLASH_RGB, STATE_RGB

pytestmark = pytest.mark.browser
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5]


def recorded_chat() -> ChatView:
    v = ChatView(ChatSession(TinyLlama(), num_blocks=32, block_size=4), max_new_tokens=6)
    v.ask(PROMPT)
    v.ask(PROMPT, n=2, temperature=1.0, seed=0)
    return v


def mount(page, frames, state: str = "{}") -> None:
    page.evaluate(f"async () => {{ window.m = await kvt.mount('chat', {state}); }}")
    for f in frames:
        page.evaluate("(s) => m.push(kvt.b64(s))", base64.b64encode(f).decode())


def chips(page) -> list[dict]:
    return page.evaluate("() => [...document.querySelectorAll('.kv-chip')].map(c => ({...c.dataset, "
                         "bg: getComputedStyle(c).backgroundColor, border: getComputedStyle(c).borderTopColor}))")


def rgb(c) -> str:
    return f"rgb({c[0]}, {c[1]}, {c[2]})"


def test_the_chat_module_draws_the_answer_tables_and_marks_hits_sharing_and_copies(harness):
    v = recorded_chat()
    frames = list(v.recording)
    start = len(frames) - 1 - 1 - 6  # turn 2: its question, six tokens, its end
    mount(harness, frames[:start + 2], "{interactive: true, n: 1, temperature: 0, busy: false, message: ''}")
    text = harness.locator(".kv-turns").inner_text()
    assert "你 (you)：token ids 3 1 4 1 5 9 2 6 5" in text
    assert "回答 1 (answer)：" in text and "回答 2 (answer)：" in text
    got = chips(harness)  # the first token: two forks share the prompt's blocks, two of them prefix hits
    assert [c["block"] for c in got[:3]] == [c["block"] for c in got[3:]]
    assert [c["hit"] for c in got] == ["1", "1", "0"] * 2 and {c["shared"] for c in got} == {"1"}
    assert all(c["refs"] == "2" for c in got) and got[0]["border"] == rgb(STATE_RGB["CACHED"])
    shade = [round(a + (b - a) / 7) for a, b in zip(STATE_RGB["ALLOC1"], STATE_RGB["ALLOC8"])]
    assert got[0]["bg"] == rgb(shade)  # the chip has its grid cell's colour (refcount 2)
    mount_more = frames[start + 2]
    harness.evaluate("(s) => m.push(kvt.b64(s))", base64.b64encode(mount_more).decode())
    got = chips(harness)  # both appended into the shared tail: one copied it
    copied = [c for c in got if c["copied"] == "1"]
    assert len(copied) == 1 and copied[0]["border"] == rgb(FLASH_RGB[1]) and copied[0]["refs"] == "1"
    for f in frames[start + 3:]:
        harness.evaluate("(s) => m.push(kvt.b64(s))", base64.b64encode(f).decode())
    assert "分叉出 2 个回答，1 个块写时复制" in harness.locator(".kv-status").nth(1).inner_text()
    sizes = harness.evaluate("() => [...document.querySelectorAll('.kv-root *')].filter(e => [...e.childNodes]"
                             ".some(n => n.nodeType === 3 && n.textContent.trim())).map(e => "
                             "parseFloat(getComputedStyle(e).fontSize))")
    assert min(sizes) >= 14
    # the controls: a question typed and sent (Enter or the button) goes to the kernel as one message
    harness.fill(".kv-prompt", "hello there")
    harness.click("[data-ctl=send]")
    assert harness.evaluate("() => m.sent.filter(s => s.type === 'send')") == [
        {"type": "send", "prompt": "hello there", "n": 1, "temperature": 0}]
    # a replay (no session) hides them, and its player steps back through the tokens
    harness.evaluate("() => { document.getElementById('app').innerHTML = ''; }")
    mount(harness, frames)
    assert not harness.locator(".kv-chat-form").is_visible()
    harness.locator(".kv-slider").fill(str(start + 2))
    assert len(harness.locator(".kv-answer").nth(1).inner_text().split("：", 1)[1].split()) == 2  # two tokens


def test_an_exported_chat_replays_offline(open_offline, tmp_path):
    v = recorded_chat()
    path = v.export_html(tmp_path / "chat.html")
    page, outside = open_offline(path)
    page.wait_for_selector(f".kv-root[data-index='{len(v.recording) - 1}']")  # opens on the end of the chat
    assert page.locator(".kv-turn").count() == 2 and page.locator(".kv-answer").count() == 3
    assert "1 个块写时复制" in page.locator(".kv-status").nth(1).inner_text()
    assert not page.locator(".kv-chat-form").is_visible()  # no kernel to ask
    page.locator(".kv-slider").fill("2")  # the first token of the first answer
    assert page.locator(".kv-turn").count() == 1 and len(page.locator(".kv-answer").inner_text().split()) == 2
    assert outside == [], outside
    page.close()


NOTEBOOK = [
    "import kvlab\n"
    "model = kvlab.load_model('smollm2-135m', progress=False)\n"
    "session = kvlab.ChatSession(model, num_blocks=48, system='You are a helpful assistant.')\n"
    "view = kvlab.ChatView(session, max_new_tokens=64)\n"
    "view",
    "print('ALIVE', view.busy, len(view.turns))",
    "print('DONE', view.frames_sent, len(view.recording), [t['status'] for t in view.turns])",
]


def data(page) -> dict:
    return page.evaluate("() => ({...document.querySelector('.jp-OutputArea-output .kv-root').dataset})")




@pytest.mark.llm
def test_send_streams_an_answer_while_the_pool_fills_in_jupyterlab(browser, lab, tmp_path):
    write_notebook(lab["work"] / "chat.ipynb", NOTEBOOK)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    open_notebook(page, lab["url"], "chat.ipynb")
    run_cell(page, 0)
    root = page.locator(".jp-OutputArea-output .kv-root")
    root.wait_for(timeout=120_000)
    grid = "() => document.querySelector('.jp-OutputArea-output .kv-root').kv.panels[0].canvas.toDataURL()"
    empty = page.evaluate(grid)

    page.locator(".kv-prompt").fill("Tell me a story about a cat.")
    page.locator("[data-ctl=send]").click()
    page.locator(".kv-chat-form[data-busy='1']").wait_for(timeout=60_000)  # the kernel took the question
    run_cell(page, 1)  # and takes this cell between two tokens of the answer
    answer = page.locator(".kv-answer").first
    wait_until(lambda: len(answer.inner_text()) > len("model: ") + 10, 60, "answer text")
    alive = page.locator(".jp-OutputArea-output pre", has_text="ALIVE")
    alive.wait_for(timeout=60_000)
    assert alive.inner_text().strip() == "ALIVE True 1", alive.inner_text()
    wait_until(lambda: page.locator(".kv-chat-form").get_attribute("data-busy") == "0",
               120, "the end of the answer")
    status = page.locator(".kv-status").first  # the last frame was sent before busy fell; it draws on the next paint
    wait_until(lambda: "(generated)" in status.inner_text(), 10, "the final status line")
    assert re.search(r"提示 \d+ 个 token，其中 0 个来自缓存、不重算", status.inner_text())
    assert page.evaluate(grid) != empty  # the grid changed: the prompt's and answer's blocks are cached now
    wait_until(lambda: data(page)["framesReceived"] == data(page)["framesSent"], 30, "every frame sent")
    page.locator(".jp-OutputArea-output .kv-root").first.screenshot(path=str(tmp_path / "chat_turn1.png"))

    # a second turn, two answers: the earlier conversation is a prefix hit, the forks share it, one copies
    page.locator("[data-key=n]").fill("2")
    page.locator("[data-key=temperature]").fill("0.7")
    page.locator(".kv-prompt").fill("What is the capital of France?")
    page.locator(".kv-prompt").press("Enter")
    wait_until(lambda: page.locator(".kv-status").count() == 2 and "(generated)" in
               page.locator(".kv-status").nth(1).inner_text(), 120, "the second answer")
    status = page.locator(".kv-status").nth(1).inner_text()
    hit = int(re.search(r"其中 (\d+) 个来自缓存", status).group(1))
    assert hit >= 32 and "分叉出 2 个回答，1 个块写时复制" in status, status
    assert page.locator(".kv-answer").count() == 3
    shared = page.evaluate("""() => {  // the first frame of turn 2 with both forks' tables: show it
      const root = document.querySelector('.jp-OutputArea-output .kv-root'), hist = root.kv.hist;
      const i = hist.findIndex(f => f.tail.chat && f.tail.chat.turns.length === 2 && f.tail.tables
                                    && f.tail.tables.rows.length === 2
                                    && f.tail.tables.rows.every(r => r.blocks.length));
      if (i >= 0) root.kv.show(i);
      return i;
    }""")
    assert shared >= 0
    got = chips(page)
    assert any(c["hit"] == "1" and c["shared"] == "1" and int(c["refs"]) >= 2 for c in got), got
    page.locator(".jp-OutputArea-output .kv-root").first.screenshot(path=str(tmp_path / "chat_turn2.png"))
    run_cell(page, 2)
    done = page.locator(".jp-OutputArea-output pre", has_text="DONE")
    done.wait_for(timeout=60_000)
    assert "copied on write" in done.inner_text()
    assert not errors, errors
    page.close()
