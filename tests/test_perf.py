"""The fast pools (kvlab.fast.pool) against the reference BlockPool on random operation sequences.

``PyFastBlockPool`` serves ``allocate(n)`` and ``free(ids)`` with inlined one-block paths and, from 9 base
blocks on, a few numpy calls (slices when the ids form a run); ``FastBlockPool`` does the same in C where kvlab
was compiled. After every step both pools must hold identical metadata, free stacks, evictable sets, counters,
clocks and events, return the same ids and raise the same errors with the same messages.
"""
from __future__ import annotations

import gc
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab import (Allocated, BlockPool, Cached, Evicted, DoubleFreeError, EventRecorder, FastBlockPool, Freed,
                   IllegalTransitionError, KVLabError, KVSpec, RefChanged, UnknownBlockError)
from kvlab.core.eviction import OPTPolicy
from kvlab.fast.pool import COMPILED, FastPrefixCache, FastSequenceManager, PyFastBlockPool, PyFastSequenceManager
import kvlab.core.prefix as prefix_mod
from kvlab.core.prefix import PrefixCache
from kvlab.core.sequence import Sequence, SequenceManager

from _util import assert_same_state, pool_state

N = 512


def outcome(pool: BlockPool, op: str, *args, **kw):
    try:
        return getattr(pool, op)(*args, **kw)
    except KVLabError as e:
        return type(e), str(e)


def ids_strategy(held: list[int], batches: list[list[int]]) -> st.SearchStrategy[list]:
    """Lists the batch paths must handle: whole allocations (often runs), subsets, shuffles, repeats, stale
    and foreign ids."""
    run = st.integers(0, N - 10).flatmap(lambda lo: st.integers(1, min(200, N - lo)).map(
        lambda k: list(range(lo, lo + k))))
    picked = st.lists(st.sampled_from(held), min_size=9, max_size=120, unique=True) if len(held) >= 9 else run
    whole = st.sampled_from(batches) if batches else run
    spoilt = st.tuples(picked, st.sampled_from([N, 10**12, -1, "7", 1.0, None]), st.integers(0, 32)).map(
        lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:])
    repeated = picked.map(lambda ids: ids + ids[:1])
    return st.one_of(whole, whole, whole, picked, picked.map(sorted), run, repeated, spoilt)


FAST = [FastBlockPool, PyFastBlockPool] if COMPILED else [PyFastBlockPool]
ODD = [0, -1, True, 1.0, np.int64(2), "2", None, 2**63]  # what the fast paths must hand to the reference


@pytest.mark.parametrize("sizes", [None, [4, 8, 16]], ids=["uniform", "size-classes"])
@pytest.mark.parametrize("cls", FAST, ids=lambda c: c.__name__)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fast_pool_equals_the_reference(cls, sizes, data):
    """Same return values, errors and messages, metadata, free stacks, evictable set, counters, clock and
    events after every step, with and without a subscriber (the compiled path publishes events itself); with
    ``guarded`` an evict guard vetoes every third block and an evict hook records what it is told. Both are drawn
    per example (about 30 examples each of the four pairs; as four parametrized cases of 60 they took a minute)."""
    listen = data.draw(st.booleans(), label="listen")
    guarded = data.draw(st.booleans(), label="guarded")
    kw0 = dict(with_storage=False) if sizes is None else dict(with_storage=False, block_sizes=sizes)
    fast, ref = cls(N, **kw0), BlockPool(N, **kw0)
    told: dict[int, list[int]] = {id(fast): [], id(ref): []}
    if guarded:
        for pool in (fast, ref):
            pool.evict_guard = lambda b: b % 3 != 0
            pool.evict_hooks.append(told[id(pool)].append)
    if listen:
        rec_fast, rec_ref = EventRecorder(fast.events), EventRecorder(ref.events)
    held: list[int] = []
    batches: list[list[int]] = []  # allocations of 9 or more blocks still fully held
    for _ in range(data.draw(st.integers(5, 25), label="steps")):
        op = data.draw(st.sampled_from(["allocate", "allocate", "free", "free", "incref", "mark_reusable", "decref",
                                        "set_token_count", "touch", "evict", "reserve", "set_token_counts",
                                        "set_owner", "unmark"]))
        if op in ("allocate", "reserve") or not held:
            op = "allocate" if op != "reserve" else op
            n = data.draw(st.one_of(st.integers(1, 150), st.sampled_from(ODD)), label="n")
            form = data.draw(st.sampled_from(["positional", "owner", "owner-odd", "size_class"]))
            args, kw = (n,), {}
            if form == "owner":
                kw = {"owner": data.draw(st.integers(-1, 3))}
            elif form == "owner-odd":
                kw = {"owner": data.draw(st.sampled_from([-2, 2**31, True, np.int32(1), "x"]))}
            elif form == "size_class":
                kw = {"size_class": data.draw(st.sampled_from([0, 1, 2, True]))}
        elif op == "set_token_count":
            args, kw = (data.draw(st.sampled_from(held)), data.draw(st.integers(0, fast.block_size))), {}
        elif op in ("incref", "mark_reusable", "decref", "touch"):
            args, kw = (data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=8)),), {}
        elif op == "unmark":
            op, args, kw = "mark_reusable", (data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=8)),
                                             False), {}
        elif op == "set_token_counts":
            ids = data.draw(st.lists(st.one_of(st.sampled_from(held), st.sampled_from(ODD)), max_size=12))
            count = st.one_of(st.integers(0, fast.block_size + 1), st.sampled_from([-1, True, 1.0, None]))
            args, kw = (ids, data.draw(st.lists(count, min_size=len(ids), max_size=len(ids) + 1))), {}
        elif op == "set_owner":
            ids = data.draw(st.lists(st.one_of(st.sampled_from(held), st.sampled_from(ODD)), max_size=12))
            args, kw = (ids, data.draw(st.one_of(st.integers(-1, 5), st.sampled_from([-2, 2**31, True])))), {}
        elif op == "evict":
            args, kw = (), {}
        else:
            args, kw = (data.draw(ids_strategy(held, batches), label="ids"),), {}
        got, want = outcome(fast, op, *args, **kw), outcome(ref, op, *args, **kw)
        assert got == want, (op, args, kw)
        assert_same_state(pool_state(ref), pool_state(fast))
        assert told[id(fast)] == told[id(ref)]
        if listen:
            assert rec_fast.events == rec_ref.events
        fast.check_invariants()
        if op in ("allocate", "reserve") and isinstance(got, list):
            if op == "reserve":
                fast.commit(got)
                ref.commit(got)
            held.extend(got)
            batches.append(got)
        held = [b for b in held if fast.arrays.refcount[b] > 0]
        batches = [ids for ids in batches if len(ids) >= 9 and (fast.arrays.refcount[ids] > 0).all()]


