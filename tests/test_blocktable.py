"""Block tables in frames (kvlab.viz.tables) and the BlockTableView, without a browser.

The tail's rows are held against what the sequences say, computed here independently: the tables themselves, the
prefix hits from the engine's ``Admitted`` events (or the prompt a test wrote to share), the copies on write from
the pool's ``CopiedOnWrite`` events, and who shares a block from the frame's refcounts (a fork shares at refcount
2, the copy leaves both at 1). Bad input is refused by name with nothing changed."""
from __future__ import annotations

import base64
import json
import re

import pytest
from matplotlib.text import Text

import kvlab
from _util import assert_same_state, pool_state
from kvlab import BlockPool, ChatSession, ConfigError, Engine, EngineConfig, KVSpec, SequenceManager, TinyLlama
from kvlab.core.events import EventRecorder
from kvlab.core.sequence import CopiedOnWrite
from kvlab.serve.events import Admitted
from kvlab.viz import (BlockTables, BlockTableView, LiveRun, PoolView, decode_frame, export_html, frame_of,
                       frame_tables, plot_block_table)
from kvlab.viz.chat import ChatView
from kvlab.viz.static import MIN_PT
from kvlab.viz.tables import MAX_ROW_BLOCKS, MAX_ROWS

B = 4  # tokens per block
PROMPT = list(range(10))  # two full blocks and two tokens: a later prompt alike hits the two full blocks


def pool_and_manager(n: int = 16) -> tuple[BlockPool, SequenceManager]:
    pool = BlockPool(n, spec=KVSpec(block_size=B), with_storage=False)
    return pool, SequenceManager(pool, prefix_cache=True)


def sharing_steps(mgr: SequenceManager) -> list:
    """The PagedAttention story, one operation a step: a prompt computed and cached, the same prompt again (two
    prefix-hit blocks), a fork of it (every block shared), the fork's first append (its shared, partly filled
    tail is copied on write), one more token each."""
    seqs: dict[str, kvlab.Sequence] = {}

    def first() -> None:
        seqs["a"] = mgr.create(PROMPT)
        seqs["a"].append(PROMPT)
        mgr.cache_full_blocks(seqs["a"])

    def hit() -> None:
        seqs["b"] = mgr.create(PROMPT)
        seqs["b"].append(PROMPT[seqs["b"].num_tokens:])

    def fork() -> None:
        seqs["c"] = seqs["b"].fork()

    return [first, hit, fork, lambda: seqs["c"].append([99]), lambda: mgr.append_batch([seqs["b"], seqs["c"]],
                                                                                       [[7], [8]])]


def expected(mgr: SequenceManager, copies: dict[int, set[int]], hits: dict[int, int]) -> list[dict]:
    """The rows, computed from the sequences themselves."""
    return [{"id": s.seq_id, "label": f"序列 {s.seq_id} seq", "blocks": list(s.block_table),
             "hits": hits.get(s.seq_id, 0),
             "copied": sorted(p for p, b in enumerate(s.block_table) if b in copies.get(s.seq_id, set())), "more": 0}
            for s in mgr.seqs.values()]


def test_the_tail_follows_a_prefix_hit_a_fork_and_a_copy_on_write():
    pool, mgr = pool_and_manager()
    cows = EventRecorder(pool.events, (CopiedOnWrite,))
    with BlockTables(mgr) as tables:
        frames = []
        for step in sharing_steps(mgr):
            step()
            frames.append(frame_of(pool, **tables.tail()))
    copies: dict[int, set[int]] = {}
    for e in cows.events:
        copies.setdefault(e.seq_id, set()).add(e.dst)
    hits = {1: 2, 2: 2}  # seq 1 hit the two full blocks of seq 0's prompt; its fork holds the same two
    assert [r["hits"] for r in frames[1].tail["tables"]["rows"]] == [0, 2]
    assert frames[-1].tail["tables"] == {"rows": expected(mgr, copies, hits), "left_out": 0}
    shared, cow = (f.tail["tables"]["rows"] for f in frames[2:4])  # after the fork, after its first append
    tail = shared[1]["blocks"][2]  # seq 1's partly filled last block, computed (not a hit)
    assert shared[2]["blocks"] == shared[1]["blocks"] == [0, 1, tail] and frames[2].refcount[tail] == 2
    assert frames[2].refcount[[0, 1]].tolist() == [3, 3]  # the hits: held by seqs 0, 1 and the fork
    assert [r["copied"] for r in shared] == [[], [], []]
    (e,) = cows.events
    assert (e.seq_id, e.src) == (2, tail) and cow[2]["blocks"] == [0, 1, e.dst] and cow[2]["copied"] == [2]
    assert cow[1]["blocks"] == [0, 1, tail] and cow[1]["copied"] == []
    assert frames[3].refcount[[tail, e.dst]].tolist() == [1, 1]  # the copy left both private
    assert frames[4].tail["tables"]["rows"][2]["copied"] == [2]  # the copy stays marked while it is there


