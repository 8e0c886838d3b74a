"""Hooks and listeners that raise.

Every hook is told, even when another raises. The pool's hook lists (``evict_hooks``, ``relocation_hooks``,
``stale_hooks``) are how the block tables, the prefix index, the metrics and the views follow the pool; when one
hook raises, the others must still run, or a table names a block that is now FREE (and soon someone else's K/V).
Here a raising hook sits *first* in each list, before the sequence manager's and the prefix cache's own: the error
reaches the caller, and the tables, the index and every byte of K/V are as if no hook had failed.

An event subscriber only watches, and one that raises stops nothing: the call that published completes, the
subscriber is unsubscribed, and its error is logged and kept (before, the error left the caller half-way: a
freed sequence still holding its blocks, an appended block nobody held)."""
from __future__ import annotations

import logging

import pytest
import torch

from _util import assert_same_state, pool_state, small_spec
from kvlab import BlockPool, DefragmentationStrategy, EventRecorder, FastBlockPool, KVSpec, PyFastBlockPool
from kvlab.fast.pool import COMPILED
from kvlab.core.sequence import SequenceManager

POOLS = [BlockPool, PyFastBlockPool, *([FastBlockPool] if COMPILED else [])]


class HookFailed(Exception):
    pass


def _raiser(calls: list):
    def hook(*args):
        calls.append(args)
        raise HookFailed(args)
    return hook


def _sequences(pool_cls, num_blocks=48):
    """A pool with storage, a sequence manager with a prefix cache and four sequences of random K/V (one
    forked), grown in turn so their tables interleave; the second is freed, leaving holes."""
    spec = small_spec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    pool = pool_cls(num_blocks, spec=spec)
    mgr = SequenceManager(pool, prefix_cache=True)
    gen = torch.Generator().manual_seed(7)
    seqs = [mgr.create(list(range(100 * i, 100 * i + 8))) for i in range(4)]
    for s in seqs:
        s.append(list(range(100 * s.seq_id, 100 * s.seq_id + 8)))
    for step in range(4):
        for s in seqs:
            slots = s.append([1000 + step] * 3)
            for layer in range(spec.num_layers):
                k, v = (torch.randn(3, 2, 8, generator=gen).to(spec.device) for _ in range(2))
                pool.storage.write_slots(layer, slots, k, v)
    seqs.append(seqs[0].fork())
    seqs.pop(1).free()
    return pool, mgr, seqs


def _kv(pool, seqs) -> list[torch.Tensor]:
    """Every sequence's K/V, read through its block table."""
    return [pool.storage.kv[:, :, torch.tensor(s.block_table)].clone() for s in seqs]


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_a_relocation_hook_that_raises_leaves_every_table_following_its_blocks(cls):
    pool, mgr, seqs = _sequences(cls)
    before = _kv(pool, seqs)
    calls: list = []
    pool.relocation_hooks.insert(0, _raiser(calls))
    with pytest.raises(HookFailed):
        DefragmentationStrategy(pool).defragment(force=True)
    assert len(calls) == 1 and len(calls[0][0])  # told once, of the moves made
    mgr.check_invariants()  # the tables name the blocks their data moved to
    pool.storage.kv[:, :, torch.tensor(calls[0][0])] = float("nan")  # the vacated sources
    assert all(torch.equal(a, b) for a, b in zip(before, _kv(pool, seqs)))


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_an_evict_hook_that_raises_leaves_the_prefix_index_in_step(cls):
    pool, mgr, seqs = _sequences(cls)
    for s in seqs:
        mgr.cache_full_blocks(s)
    for s in seqs[1:]:
        s.free()
    cached = pool.num_cached_blocks
    calls: list = []
    pool.evict_hooks.insert(0, _raiser(calls))
    with pytest.raises(HookFailed):
        pool.allocate(pool.num_free_blocks + 1)  # one victim: the hook raises on it
    assert len(calls) == 1 and pool.num_cached_blocks == cached - 1
    assert not mgr.prefix_cache.holds(calls[0][0])  # the cache heard of it too
    mgr.check_invariants()


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_a_stale_hook_that_raises_still_lets_the_prefix_cache_drop_its_entries(cls):
    pool, mgr, seqs = _sequences(cls)
    mgr.cache_full_blocks(seqs[0])
    held = [b for b in seqs[0].block_table if mgr.prefix_cache.holds(b)]
    assert held
    calls: list = []
    pool.stale_hooks.insert(0, _raiser(calls))
    with pytest.raises(HookFailed):
        pool.mark_reusable(held, False)
    assert calls == [(held,)]
    assert not any(mgr.prefix_cache.holds(b) for b in held)
    mgr.check_invariants()