MANAGERS = [(PyFastSequenceManager, PyFastBlockPool)] + ([(FastSequenceManager, FastBlockPool)] if COMPILED else [])


def manager_state(mgr: SequenceManager) -> tuple:
    """Every sequence's fields, and the prefix cache's entries and counters."""
    seqs = tuple((s.seq_id, tuple(s.block_table), s.num_tokens, None if s.token_ids is None else tuple(s.token_ids),
                  s.num_cached_tokens, s.cached_blocks, s.prefix_hash, s.cacheable, s.alive,
                  None if s.swapped is None else (tuple(s.swapped.positions), tuple(s.swapped.tokens)))
                 for s in mgr.seqs.values())
    c = mgr.prefix_cache
    return seqs, c.entries(), c.get_stats(), tuple(c.reuse_gaps)


def feed(data, tracks: bool):
    """What one sequence is given: token ids (often), a count, or something a fast path must hand over."""
    ids = st.lists(st.integers(0, 3), min_size=1, max_size=9)
    junk = st.sampled_from([[1.5], [-1], [True], [2**63], (1, 2), np.array([1, 2]), None, "ab", [np.int64(1)], []])
    return data.draw(st.one_of(*[ids] * 6, st.integers(0, 9), junk) if tracks else
                     st.one_of(*[st.integers(0, 9)] * 6, ids, junk, st.just(2**63)))


def cached_chains(pool_cls, policy):
    """A 20-block pool (block size 4) whose prefix cache holds three chains of 9, 3 and 4 blocks (0-8, 9-11,
    12-15), none referenced; blocks 16-19 are free. Returns the pool and a list counting walks of its order."""
    if policy == "opt":  # an oracle whose next uses never pass: block b is next needed at time 100 - b
        policy = OPTPolicy(lambda b: 100.0 - b)
    pool = pool_cls(20, spec=KVSpec(block_size=4), with_storage=False, eviction_policy=policy)
    mgr = SequenceManager(pool, prefix_cache=True)
    for prompt in (list(range(36)), list(range(40, 52)), list(range(60, 76))):
        seq = mgr.create(prompt)
        seq.append(prompt)
        mgr.cache_full_blocks(seq)
        seq.free()
    walks, order = [0], pool.policy.order

    def counted():
        walks[0] += 1
        return order()
    pool.policy.order = counted
    return pool, walks


def events_of(rec: EventRecorder) -> list:
    return [(type(e).__name__, e.as_dict()) for e in rec.events]