def test_a_copy_is_forgotten_once_its_entry_names_another_block():
    pool, mgr = pool_and_manager()
    with BlockTables(mgr) as tables:
        for step in sharing_steps(mgr)[:4]:
            step()
        assert tables.tail()["tables"]["rows"][2]["copied"] == [2]
        c = mgr.seqs[2]
        c.block_table[2] = c.block_table[1]  # as if the block were swapped for an equal cached one
        assert tables.tail()["tables"]["rows"][2]["copied"] == []
        c.block_table[2] = 4  # restore, so the manager frees what it holds
    mgr.free(c)


def test_engine_rows_are_its_requests_with_the_hits_they_were_admitted_with():
    wl = kvlab.make_workload("chat", 40, seed=3, rate=200.0)
    eng = Engine(wl, EngineConfig(num_blocks=512, block_size=16, max_batched_tokens=1024))
    admitted: dict[int, int] = {}
    eng.events.subscribe(lambda e: admitted.__setitem__(e.request_id, e.cached_tokens)
                         if isinstance(e, Admitted) else None)
    with BlockTables(eng) as tables:
        seen_hit = seen_more = 0
        while eng.step():
            rows = tables.tail()["tables"]
            jobs = [*eng.running, *eng.swapped]
            assert rows["left_out"] == max(0, len(jobs) - MAX_ROWS)
            want = [(j.req.id, f"请求 {j.req.id} request", j.kv.block_table[:MAX_ROW_BLOCKS], admitted[j.req.id] // 16,
                     max(0, len(j.kv.block_table) - MAX_ROW_BLOCKS)) for j in jobs[:MAX_ROWS]]
            assert [(r["id"], r["label"], r["blocks"], r["hits"], r["more"]) for r in rows["rows"]] == want
            seen_hit += any(r["hits"] for r in rows["rows"])
            seen_more += rows["left_out"] > 0
    assert seen_hit and seen_more  # prefix hits and more requests than rows both happened


def test_a_view_of_an_engine_follows_its_live_run():
    eng = Engine(kvlab.make_workload("chat", 12, seed=1, rate=100.0), EngineConfig(num_blocks=256, block_size=16))
    view = BlockTableView(eng)
    run = view.live(eng.step, fps=1e6, max_steps=30)
    run.run()
    frames = [decode_frame(f) for f in run.recording]
    assert len(frames) == 31 and all("tables" in f.tail for f in frames)
    labels = {r["label"] for f in frames for r in f.tail["tables"]["rows"]}
    assert labels and all(re.fullmatch(r"请求 \d+ request", x) for x in labels)
    want = [j.kv.block_table for j in [*eng.running, *eng.swapped]][:MAX_ROWS]
    assert [r["blocks"] for r in frames[-1].tail["tables"]["rows"]] == want
    assert view.latest().data == run.recording[len(run.recording) - 1]
    view.close()


def test_rows_are_bounded_and_say_what_was_left_out():
    pool = BlockPool(4096, spec=KVSpec(block_size=1), with_storage=False)
    mgr = SequenceManager(pool)
    seqs = [mgr.create() for _ in range(MAX_ROWS + 3)]
    seqs[0].append(MAX_ROW_BLOCKS + 5)
    with BlockTables(mgr, max_rows=MAX_ROWS) as tables:
        t = tables.tail()["tables"]
    assert len(t["rows"]) == MAX_ROWS and t["left_out"] == 3
    assert t["rows"][0]["blocks"] == seqs[0].block_table[:MAX_ROW_BLOCKS] and t["rows"][0]["more"] == 5
    with BlockTables(mgr, max_rows=2) as tables:
        assert [len(tables.tail()["tables"]["rows"]), tables.tail()["tables"]["left_out"]] == [2, MAX_ROWS + 1]


