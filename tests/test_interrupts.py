"""Interrupting a cell never corrupts state: a real SIGINT is raised (from a ``sys.settrace`` hook) at every line
kvlab runs during a mutation, and each time the call either completed or changed nothing, the caller gets a
clean KeyboardInterrupt, invariants hold and K/V already written reads back bitwise (kvlab/core/interrupts.py)."""
from __future__ import annotations

import datetime
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist

import kvlab
from kvlab import BlockPool, FastBlockPool, KVSpec, Request, SequenceManager
from kvlab.core.interrupts import install
from kvlab.distributed import Link, TransferError, decode_rank, prefill_rank
from kvlab.distributed.disagg import DECODE, PREFILL, make_manager
from kvlab.serve.engine import Engine

from _util import pool_state, same_state

KVLAB = os.path.dirname(kvlab.__file__)
CFG = kvlab.TinyConfig()
BATCHES = [[[(7 * i + j) % CFG.vocab_size for j in range(40 + 9 * i)] for i in range(3)] for _ in range(2)]
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, device="cpu")


def _lines(op: Callable[[], Any], fire_at: int | None) -> int:
    """Run ``op`` counting the lines kvlab runs; at line ``fire_at`` send this process a SIGINT."""
    seen = 0

    def local(frame, event, arg):
        nonlocal seen
        if event == "line":
            seen += 1
            if seen == fire_at:
                signal.raise_signal(signal.SIGINT)  # handled here, inside this hook: unlike a real interrupt,
                return frame.f_trace  # so keep what the handler set on the frame (this hook returns it)
        return local

    def global_(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(KVLAB) else None

    sys.settrace(global_)
    try:
        op()
    finally:
        sys.settrace(None)
    return seen


def interrupt_everywhere(build: Callable[[], tuple[Any, Callable[[Any], Any], Callable[[Any], Any]]],
                         stride: int = 1) -> int:
    """``build()`` gives (world, op, state): ``op(world)`` the mutation, ``state(world)`` what must be as before or
    as after a whole call. Interrupts it at every ``stride``-th line; returns the lines tried."""
    assert install(), "kvlab's SIGINT handler must be installable in the main thread"
    world, op, state = build()
    before_clean = state(world)
    n = _lines(lambda: op(world), None)
    after_clean = state(world)
    assert n > 0
    for k in range(1, n + 1, stride):
        world, op, state = build()
        assert same(state(world), before_clean)
        with pytest.raises(KeyboardInterrupt):
            _lines(lambda: op(world), k)
        got = state(world)
        assert same(got, before_clean) or same(got, after_clean), f"line {k} of {n}: a half-done call"
    return n


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and len(a) == 5 and isinstance(a[0], dict):  # a pool_state
        return same_state(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _manager_state(mgr: SequenceManager) -> tuple:
    seqs = tuple((s.seq_id, tuple(s.block_table), s.num_tokens, None if s.token_ids is None else tuple(s.token_ids),
                  s.cached_blocks, s.alive, None if s.swapped is None else tuple(s.swapped.positions))
                 for s in mgr.seqs.values())
    cache = mgr.prefix_cache.entries() if mgr.prefix_cache is not None else None
    return pool_state(mgr.pool), seqs, str(cache)


@pytest.mark.parametrize("cls", [BlockPool, FastBlockPool])
def test_allocate_under_eviction_completes_or_changes_nothing(cls):
    def build():
        pool = cls(8, spec=SPEC)
        ids = pool.allocate(6)
        pool.mark_reusable(ids)
        pool.free(ids)  # six cached blocks: the next allocation evicts
        return pool, lambda p: p.allocate(5), pool_state

    assert interrupt_everywhere(build) > 20


@pytest.mark.parametrize("cls", [BlockPool, FastBlockPool])
def test_an_append_that_copies_on_write_completes_or_changes_nothing(cls):
    """The reported case: an append interrupted between the table switch and the copy lost a sequence's K/V."""
    def build():
        pool = cls(16, spec=SPEC)
        mgr = SequenceManager(pool)
        parent = mgr.create([])
        slots = parent.append([1, 2, 3, 4, 5, 6])
        kv = torch.arange(6, dtype=torch.float32)[:, None, None].expand(-1, 1, 2).contiguous()
        pool.storage.write_slots(0, slots, kv, -kv)
        child = mgr.fork(parent)

        def op(m):
            m.append_batch([child, parent], [[7], [8]])
            m.check_invariants()

        return mgr, op, _manager_state

    assert interrupt_everywhere(build) > 20


def test_swap_out_and_in_complete_or_change_nothing():
    """The reported case: an interrupted swap_out left an EVICTING block in a live block table."""
    def build(swap_in=False):
        pool = BlockPool(16, spec=SPEC)
        mgr = SequenceManager(pool)
        seq = mgr.create([])
        slots = seq.append(list(range(10)))
        kv = torch.arange(10, dtype=torch.float32)[:, None, None].expand(-1, 1, 2).contiguous()
        pool.storage.write_slots(0, slots, kv, kv)
        if swap_in:
            mgr.swap_out(seq)
        return mgr, (lambda m: m.swap_in(seq)) if swap_in else (lambda m: m.swap_out(seq)), _manager_state

    interrupt_everywhere(build)
    interrupt_everywhere(lambda: build(swap_in=True))


def test_registering_in_the_prefix_cache_completes_or_changes_nothing():
    def build():
        pool = BlockPool(16, spec=SPEC)
        mgr = SequenceManager(pool, prefix_cache=True)
        seq = mgr.create(list(range(13)))
        seq.append(list(range(13)))
        return mgr, lambda m: m.cache_full_blocks(seq), _manager_state

    interrupt_everywhere(build)


def test_an_engine_step_completes_or_changes_nothing_and_the_run_finishes():
    """The reported case: an interrupted engine could not finish afterwards (OutOfBlocksError)."""
    def build():
        reqs = [Request(i, 0.0, 9, 3, prompt_tokens=tuple(range(i, i + 9))) for i in range(3)]
        e = Engine(reqs, num_blocks=12, block_size=4, max_model_len=16)
        e.step()

        def state(eng):
            return (eng.step_count, eng.finished_count, len(eng.running), eng.num_waiting,
                    _manager_state(eng.memory.manager))

        return e, lambda eng: eng.step(), state

    interrupt_everywhere(build, stride=3)
    e, op, _ = build()
    with pytest.raises(KeyboardInterrupt):
        _lines(lambda: op(e), 40)
    e.check_invariants()
    assert e.run(max_steps=100)["finished"] == 3


def test_outside_kvlab_an_interrupt_is_raised_at_once():
    assert install()
    hit = []
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        hit.append("after")  # never reached: the handler raised at once, as Python's own does
    assert hit == []


def _rank_interrupted_at(here: int, fire_at: int | None) -> tuple[int, bool]:
    """Rank ``here`` (PREFILL or DECODE) on the main thread, the one signals reach, the other in a thread, over
    one gloo pair; a SIGINT at kvlab's line ``fire_at`` of rank ``here``. Checks what each side holds after;
    returns (lines run, whether rank ``here`` was interrupted)."""
    store, timeout = dist.HashStore(), 30.0  # bounds only a failure; a loaded CI once needed more than 10 s to connect
    managers = {PREFILL: make_manager(CFG, 16, 128), DECODE: make_manager(CFG, 16, 128)}
    calls = {PREFILL: lambda link: prefill_rank(link, BATCHES, manager=managers[PREFILL]),
             DECODE: lambda link: decode_rank(link, manager=managers[DECODE], max_new_tokens=2)}
    there = DECODE if here == PREFILL else PREFILL
    result: dict[str, Any] = {}

    def other() -> None:
        group = dist.ProcessGroupGloo(store, there, 2, datetime.timedelta(seconds=timeout))
        try:
            result["out"] = calls[there](Link(group, there, 2, timeout))
        except BaseException as e:  # noqa: BLE001 - judged below
            result["error"] = e

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    group = dist.ProcessGroupGloo(store, here, 2, datetime.timedelta(seconds=timeout))
    link = Link(group, here, 2, timeout)
    try:
        seen = _lines(partial(calls[here], link), fire_at)
        interrupted = False
    except KeyboardInterrupt:
        seen, interrupted = fire_at or 0, True
    mine, theirs = managers[here], managers[there]
    mine.check_invariants()
    assert len(mine) == 0, f"line {fire_at}: the interrupted rank still holds sequences"
    kv = mine.pool.storage_of().kv.clone()
    link.abort()
    del link, group  # closing its sockets is what wakes a peer blocked on this rank (abort alone does not)
    gc.collect()
    thread.join(timeout + 5)
    assert not thread.is_alive()
    assert "out" in result or isinstance(result.get("error"), TransferError), result
    theirs.check_invariants()
    assert len(theirs) == 0
    assert torch.equal(mine.pool.storage_of().kv, kv), "a message landed after the interrupt"
    return seen, interrupted


@pytest.mark.parametrize("here", [PREFILL, DECODE], ids=["prefill rank", "decode rank"])
def test_a_disaggregated_step_interrupted_anywhere_frees_it_on_both_ranks(here):
    """A KV transfer interrupted at any line of one rank (its connector calls, the driver between them, the
    model): that rank gives back every sequence, no posted receive lands later, and the other rank stops with a
    TransferError (or finishes) holding nothing."""
    assert install()
    n, _ = _rank_interrupted_at(here, None)
    assert n > 100
    outcomes = [_rank_interrupted_at(here, k)[1] for k in range(1, n + 1, max(1, n // 40))]
    assert any(outcomes)  # some interrupts land between calls, and are raised there


def test_an_interrupted_live_run_pauses_shows_the_exact_pool_and_goes_on():
    """A cell running ``LiveRun.run`` interrupted at any line: the run is paused, the last frame sent shows the
    pool exactly as it is, the pool's invariants hold, and ``run()`` then finishes the workload."""
    from kvlab.viz.frames import decode_frame, frame_of
    from kvlab.viz.live import LiveRun, RandomWorkload

    class Sink:
        def __init__(self) -> None:
            self.frames: list[bytes] = []

        def show_frame(self, frame) -> None:
            self.frames.append(frame.data)

    def blocks(data: bytes) -> tuple:
        f = decode_frame(data)
        return tuple(f.state.tolist()), tuple(f.refcount.tolist())

    def build() -> tuple[BlockPool, LiveRun, Sink]:
        pool = BlockPool(24, with_storage=False)
        sink = Sink()
        return pool, LiveRun(pool, RandomWorkload(pool, seed=5, steps=12), [sink], fps=1e9), sink

    assert install()
    n = _lines(build()[1].run, None)
    assert n > 100
    interrupted = 0
    for k in range(1, n + 1, max(1, n // 60)):
        pool, run, sink = build()
        try:
            _lines(run.run, k)
            continue  # the interrupt came after the run's last line
        except KeyboardInterrupt:
            interrupted += 1
        pool.check_invariants()
        assert run.state in ("paused", "done") or run.state == "idle" and run.steps == 0, k
        assert run.state == "idle" or blocks(sink.frames[-1]) == blocks(frame_of(pool).data), f"line {k}: stale"
        run.run()
        assert run.state == "done"
        assert blocks(sink.frames[-1]) == blocks(frame_of(pool).data)
        pool.check_invariants()
    assert interrupted > 30