@pytest.mark.parametrize("listen", [False, True], ids=["quiet", "listened"])
@pytest.mark.parametrize("policy", ["fifo", "lfu", "opt", "lru"])
@pytest.mark.parametrize("cls", FAST, ids=lambda c: c.__name__)
def test_cached_chains_are_evicted_tail_first_in_one_walk(cls, policy, listen):
    """Three cached chains, their heads first in FIFO order; an allocation needs 12 victims. The prefix cache's
    guard vetoes a head until its tail is gone, so each victim after a tail is the parent that tail freed: the
    fast pool finds them all in one walk of a heap policy's order, the reference in one walk per victim, and
    both evict the same blocks in the same order, with a listener publishing the same events (each ``Evicted``
    ranks the victim, then the first 7 others of the order a fresh walk would see)."""
    def run(pool_cls):
        pool, walks = cached_chains(pool_cls, policy)
        rec = EventRecorder(pool.events) if listen else None
        got, walked = pool.allocate(16), walks[0]
        pool.check_invariants()
        return got, walked, pool_state(pool), rec and events_of(rec)

    (fast, fast_walks, fast_state, fast_events), (ref, ref_walks, ref_state, ref_events) = run(cls), run(BlockPool)
    assert fast == ref
    assert_same_state(ref_state, fast_state)
    assert fast_events == ref_events
    if policy == "fifo":
        assert fast[4:] == [8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 10, 9]  # each chain's tail first, chain by chain
    if listen:
        evicted = [e for name, e in fast_events if name == "Evicted"]
        assert [e["block_id"] for e in evicted] == fast[4:]
        assert [len(e["candidates"]) for e in evicted] == [min(8, 16 - i) for i in range(12)]  # 16 were cached
        assert all(e["candidates"][0][0] == e["block_id"] for e in evicted)
    if policy != "lru":
        assert fast_walks == 1 < ref_walks


@pytest.mark.parametrize("caches", [False, True], ids=["looks", "caches"])
@pytest.mark.parametrize("policy", ["fifo", "lfu", "opt"])
@pytest.mark.parametrize("cls", FAST, ids=lambda c: c.__name__)
def test_a_listener_that_looks_at_the_ranking_mid_eviction(cls, policy, caches):
    """A listener that reads the policy's ranking on every ``Evicted`` (and, against the events contract,
    caches a held block on the first) while the fast pool takes 12 victims from one walk: the look leaves the
    walk alone (one walk, plus the listener's own), a block cached under it voids the walk and the rest come
    from fresh walks, as the reference's do; either way both pools end alike, event for event, and the
    listener saw the same rankings."""
    def run(pool_cls):
        pool, walks = cached_chains(pool_cls, policy)
        held = pool.allocate(1)
        pool.mark_reusable(held)
        seen: list = []

        def look(e):
            if isinstance(e, Evicted):
                seen.append(pool.policy.rank(3))
                if caches and held:
                    pool.free([held.pop()])
        pool.events.subscribe(look)
        rec = EventRecorder(pool.events)
        walks[0] = 0
        got = pool.allocate(15)
        walked = walks[0] - len(seen)  # the pool's own walks
        pool.check_invariants()
        return got, walked, seen, pool_state(pool), events_of(rec)

    fast, ref = run(cls), run(BlockPool)
    assert fast[0] == ref[0] and fast[2] == ref[2] and fast[4] == ref[4]
    assert_same_state(ref[3], fast[3])
    assert len(fast[2]) == 12
    assert (fast[1] > 1) if caches else (fast[1] == 1 < ref[1])