def _workload(pool_cls, *subscribers):
    """Sequence calls that publish every kind of event a sequence makes (allocations, frees, references, copies
    on write, swaps), with ``subscribers`` subscribed first and a recorder after them."""
    pool = pool_cls(24, spec=KVSpec(block_size=4), with_storage=False)
    mgr = SequenceManager(pool)
    for fn in subscribers:
        pool.events.subscribe(fn)
    rec = EventRecorder(pool.events)
    seqs = [mgr.create() for _ in range(3)]
    for s in seqs:
        s.append(5)
    seqs[0].append(4)
    seqs[1].free()
    child = seqs[2].fork()
    child.append(2)  # copy on write of the shared last block
    seqs[0].swap_out()
    seqs[0].swap_in()
    mgr.check_invariants()
    return pool, mgr, rec


def _sequences_of(mgr):
    return [(s.seq_id, list(s.block_table), s.num_tokens, s.alive) for s in mgr.seqs.values()]


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_a_listener_that_raises_stops_no_pool_call(cls, caplog):
    """A student's listener that reads ``e.block_id`` (only some events have it) raises on the first event. Every
    call completes as without it: the same pool, the same sequences, and the recorder subscribed after it gets
    every event. It is unsubscribed after that first event; its error is kept and logged with the event."""
    seen = []

    def wrong(e):
        seen.append(e)
        return e.block_id
    with caplog.at_level(logging.ERROR, logger="kvlab.core.events"):
        pool, mgr, rec = _workload(cls, wrong)
    clean_pool, clean_mgr, clean_rec = _workload(cls)
    assert_same_state(pool_state(pool), pool_state(clean_pool))
    assert _sequences_of(mgr) == _sequences_of(clean_mgr)
    assert [e.as_dict() for e in rec] == [e.as_dict() for e in clean_rec] and len(rec) > 10
    assert len(seen) == 1 and wrong not in pool.events
    (fn, event, error), = pool.events.failures
    assert fn is wrong and event is seen[0] and isinstance(error, AttributeError)
    assert event.as_dict() == rec.events[0].as_dict()  # kept intact, though the pool publishes on
    (record,), = [[r for r in caplog.records if r.name == "kvlab.core.events"]]
    assert record.levelno == logging.ERROR and "unsubscribed" in record.getMessage()
    assert record.exc_info[1] is error


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_every_subscriber_hears_an_event_before_the_ones_that_raised_leave(cls):
    """Two raising listeners around a healthy one: all three hear the first event, the two leave, the healthy
    one hears everything; a listener subscribed twice is unsubscribed twice."""
    heard: dict[str, int] = {"a": 0, "ok": 0, "b": 0}

    def listener(name, fails):
        def fn(e):
            heard[name] += 1
            if fails:
                raise ValueError(name)
        return fn
    a, ok, b = listener("a", True), listener("ok", False), listener("b", True)
    pool = cls(8, with_storage=False)
    for fn in (a, ok, b, b):
        pool.events.subscribe(fn)
    pool.free(pool.allocate(2))
    assert heard == {"a": 1, "ok": 2, "b": 2} and list(pool.events) == [ok]
    assert [str(x) for _, _, x in pool.events.failures] == ["a", "b", "b"]
    first, *_ = (e for _, e, _ in pool.events.failures)  # kept intact while the pool published on
    assert (first.kind, first.step, first.block_ids, first.strategy) == ("Allocated", 1, (0, 1), "free")


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_ctrl_c_in_a_listener_still_stops_the_call(cls):
    """Only an ``Exception`` is an observer's bug to survive: a KeyboardInterrupt raised in a listener reaches the
    caller, and the listener stays subscribed."""
    def interrupted(e):
        raise KeyboardInterrupt
    pool = cls(8, with_storage=False)
    pool.events.subscribe(interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.allocate(1)
    assert list(pool.events) == [interrupted] and not pool.events.failures