def test_a_swapped_out_entry_is_minus_one():
    pool, mgr = pool_and_manager()
    s = mgr.create()
    s.append(6)
    s.swap_out()
    with BlockTables(mgr) as tables:
        f = frame_of(pool, **tables.tail())
    rows, _ = frame_tables(f)
    assert rows[0].blocks == [-1, -1]
    fig = plot_block_table(f)  # drawn as "host", without a line
    assert any(t.get_text() == "主机\nhost" for t in fig.findobj(Text))


def live_recording() -> tuple[BlockPool, BlockTableView, LiveRun]:
    """A view of a manager following a live run of :func:`sharing_steps`, one step a call, run to the end."""
    pool, mgr = pool_and_manager()
    view = BlockTableView(mgr)
    steps = iter(sharing_steps(mgr))

    def one() -> bool:
        step = next(steps, None)
        if step is not None:
            step()
        return step is not None

    run = view.live(one, fps=1e6)  # every step's frame is due
    run.run()
    return pool, view, run


def test_a_view_follows_its_run_and_replays_and_exports_the_tables(tmp_path):
    pool, view, run = live_recording()
    assert run.state == "done" and all("tables" in decode_frame(f).tail for f in run.recording)
    last = decode_frame(run.recording[len(run.recording) - 1])
    assert [r["copied"] for r in last.tail["tables"]["rows"]] == [[], [], [2]]
    assert view.frame == run.recording[len(run.recording) - 1]  # the view was sent what the run built
    replay = BlockTableView(recording=run.recording)
    assert replay.frames_sent == len(run.recording) and replay.latest().tail == last.tail
    assert base64.b64decode(replay._repr_mimebundle_()[0]["image/png"])[:4] == b"\x89PNG"
    page = export_html(run.recording, tmp_path / "bt.html", view="blocktable").read_text()
    frames = json.loads(re.search(r'<script id="kvlab-frames" type="application/json">(.*?)</script>', page,
                                  re.S).group(1))
    assert [base64.b64decode(s) for s in frames] == list(run.recording)
    assert "kvBlockTablePanel" in page and "kvTableRows" in page
    assert PoolView(recording=run.recording).frames_sent == len(run.recording)  # still pool frames
    assert pool.events  # the view's tables listen for copies on write ...
    view.close()
    assert not pool.events  # ... until it is closed (the run's builder closed when the run ended)


def test_a_view_of_a_chat_draws_every_frame_the_chat_shows():
    chat = ChatView(ChatSession(TinyLlama(), num_blocks=32, block_size=4), max_new_tokens=4)
    view = BlockTableView(chat)
    chat.ask([3, 1, 4, 1, 5, 9, 2, 6, 5])
    chat.ask([3, 1, 4, 1, 5, 9, 2, 6, 5], n=2, temperature=1.0, seed=0)
    assert view.frame == chat.frame and len(view.history) == chat.frames_sent
    rows, _ = frame_tables(view.latest())
    assert [r.label for r in rows] == ["回答 1 answer", "回答 2 answer"] and [r.hits for r in rows] == [2, 2]
    assert sum(bool(r.copied) for r in rows) == 1  # the one copy on write of turn 2
    replay = BlockTableView(recording=chat.recording)  # a chat's recording is a block-table recording
    assert replay.frames_sent == len(chat.recording)
    view.close()
    assert view not in chat.mirrors