@pytest.mark.parametrize("listen", [False, True], ids=["quiet", "listened"])
@pytest.mark.parametrize("mgr_cls, pool_cls", MANAGERS, ids=lambda c: c.__name__)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fast_sequence_manager_equals_the_reference(mgr_cls, pool_cls, listen, data):
    """Random creates (with prompts from a tiny alphabet: many prefix hits), batch appends (good and bad feeds,
    repeated, freed and swapped sequences, forks that make appends copy on write), registrations, swaps and
    frees on a small pool: the fast manager over its fast pool and the reference over BlockPool return the
    same values, raise the same errors and end every step in the same state, events included."""
    policy = data.draw(st.sampled_from(["lru", "fifo", "lfu"]), label="policy")  # heap policies: one walk
    kw = dict(spec=KVSpec(block_size=4), with_storage=False, eviction_policy=policy)
    pools = pool_cls(24, **kw), BlockPool(24, **kw)
    mgrs = mgr_cls(pools[0], prefix_cache=True), SequenceManager(pools[1], prefix_cache=True)
    recs = [EventRecorder(p.events) for p in pools] if listen else []
    gone: list[tuple[Sequence, Sequence]] = []  # freed sequences, still handed in now and then
    for _ in range(data.draw(st.integers(5, 30), label="steps")):
        ids = list(mgrs[1].seqs)
        op = data.draw(st.sampled_from(["create", "create", "append", "append", "append", "cache", "free", "fork",
                                        "fork", "swap"]) if ids else st.just("create"), label="op")
        if op == "create":
            prompt = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=14), ODD_PROMPTS),
                               label="prompt")
            tenant = data.draw(st.sampled_from([None, None, None, "t", 3]), label="tenant")
            calls = [lambda m: m.create(prompt, tenant=tenant)] * 2
        elif op == "append":
            picked = data.draw(st.lists(st.sampled_from(ids[-3:]) | st.sampled_from(ids), max_size=4), label="batch")
            feeds = [feed(data, mgrs[1].seqs[i].token_ids is not None) for i in picked]
            odd = gone[-1] if gone and data.draw(st.booleans()) else None
            calls = [lambda m, k=k: m.append_tokens([m.seqs[i] for i in picked] + ([odd[k]] if odd else []),
                                                    feeds + ([[1]] if odd else [])) for k in (0, 1)]
        else:
            i = data.draw(st.sampled_from(ids), label="seq")
            if op == "swap":
                calls = [lambda m: (m.swap_in if m.seqs[i].swapped is not None else m.swap_out)(m.seqs[i])] * 2
            elif op == "free":
                gone.append((mgrs[0].seqs[i], mgrs[1].seqs[i]))
                calls = [lambda m: m.free(m.seqs[i])] * 2
            elif op == "fork":  # and append to the child at once: into a shared tail when it is partly filled
                calls = [lambda m: m.append_tokens([m.fork(m.seqs[i])], [[1] if m.seqs[i].token_ids is not None
                                                                         else 1])] * 2
            else:
                calls = [lambda m: m.cache_full_blocks(m.seqs[i])] * 2
        got, want = (outcome_of(call, m) for call, m in zip(calls, mgrs))
        assert got == want, op
        assert_same_state(pool_state(pools[1]), pool_state(pools[0]))
        assert manager_state(mgrs[0]) == manager_state(mgrs[1])
        if listen:
            assert recs[0].events == recs[1].events
        mgrs[0].check_invariants()


# Prompts the compiled check refuses or never sees (the reference words the error or converts them): bools,
# negative ids, ids past int64, floats, numpy ints in a list, tuples and arrays.
ODD_PROMPTS = st.one_of(
    st.lists(st.one_of(st.integers(0, 3), st.booleans(), st.integers(-2, -1), st.just(2**63), st.just(1.0),
                       st.integers(0, 3).map(np.int64)), min_size=1, max_size=10),
    st.lists(st.integers(0, 3), max_size=10).map(tuple),
    st.lists(st.integers(0, 3), max_size=10).map(lambda v: np.array(v, dtype=np.int64)))


class BlindHasher:
    """A stand-in for the tenant's hasher whose digest ignores the last token fed: blocks that differ only there
    collide, so the walk must catch them by comparing tokens."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def copy(self) -> BlindHasher:
        return BlindHasher(self.data)

    def update(self, b: bytes) -> None:
        self.data += bytes(b)

    def digest(self) -> bytes:
        return hashlib.blake2b(self.data[:-8], digest_size=16).digest()


@pytest.mark.parametrize("blind", [False, True], ids=["blake2b", "colliding"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_fast_prefix_cache_walks_as_the_reference(blind, data):
    """Chains stored, looked up (hits, misses, collisions), made stale behind the cache's back (unmarked,
    swapped out, released, evicted, reallocated): FastPrefixCache over FastBlockPool and PrefixCache over
    BlockPool find the same blocks and end in the same state."""
    with pytest.MonkeyPatch.context() as mp:
        if blind:
            mp.setattr(prefix_mod, "_salted", lambda tenant: BlindHasher())
        kw = dict(spec=KVSpec(block_size=2), with_storage=False)
        pools = FastBlockPool(12, **kw), BlockPool(12, **kw)
        caches = FastPrefixCache(pools[0]), PrefixCache(pools[1])
        tokens = st.lists(st.integers(0, 2), min_size=2, max_size=8)
        queries = tokens | ODD_PROMPTS
        for _ in range(data.draw(st.integers(3, 25), label="steps")):
            op = data.draw(st.sampled_from(["store", "match", "match", "stale", "evict"]), label="op")
            if op == "store":
                toks = data.draw(tokens, label="tokens")
                n = len(toks) // 2
                got = [outcome(p, "allocate", n) for p in pools]
                assert got[0] == got[1]
                if isinstance(got[0], list):
                    ids = got[0]
                    stored = toks[:2 * n] if data.draw(st.booleans(), label="good store") else \
                        data.draw(ODD_PROMPTS, label="odd store")
                    assert outcome(caches[0], "store_blocks", ids, stored) == \
                        outcome(caches[1], "store_blocks", ids, stored)
                    keep = data.draw(st.booleans(), label="keep")
                    for p in pools:
                        p.free(ids if not keep else ids[1:])
            elif op == "match":
                toks = data.draw(queries, label="tokens")
                got = [outcome(c, "match", toks) for c in caches]
                assert got[0] == got[1]
                if isinstance(got[0], tuple) and got[0][0] and not isinstance(got[0][0], type):
                    for p in pools:
                        p.free(got[0][0])
            elif op == "evict":
                assert outcome(pools[0], "evict") == outcome(pools[1], "evict")
            else:
                b = data.draw(st.integers(0, 11), label="block")
                how = data.draw(st.sampled_from(["unmark", "swap", "release"]), label="how")
                for p in pools:
                    if how == "unmark":
                        outcome(p, "mark_reusable", [b], False)
                    elif how == "swap":
                        if outcome(p, "begin_eviction", [b]) is None:
                            p.finish_eviction([b])
                    else:
                        outcome(p, "release_cached", b)
            assert_same_state(pool_state(pools[1]), pool_state(pools[0]))
            assert caches[0].entries() == caches[1].entries() and caches[0].get_stats() == caches[1].get_stats()
            caches[0].check_invariants()


def outcome_of(call, mgr: SequenceManager):
    """The call's result (a sequence by its id) or its error (type and message)."""
    try:
        out = call(mgr)
    except KVLabError as e:
        return type(e), str(e)
    return out.seq_id if isinstance(out, Sequence) else out


