"""kvlab.viz.chat.ChatView without a browser: a frame per token with the chat in its tail, prefix hits, forks with
copy-on-write and evictions counted from the pool's events, the asyncio turn a Send click starts (and its Stop),
replays and the exported page, the PNG fallback, and bad input refused with the view unchanged.

The machinery runs on the tiny random model (token-id prompts, no tokenizer); the words (a chat template, an
end-of-turn token, a right answer) run the real SmolLM2-135M, loaded once (tests marked ``llm``)."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import re

import pytest

import kvlab
from _util import assert_same_state, pool_state
from kvlab import BlockPool, ChatSession, ConfigError, TinyLlama
from kvlab.viz import PoolView, decode_frame
from kvlab.viz.chat import ChatView, plot_chat

TINY = TinyLlama()
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # 9 tokens: with blocks of 4, the third block holds one prompt token
OTHER = [7, 7, 8, 8, 6, 6, 2, 2, 4]


def tiny_view(num_blocks: int = 32, max_new_tokens: int = 6, **kw) -> ChatView:
    return ChatView(ChatSession(TINY, num_blocks=num_blocks, block_size=4), max_new_tokens=max_new_tokens, **kw)


def chats(view: ChatView) -> list[dict]:
    return [decode_frame(f).tail["chat"] for f in view.recording]


def tables(data: bytes) -> list[dict]:
    """The block-table rows a chat frame carries (tail["tables"], as a BlockTableView reads them)."""
    return decode_frame(data).tail["tables"]["rows"]


def assert_clean(view: ChatView) -> None:
    pool = view.session.pool
    assert not pool.arrays.refcount.any() and len(view.session.manager) == 0
    pool.check_invariants()


def test_a_turn_records_a_frame_per_token_with_the_chat_in_its_tail():
    v = tiny_view()
    reply = v.ask(PROMPT)
    assert len(v.recording) == 1 + 1 + 6 + 1  # shown, the question, each token, the end of the turn
    frames = [decode_frame(f) for f in v.recording]
    assert all(f.num_blocks == 32 and "chat" in f.tail for f in frames)
    last = frames[-1].tail["chat"]
    assert last["turns"] == [{"prompt": "token ids 3 1 4 1 5 9 2 6 5", "answers": [" ".join(map(str, reply.tokens))],
                              "status": last["turns"][0]["status"], "live": False}]
    assert "提示 9 个 token，其中 0 个来自缓存" in last["turns"][0]["status"] and "共生成 6 个 token（length）" in \
        last["turns"][0]["status"]
    answers = [c["turns"][0]["answers"][0] for c in chats(v)[2:-1]]
    assert [len(a.split()) for a in answers] == [1, 2, 3, 4, 5, 6]  # streamed token by token
    assert all(c["turns"][0]["live"] for c in chats(v)[1:-1])
    assert tables(v.recording[len(v.recording) - 2])[0]["blocks"] == [0, 1, 2, 3]  # 9 + 5 fed tokens: four blocks
    assert frames[-2].state[:4].tolist() == [2] * 4 and frames[-2].refcount[:4].tolist() == [1] * 4
    assert frames[-1].state[:3].tolist() == [4] * 3  # released: the full blocks stay cached
    # sent paced, the last always: what the browser has is the newest frame
    assert 2 <= v.frames_sent <= len(v.recording) and v.frame == v.recording[len(v.recording) - 1]
    assert not v.busy and v.n == 1 and v.temperature == 0.0
    assert_clean(v)


def test_a_second_turn_hits_the_cache_and_forks_share_with_refcount_two():
    v = tiny_view()
    v.ask(PROMPT)
    start = len(v.recording)
    reply = v.ask(PROMPT, n=2, temperature=1.0, seed=0)
    assert reply.prefix_hit_tokens == 8 and reply.cow_copies == 1
    turn = chats(v)[-1]["turns"][1]
    assert "提示 9 个 token，其中 8 个来自缓存、不重算" in turn["status"]
    assert "分叉出 2 个回答，1 个块写时复制" in turn["status"] and len(turn["answers"]) == 2
    first = decode_frame(v.recording[start + 1])  # after prefill and the fork, the first token sampled
    rows = tables(first.data)
    tail = rows[0]["blocks"][2]  # the block of the prompt's last token, computed (not a hit)
    assert [r["label"] for r in rows] == ["回答 1 answer", "回答 2 answer"] and [r["hits"] for r in rows] == [2, 2]
    assert [r["blocks"] for r in rows] == [[0, 1, tail]] * 2 and [r["copied"] for r in rows] == [[], []]
    assert first.refcount[[0, 1, tail]].tolist() == [2, 2, 2] and first.state[[0, 1, tail]].tolist() == [2, 2, 2]
    copied = decode_frame(v.recording[start + 2])  # both appended into the shared tail: one copied it first
    rows = tables(copied.data)
    (j,) = [j for j, r in enumerate(rows) if r["copied"]]
    block = rows[j]["blocks"][2]
    assert rows[j]["copied"] == [2] and block != tail and rows[1 - j]["blocks"][2] == tail
    assert copied.refcount[[0, 1]].tolist() == [2, 2] and copied.refcount[[tail, block]].tolist() == [1, 1]
    assert_clean(v)


def test_a_tiny_pool_evicts_cached_blocks_and_the_status_counts_them():
    v = tiny_view(num_blocks=5, max_new_tokens=4)
    evicted = []
    v.session.pool.events.subscribe(lambda e: evicted.append(e) if isinstance(e, kvlab.core.events.Evicted) else None)
    v.ask(PROMPT)  # 12 tokens fed: 3 blocks cached afterwards
    v.ask(OTHER)   # another prompt needs 3 blocks of the 2 free: cached ones go
    assert evicted and f"淘汰了 {len(evicted)} 个缓存块" in \
        chats(v)[-1]["turns"][1]["status"]
    assert "淘汰了 0 个缓存块" in chats(v)[-1]["turns"][0]["status"]
    assert decode_frame(v.recording[len(v.recording) - 1]).tail["evictions_total"] == len(evicted)
    assert_clean(v)


def test_send_runs_the_turn_as_a_task_that_yields_between_tokens_and_stop_ends_it():
    v = tiny_view(max_new_tokens=24)

    async def main():
        ticks = 0

        async def other():  # another coroutine on the loop (a click, a cell) runs while the answer streams
            nonlocal ticks
            while v.busy:
                ticks += 1
                await asyncio.sleep(0)

        v._on_msg(v, {"type": "send", "prompt": PROMPT, "n": 2, "temperature": 0.5}, [])
        assert v.busy and v.task is not None and v.n == 2 and v.temperature == 0.5
        watcher = asyncio.ensure_future(other())
        reply = await v.task
        await watcher
        assert ticks >= 10 and reply is not None and len(reply.all_tokens) == 2
        v._on_msg(v, {"type": "send", "prompt": OTHER, "n": 1, "temperature": 0}, [])
        for _ in range(5):
            await asyncio.sleep(0)
        v._on_msg(v, {"type": "control", "action": "stop"}, [])  # the Stop button
        with pytest.raises(asyncio.CancelledError):
            await v.task

    asyncio.run(main())
    status = chats(v)[-1]["turns"][1]["status"]
    assert "stopped before the end" in status and not v.busy and v.message == ""
    assert v.frame == v.recording[len(v.recording) - 1]
    assert_clean(v)  # the stopped request's blocks were released


def test_replays_export_and_the_png_fallback(tmp_path):
    v = tiny_view()
    v.ask(PROMPT)
    v.ask(PROMPT, n=2, temperature=1.0, seed=1)
    replay = ChatView(recording=v.recording)
    assert replay.frame == v.recording[len(v.recording) - 1] and not replay.interactive
    assert len(replay.history) == len(v.recording)
    assert PoolView(recording=v.recording).frames_sent == len(v.recording)  # chat frames are pool frames
    page = v.export_html(tmp_path / "chat.html").read_text()
    frames = json.loads(re.search(r'<script id="kvlab-frames" type="application/json">(.*?)</script>', page,
                                  re.S).group(1))
    assert [base64.b64decode(s) for s in frames] == list(v.recording)
    assert "kvChatPanels" in page and "kvPoolPanel" in page
    data, _ = v._repr_mimebundle_()
    assert base64.b64decode(data["image/png"])[:4] == b"\x89PNG"
    assert plot_chat(v.recording[0])._repr_png_()[:4] == b"\x89PNG"  # before any question
    with pytest.raises(ConfigError, match="replays a recording"):
        replay.ask(PROMPT)


def test_a_notebook_run_headless_saves_the_final_chat(tmp_path):
    """nbclient (as ``kvlab html`` runs the chapters): the view shown, then asked in later cells. The saved PNG is
    the final picture, and the stored widget state's frame holds the whole conversation for the static page."""
    import nbformat
    from nbclient import NotebookClient

    cells = ["import kvlab, base64\nview = kvlab.ChatView(kvlab.ChatSession(kvlab.TinyLlama(), num_blocks=32, "
             "block_size=4), max_new_tokens=4)\nfirst = view._repr_mimebundle_()[0]['image/png']\nview",
             f"view.ask({PROMPT})\nview.ask({PROMPT}, n=2, temperature=1.0, seed=0).cow_copies",
             "import hashlib\nlast = view._repr_mimebundle_()[0]['image/png']\n"
             "print(last != first, len(view.recording), hashlib.sha256(last.encode()).hexdigest())"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, kernel_name="python3", timeout=120, store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    (shown,), (cows,), (printed,) = (c.outputs for c in nb.cells)
    changed, frames, digest = printed["text"].split()
    assert cows["data"]["text/plain"] == "1" and changed == "True" and frames == str(1 + 2 * (1 + 4 + 1))
    assert hashlib.sha256(shown["data"]["image/png"].encode()).hexdigest() == digest  # redrawn: the final chat
    states = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"].values()
    (chat,) = [w for w in states if w["state"].get("interactive")]
    (buf,) = [b for b in chat["buffers"] if b["path"] == ["frame"]]
    turns = decode_frame(base64.b64decode(buf["data"])).tail["chat"]["turns"]
    assert len(turns) == 2 and "1 个块写时复制" in turns[1]["status"]


def test_the_view_is_a_lazy_name_of_kvlab():
    assert kvlab.ChatView is kvlab.viz.ChatView is ChatView


BAD_ASKS = [
    ({"prompt": ""}, "empty"), ({"prompt": "   "}, "empty"), ({"prompt": []}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": None}, "prompt"), ({"prompt": "hello"}, "no tokenizer"),
    ({"n": 0}, "n .answers. must be a positive int, got 0"), ({"n": 9}, "at most 8, got 9"),
    ({"n": 1.5}, "got 1.5"), ({"n": True}, "got True"),
    ({"temperature": -1}, "temperature .* got -1"), ({"temperature": math.nan}, "got nan"),
    ({"temperature": "0.5"}, "got '0.5'"), ({"seed": -1}, "seed"),
]


@pytest.mark.parametrize("kw,words", BAD_ASKS, ids=lambda x: repr(x) if isinstance(x, dict) else "")
def test_bad_input_is_refused_by_name_and_changes_nothing(kw, words):
    v = tiny_view()
    v.ask(PROMPT)
    before = (pool_state(v.session.pool), len(v.recording), v.frames_sent, json.dumps(v.turns), v.n, v.temperature)
    kw = dict(kw)
    prompt = kw.pop("prompt", PROMPT)
    with pytest.raises(ConfigError, match=words):
        v.ask(prompt, **kw)
    after = (pool_state(v.session.pool), len(v.recording), v.frames_sent, json.dumps(v.turns), v.n, v.temperature)
    assert_same_state(before[0], after[0])
    assert before[1:] == after[1:] and not v.busy
    if "seed" not in kw:  # the browser's Send: the refusal is shown, nothing else changes
        msg = {"type": "send", "prompt": prompt, "n": 1, "temperature": 0.0, **kw}

        async def click():  # as in a kernel: the message is handled on its running loop
            v._on_msg(v, msg, [])

        asyncio.run(click())
        assert re.search(words, v.message) and v.task is None and len(v.recording) == before[1]


@pytest.mark.parametrize("args,kw", [
    ((), {}), (("session",), {}), ((BlockPool(16, with_storage=False),), {}), ((None,), {"recording": []}),
    ((ChatSession(TINY, num_blocks=8),), {"recording": [b"x"]}), ((ChatSession(TINY, num_blocks=8),), {"n": 0}),
    ((ChatSession(TINY, num_blocks=8),), {"temperature": -0.5}),
    ((ChatSession(TINY, num_blocks=8),), {"max_new_tokens": 0}), ((ChatSession(TINY, num_blocks=8),), {"history": 1}),
    ((ChatSession(TINY, num_blocks=8),), {"fps": 0}),
], ids=repr)
def test_bad_views_are_refused(args, kw):
    with pytest.raises(ConfigError):
        ChatView(*args, **kw)


def test_submit_needs_a_running_loop_and_changes_nothing_without_one():
    v = tiny_view()
    with pytest.raises(ConfigError, match="running event loop"):
        v.submit(PROMPT)
    assert len(v.recording) == 1 and not v.turns and not v.busy and v.task is None


def test_bad_defaults_set_from_python_are_refused():
    v = tiny_view()
    for name, value in (("n", 0), ("n", 9), ("temperature", -1.0), ("temperature", math.inf)):
        with pytest.raises(ConfigError, match=name):
            setattr(v, name, value)
    assert v.n == 1 and v.temperature == 0.0


def test_a_pool_too_small_fails_the_turn_and_the_view_goes_on():
    v = tiny_view(num_blocks=3, max_new_tokens=8)
    with pytest.raises(kvlab.OutOfBlocksError):
        v.ask(PROMPT)  # 9 + 7 fed tokens need 4 blocks
    assert "failed: the pool (3 blocks" in chats(v)[-1]["turns"][0]["status"] and not v.busy
    assert_clean(v)
    assert len(v.ask(PROMPT[:5], n=1).tokens) == 8  # 12 tokens: 3 blocks


# ---------------------------------------------------------------------------------------------------- the real model
@pytest.mark.llm
def test_a_real_chat_streams_words_hits_the_system_prompt_and_forks(smol):
    s = ChatSession(smol, num_blocks=64, system="You are a helpful assistant.")
    v = ChatView(s, max_new_tokens=12, history=False)
    first = v.ask("What is the capital of France?")
    assert "Paris" in first.text
    answers = [c["turns"][0]["answers"][0] for c in chats(v)[2:-1]]
    assert answers[-1] == first.text and len(answers) >= 5 and answers[0] != answers[-1]  # it streamed
    start = len(v.recording)
    second = v.ask("What is the capital of Germany?", n=2, temperature=0.7, seed=0)
    assert second.prefix_hit_tokens == 16 and second.cow_copies == 1
    turn = chats(v)[-1]["turns"][1]
    assert f"提示 {second.prompt_tokens} 个 token，其中 16 个来自缓存、不重算" in turn["status"]
    assert "分叉出 2 个回答，1 个块写时复制" in turn["status"] and turn["answers"] == second.texts
    shared = decode_frame(v.recording[start + 1])  # the first token: both forks hold the prompt's blocks
    rows = tables(shared.data)
    assert [r["hits"] for r in rows] == [1, 1] and rows[0]["blocks"][0] == rows[1]["blocks"][0]
    assert shared.refcount[rows[0]["blocks"][0]] == 2  # the prefix hit, shared by the two forks
    assert "Paris" in v.figure().axes[1].texts[0].get_text()  # the PNG fallback shows the answer
    assert_clean(v)