def test_the_still_is_readable_and_has_no_empty_panel():
    _, _, run = live_recording()
    for data in (run.recording[len(run.recording) - 1], run.recording[0]):
        fig = plot_block_table(data)
        fig.canvas.draw()
        sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        assert sizes and min(sizes) >= MIN_PT
        for ax in fig.axes:
            assert ax.patches or ax.images or ax.lines or ax.texts, ax
    f = decode_frame(run.recording[len(run.recording) - 1])
    fig = plot_block_table(f)
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == sum(len(r["blocks"]) for r in
                                                                   f.tail["tables"]["rows"])
    words = " ".join(t.get_text() for t in fig.findobj(Text))
    assert "写时复制 (copied on write)" in words and "前缀命中" in words
    assert "0\n×3" in words  # seqs 0, 1, 2 share block 0
    empty = plot_block_table(BlockPool(16, with_storage=False))  # no tables: the grid alone, and why
    assert len(empty.axes) == 1 and "不带块表 (no block tables)" in empty.axes[0].get_title()


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make,words", [
    (lambda p, m: BlockTables(42), "not 42"),
    (lambda p, m: BlockTables(m, max_rows=0), "max_rows must be a positive int, got 0"),
    (lambda p, m: BlockTables(m, max_rows=2.0), "max_rows must be a positive int, got 2.0"),
    (lambda p, m: BlockTables(m, pool=p), "brings its own pool, got pool=BlockPool"),
    (lambda p, m: BlockTables(lambda: [], pool="pool"), "need pool=, the BlockPool they live in, got 'pool'"),
    (lambda p, m: BlockTables(Engine([], EngineConfig(memory="contiguous"))), "memory='contiguous'"),
    (lambda p, m: BlockTableView(), "give one, got None"),
    (lambda p, m: BlockTableView(m, recording=[frame_of(p).data]), "give one"),
    (lambda p, m: BlockTableView(m, max_rows=-1), "max_rows must be a positive int, got -1"),
    (lambda p, m: BlockTableView(p), r"not BlockPool\(16 blocks"),
    (lambda p, m: BlockTableView(ChatView(recording=[frame_of(p).data])), "replays a recording"),
    (lambda p, m: plot_block_table(42), "got int"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_refused_by_name_and_changes_nothing(make, words):
    pool, mgr = pool_and_manager()
    for step in sharing_steps(mgr)[:3]:
        step()
    before, listeners = pool_state(pool), list(pool.events)
    with pytest.raises(ConfigError, match=words):
        make(pool, mgr)
    assert_same_state(before, pool_state(pool))
    assert list(pool.events) == listeners  # nothing was left listening


@pytest.mark.parametrize("rows,words", [
    ([(0, "seq 0", [0, 99], 0)], r"row 0 must be .* got \(0, 'seq 0', \[0, 99\], 0\)"),  # block 99 of 16
    (5, "return a list of rows, got 5"),
    ([(0, "x", [0], -1)], r"row 0 must be .* got \(0, 'x', \[0\], -1\)"),
    ([(0, "x", [0], 0), (1.0, "y", [], 0)], r"row 1 must be .* got \(1.0, 'y', \[\], 0\)"),
])
def test_bad_rows_from_a_function_are_refused_when_read_and_change_nothing(rows, words):
    pool, mgr = pool_and_manager()
    for step in sharing_steps(mgr)[:4]:  # one copy on write, seen by the tables below
        step()
    answer = {"rows": [(2, "seq 2", mgr.seqs[2].block_table, 2)]}
    with BlockTables(lambda: answer["rows"], pool=pool) as tables:
        tables.tail()
        answer["rows"] = rows
        before = (pool_state(pool), list(tables.copied))
        with pytest.raises(ConfigError, match=words):
            tables.tail()
        assert_same_state(before[0], pool_state(pool))
        assert tables.copied == before[1]


@pytest.mark.parametrize("tables", [
    "junk", {"rows": "x", "left_out": 0}, {"rows": [], "left_out": -1}, {"rows": [{"id": 0}], "left_out": 0},
    {"rows": [{"id": 0, "label": "s", "blocks": [16], "hits": 0, "copied": [], "more": 0}], "left_out": 0},
    {"rows": [{"id": 0, "label": "s", "blocks": [0], "hits": 0, "copied": [1], "more": 0}], "left_out": 0},
    {"rows": [{"id": 0, "label": "s", "blocks": [0], "hits": 0, "copied": [], "more": 0, "x": 1}], "left_out": 0},
])
def test_a_recording_with_bad_tables_is_refused_and_the_view_is_unchanged(tables):
    pool, mgr = pool_and_manager()
    good = frame_of(pool, tables={"rows": [], "left_out": 0}).data
    bad = frame_of(pool, tables=tables)
    with pytest.raises(ConfigError, match="tail\\['tables'\\]|block-table row 0"):
        frame_tables(bad)
    view = BlockTableView(recording=[good])
    with pytest.raises(ConfigError, match="frame 1 of the recording"):
        view.load([good, bad.data])
    assert view.frames_sent == 1 and len(view.history) == 1 and view.frame == good
    with pytest.raises(ConfigError):
        BlockTableView(recording=[bad.data])


def test_the_view_is_a_lazy_name_of_kvlab():
    assert kvlab.BlockTableView is kvlab.viz.BlockTableView is BlockTableView