def test_the_compiled_pool_is_built_where_a_compiler_is():
    """A C compiler on this machine and no compiled FastBlockPool means the build hook failed silently, unless the
    install left the C parts out on purpose (``KVLAB_NO_EXT=1``, the pure-Python wheel: CI's pure route), where the
    Python paths run and ``kvlab --version``'s report says so."""
    from kvlab.fast.compiled import build_record, compiled_report
    if (build_record().get("_fastpath", {}).get("why") or "").startswith("KVLAB_NO_EXT=1"):
        assert not COMPILED and FastBlockPool is PyFastBlockPool and not kvlab.hotpath_compiled
        assert "FastBlockPool: pure Python" in compiled_report() and "KVLAB_NO_EXT=1" in compiled_report()
        return
    if shutil.which(os.environ.get("CC", "").split(" ")[0] or "cc") is None and not os.environ.get("CI"):
        pytest.skip("no C compiler here: FastBlockPool runs its Python paths")
    assert COMPILED and FastBlockPool is not PyFastBlockPool and kvlab.hotpath_compiled
    assert type(FastBlockPool.__dict__.get("allocate", FastBlockPool.allocate)).__name__ == "method_descriptor"


def test_run_and_scattered_free_restore_the_stack():
    pool = BlockPool(N, with_storage=False)
    ids = pool.allocate(100)
    assert ids == list(range(100))  # lowest ids first: a run
    pool.free(ids)
    assert pool.allocate(100) == ids  # the run is handed out again
    shuffled = np.random.default_rng(0).permutation(ids).tolist()
    pool.free(shuffled)
    assert pool.allocate(100) == shuffled  # a free pushes its first id on top, scattered or not
    pool.check_invariants()


@pytest.mark.parametrize("bad, error, words", [
    (lambda ids: ids + [ids[5]], DoubleFreeError, "refcount 1: it cannot be released 2 time"),
    (lambda ids: ids + [N], UnknownBlockError, f"block {N} is not in this pool"),
    (lambda ids: ids + [-3], UnknownBlockError, "block -3 is not in this pool"),
    (lambda ids: ids[:40] + ["x"], UnknownBlockError, "a block id is an int, not 'x'"),
    (lambda ids: [[1]] + ids, UnknownBlockError, r"a block id is an int, not \[1\]"),
    (lambda ids: ids + [ids[-1] + 1], DoubleFreeError, f"block {41} is FREE"),
])
@pytest.mark.parametrize("cls", [BlockPool, *FAST])
def test_long_free_rejects_bad_lists_unchanged(bad, error, words, cls):
    pool = cls(N, with_storage=False)
    ids = pool.allocate(41)
    before = pool_state(pool)
    with pytest.raises(error, match=words):
        pool.free(bad(ids))
    assert_same_state(before, pool_state(pool))


def test_long_free_of_shared_or_reusable_blocks_takes_the_general_path():
    pool = BlockPool(N, with_storage=False)
    ids = pool.allocate(64)
    pool.incref(ids[:10])
    pool.mark_reusable(ids[10:20])
    pool.free(ids)
    assert (pool.arrays.refcount[ids[:10]] == 1).all()  # shared: one reference left
    assert pool.num_cached_blocks == 10  # reusable: cached, still evictable
    assert pool.num_free_blocks == N - 20
    pool.check_invariants()


def test_freeing_is_not_an_access():
    pool = BlockPool(N, with_storage=False)
    for ids in (pool.allocate(1), pool.allocate(5), pool.allocate(50)):
        last = pool.arrays.last_access[ids].copy()
        pool.free(ids)
        np.testing.assert_array_equal(pool.arrays.last_access[ids], last)


def test_set_owner_refuses_free_blocks_unchanged():
    pool = BlockPool(8, with_storage=False)
    got = pool.allocate(2)
    pool.set_owner(got, 3)
    before = pool_state(pool)
    with pytest.raises(IllegalTransitionError, match="block 2 is FREE"):
        pool.set_owner([got[0], 2], 5)
    assert_same_state(before, pool_state(pool))
    assert pool.arrays.owner[got].tolist() == [3, 3]


def test_sort_free_lists_changes_only_the_order():
    pool = BlockPool(N, with_storage=False)
    ids = pool.allocate(N)
    pool.free(np.random.default_rng(1).permutation(ids).tolist())
    before = pool_state(pool)
    pool.sort_free_lists()
    after = pool_state(pool)
    assert sorted(before[1][0]) == sorted(after[1][0]) and after[1][0] == sorted(after[1][0])  # lowest first
    assert_same_state(before[:1] + (after[1],) + before[2:], after)
    assert pool.allocate(50) == list(range(50))
    pool.check_invariants()


def test_version_says_whether_the_fast_path_is_compiled():
    out = subprocess.run([sys.executable, "-m", "kvlab", "--version"], capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": "40"})  # one line however narrow the terminal
    assert ("compiled (kvlab/fast/_fastpath.c)" in out.stdout) == COMPILED, out.stdout
    assert out.stdout.count("\n") == 1 and "CPU paged decode: " in out.stdout, out.stdout
    env = {**os.environ, "KVLAB_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-m", "kvlab", "--version"], capture_output=True, text=True, check=True,
                         env=env)
    assert "FastBlockPool: pure Python" in out.stdout


@pytest.mark.skipif(not COMPILED, reason="needs the compiled fast path")
def test_a_binary_older_than_its_source_is_refused_with_one_warning(tmp_path):
    """A checkout whose _fastpath.c changed after the build: the stale binary is not loaded, and kvlab says so."""
    src = Path(kvlab.__file__).parent
    pkg = tmp_path / "kvlab"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    c_file = pkg / "fast" / "_fastpath.c"
    c_file.write_text(c_file.read_text() + "\n/* edited */\n")
    code = "import warnings; warnings.simplefilter('always'); import kvlab; print(kvlab.hotpath_compiled)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "False"
    assert out.stderr.count("changed after it was compiled") == 1, out.stderr


def test_the_wheel_ships_the_compiled_fast_path(wheel):
    names = set(wheel.namelist())
    assert "kvlab/fast/_fastpath.c" in names and "kvlab/fast/pool.py" in names
    if COMPILED:
        assert any(n.startswith("kvlab/fast/_fastpath") and n.endswith(".so") for n in names), sorted(names)
        tags = [line for line in wheel.read(next(n for n in names if n.endswith("WHEEL"))).decode().splitlines()
                if line.startswith("Tag:")]
        assert tags and all("none-any" not in t for t in tags), tags  # a binary wheel names its platform


@pytest.mark.parametrize("listen", [False, True])
def test_the_fast_paths_leak_nothing(listen):
    """20,000 allocate/free pairs (and refused calls) leave no Python objects behind."""
    import gc
    import tracemalloc
    pool = FastBlockPool(4096, with_storage=False)
    if listen:
        pool.events.subscribe(lambda e: None)

    def work():
        for i in range(10_000):
            pool.free(pool.allocate(1 + i % 20, owner=i % 7))
            try:
                pool.free([0])
            except DoubleFreeError:
                pass
    work()  # warm caches (interned ints, free lists)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    work()
    work()
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes more after 40,000 calls"


def test_a_pool_with_the_compiled_paths_is_collected():
    import gc
    import weakref
    pool = FastBlockPool(64, with_storage=False)
    pool.events.subscribe(lambda e, p=pool: None)  # a cycle through the bus the C holds
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(not COMPILED, reason="needs the compiled fast path")
def test_the_pool_lock_is_reentrant_and_exclusive():
    """FastBlockPool's PoolLock behaves as threading.RLock where the pool relies on it."""
    import threading
    import time
    lock = FastBlockPool(4, with_storage=False).lock
    with lock:
        with lock:  # reentrant: the pool's methods call each other under it
            assert lock.held()
        assert lock.held()
    assert not lock.held()
    with pytest.raises(RuntimeError):
        lock.release()  # not held
    inside, seen = [0], []

    def worker(k):
        for i in range(300):
            with lock:
                inside[0] += 1
                seen.append(inside[0])
                time.sleep(0 if i % 3 else 1e-5)  # the others run, and queue at the gate, while this one holds it
                with lock:  # taken again by its holder, never by a waiter
                    seen.append(inside[0])
                inside[0] -= 1
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)  # every waiter was let through
    assert seen == [1] * 4800  # never two holders at once
    assert not lock.held()

    def other_thread_release(out):
        try:
            lock.release()
        except RuntimeError as e:
            out.append(e)
    with lock:
        out: list = []
        t = threading.Thread(target=other_thread_release, args=(out,))
        t.start()
        t.join()
        assert out and lock.held()  # only the holder can release it


class Interrupted(Exception):
    """What the test's signal handler raises in the waiting thread (a stand-in for KeyboardInterrupt)."""


@pytest.mark.skipif(not COMPILED, reason="needs the compiled fast path")
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
@pytest.mark.parametrize("wait", ["with", "allocate"])
def test_a_signal_interrupts_a_thread_waiting_for_the_pool_lock(wait):
    """Ctrl-C stops a wait for the lock, as it stops one for threading.RLock: the handler's exception comes out
    while another thread still holds the lock, the pool is unchanged, and the lock works as before."""
    import threading
    pool = FastBlockPool(8, with_storage=False)
    before = pool_state(pool)
    holding, release, done = threading.Event(), threading.Event(), []

    def holder():
        with pool.lock:
            holding.set()
            release.wait(20)  # long enough for any wait to have been interrupted
            done.append("released")

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    t = threading.Thread(target=holder)
    t.start()
    try:
        holding.wait(10)
        main = threading.main_thread().ident
        kick = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGUSR1))
        kick.start()
        with pytest.raises(Interrupted):
            if wait == "with":
                with pool.lock:
                    pass
            else:
                pool.allocate(1)
        assert not done and not pool.lock.held()  # interrupted while waiting, not after taking it
        kick.join()
    finally:
        release.set()
        t.join(30)
        signal.signal(signal.SIGUSR1, old)
    assert_same_state(before, pool_state(pool))
    pool.free(pool.allocate(2))  # the lock still serves its holder and the next waiter
    assert not pool.lock.held()


@pytest.mark.parametrize("cls", FAST, ids=lambda c: c.__name__)
def test_events_built_in_place_are_the_classes_own(cls):
    """The compiled path fills an event's slots without calling its ``__init__``: what a subscriber receives
    must still be an instance of exactly the event class, with every field set, as the reference builds it; a
    subscriber that unsubscribes itself mid-publish is called once, the next one still is (as EventBus does)."""
    def run(pool_cls: type[BlockPool]) -> list[tuple]:
        pool = pool_cls(64, with_storage=False)
        got: list[tuple] = []
        leave = pool.events.subscribe(lambda e: (got.append(("once", type(e), e.as_dict())), leave()))
        pool.events.subscribe(lambda e: got.append(("always", type(e), e.as_dict(), repr(e))))
        ids = pool.allocate(3, owner=7)
        pool.incref(ids[:1])
        pool.mark_reusable(ids[1:2])
        pool.free(ids)  # one shared, one reusable, one plain: RefChanged, Cached and Freed
        pool.free(pool.allocate(1))
        return got
    got = run(cls)
    assert got == run(BlockPool)
    assert [k for k, *_ in got].count("once") == 1
    assert {t for _, t, *_ in got} == {Allocated, RefChanged, Cached, Freed}


def scenario_events(pool: BlockPool, keep) -> list:
    """One allocate/free pair after another (plain, shared, reusable, many blocks), each subscriber call keeping
    ``keep(event)``: what a subscriber holds after the run."""
    held: list = []
    pool.events.subscribe(lambda e: held.append(keep(e)))
    for _ in range(3):
        pool.free(pool.allocate(1))
    ids = pool.allocate(3, owner=7)
    pool.incref(ids[:1])
    pool.mark_reusable(ids[1:2])
    pool.free(ids)
    pool.free(pool.allocate(2))
    pool.free(pool.allocate(2))
    return held


@pytest.mark.parametrize("cls", FAST, ids=lambda c: c.__name__)
@pytest.mark.parametrize("keep", ["fields", "block_ids", "event"])
def test_what_a_subscriber_keeps_never_changes(cls, keep):
    """The compiled path refills an event (and its block_ids tuple) that no subscriber kept, instead of freeing it
    and allocating the next. Whatever a subscriber does keep — the event, its tuple, or nothing but its
    contents read at once — must read the same at the end as the reference's, call after call."""
    how = {"fields": lambda e: e.as_dict(), "block_ids": lambda e: e.block_ids, "event": lambda e: e}[keep]
    got = scenario_events(cls(64, with_storage=False), how)
    want = scenario_events(BlockPool(64, with_storage=False), how)
    assert got == want
    if keep == "event":
        assert len({id(e) for e in got}) == len(got)  # every kept event is its own object


@pytest.mark.parametrize("cls", FAST, ids=lambda c: c.__name__)
def test_spare_events_go_with_their_pool(cls):
    """Events nobody kept that the pool holds for reuse are freed with the pool."""
    gc.collect()
    before = sum(type(o) in (Allocated, Freed) for o in gc.get_objects())
    pool = cls(64, with_storage=False)
    scenario_events(pool, lambda e: None)
    del pool
    gc.collect()
    assert sum(type(o) in (Allocated, Freed) for o in gc.get_objects()) == before


class HookFailed(Exception):
    pass


@pytest.mark.parametrize("raiser", ["hook", "hook+listener", "listener"])
@pytest.mark.parametrize("policy", ["fifo", "lfu", "lru"])
@pytest.mark.parametrize("cls", [*FAST, BlockPool], ids=lambda c: c.__name__)
def test_an_evict_hook_or_listener_that_raises_leaves_a_consistent_pool(cls, policy, raiser):
    """An evict hook (with or without a listener attached) or a listener that raises at the second of four
    victims an allocation needs. A hook's error reaches the caller, with every block the allocation had taken back
    on the free stack (the two evicted ones FREE, their data gone; before, the blocks taken stayed off the free
    stack). A listener's does not: the allocation completes as if it had not been there, and the listener is
    unsubscribed and its error kept in ``events.failures``. Either way the pool passes its invariants and serves
    the next allocation, and the fast pools end exactly as the reference does."""
    def run(pool_cls):
        pool, _ = cached_chains(pool_cls, policy)
        rec = EventRecorder(pool.events) if raiser != "hook" else None
        calls = []

        def fail(b):
            calls.append(b)
            if len(calls) == 2:
                raise HookFailed(b)
        if raiser == "listener":
            listener = lambda e: isinstance(e, Evicted) and fail(e.block_id)  # noqa: E731
            undo = pool.events.subscribe(listener)
            assert len(pool.allocate(8)) == 8
            assert listener not in pool.events and [type(x) for _, _, x in pool.events.failures] == [HookFailed]
        else:
            pool.evict_hooks.append(fail)
            undo = lambda: pool.evict_hooks.remove(fail)  # noqa: E731
            with pytest.raises(HookFailed):
                pool.allocate(8)
        pool.check_invariants()
        state, free = pool_state(pool), pool.num_free_blocks
        undo()
        return state, free, calls, pool.allocate(6), rec and events_of(rec)

    ref = run(BlockPool)
    assert ref[1] == (0 if raiser == "listener" else 4 + 2) and len(ref[2]) == 2
    if cls is BlockPool:
        return
    fast = run(cls)
    assert_same_state(ref[0], fast[0])
    assert fast[1:] == ref[1:]


@pytest.mark.parametrize("path", ["evict", "release_cached", "unmark"])
@pytest.mark.parametrize("cls", [*FAST, BlockPool], ids=lambda c: c.__name__)
def test_an_evict_hook_that_raises_on_the_other_evicting_paths(cls, path):
    """The other calls that drop cached data (``evict``, ``release_cached``, ``mark_reusable(..., False)`` of
    three cached blocks) with an evict hook that raises at the first block: the error reaches the caller, that
    block is FREE and on the free stack, the rest untouched, the invariants hold; the fast pools end as the
    reference does."""
    def run(pool_cls):
        pool, _ = cached_chains(pool_cls, "fifo")
        calls = []

        def fail(b):
            calls.append(b)
            raise HookFailed(b)
        pool.evict_hooks.append(fail)
        with pytest.raises(HookFailed):
            if path == "evict":
                pool.evict()
            elif path == "release_cached":
                pool.release_cached(8)
            else:
                pool.mark_reusable([8, 11, 15], False)
        pool.check_invariants()
        return calls, pool.num_free_blocks, pool.free_ids()[0], pool_state(pool)

    ref = run(BlockPool)
    assert ref[:3] == (([15], 5, 15) if path == "unmark" else ([8], 5, 8))  # unmarked: the last block first
    fast = run(cls)
    assert fast[:3] == ref[:3]
    assert_same_state(ref[3], fast[3])
