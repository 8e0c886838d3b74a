"""The exact event sequence of every transition, on every code path, for BlockPool and FastBlockPool.

Each call is checked the same way: the clock moves by exactly the ticks the call makes (one per public
mutation), and the events published are exactly the expected list (kinds, block ids, fields), each stamped
with the pool clock at that call. FastBlockPool must publish the same events as the reference on its fast
paths (one block, a few blocks, a run of >= 9, a scattered batch of >= 9) as on the paths it hands over, both
compiled and in Python.
"""
from __future__ import annotations

import pytest

from _util import small_spec
from kvlab import (Allocated, BlockPool, Cached, EventRecorder, Evicted, FastBlockPool, Freed, KVLabError, Merged,
                   Migrated, RefChanged, Split, StatusChanged, PyFastBlockPool)
from kvlab.fast.pool import BATCH_MIN
from kvlab.core.prefix import PrefixCache, PrefixEvicted, PrefixHit, PrefixStored
from kvlab.core.sequence import CopiedOnWrite, SequenceManager, Swapped

SPEC = small_spec()
# The reference, the fast pool, and its Python paths when the fast pool is compiled
POOLS = {"reference": BlockPool, "fast": FastBlockPool}
if PyFastBlockPool is not FastBlockPool:
    POOLS["fast-python"] = PyFastBlockPool


@pytest.fixture(params=list(POOLS.values()), ids=list(POOLS))
def cls(request):
    return request.param


def make(cls, n=16, **kw):
    pool = cls(n, spec=SPEC, **kw)
    return pool, EventRecorder(pool.events)


def check(pool, rec, call, expected, ticks=1):
    """Run ``call()``; the clock must move ``ticks`` steps and the events published must be exactly
    ``expected(t)`` (``t`` = the clock after the call) or the list ``expected``. Returns what ``call`` returned."""
    t0 = pool.clock.now()
    out = call()
    t = pool.clock.now()
    assert t == t0 + ticks, f"the clock moved {t - t0} steps, expected {ticks}"
    got = list(rec.events)
    rec.events.clear()
    assert got == (expected(t) if callable(expected) else expected)
    return out


def test_fast_path_sizes_cover_both_sides_of_the_batch_threshold():
    assert BATCH_MIN == 9  # the sizes below (1, 3, 10 and 9 scattered) straddle it


# ---------------------------------------------------------------------------------------------------- allocate
def test_allocate_from_the_free_stack(cls):
    pool, rec = make(cls)
    assert check(pool, rec, lambda: pool.allocate(1, owner=3),
                 lambda t: [Allocated(t, (0,), 0, 3, "ALLOCATED", "free")]) == [0]
    assert check(pool, rec, lambda: pool.allocate(3),
                 lambda t: [Allocated(t, (1, 2, 3), 0, -1, "ALLOCATED", "free")]) == [1, 2, 3]
    run = list(range(4, 14))  # a run of 10: the fast pool's slice path
    assert check(pool, rec, lambda: pool.allocate(10, owner=7),
                 lambda t: [Allocated(t, tuple(run), 0, 7, "ALLOCATED", "free")]) == run
    scattered = [13, 5, 9, 4, 12, 6, 11, 7, 10]  # freed in this order, so handed out in this order again
    check(pool, rec, lambda: pool.free(scattered), lambda t: [Freed(t, tuple(scattered))])
    assert check(pool, rec, lambda: pool.allocate(9),
                 lambda t: [Allocated(t, tuple(scattered), 0, -1, "ALLOCATED", "free")]) == scattered
    pool.check_invariants()


def test_allocate_nothing_does_not_tick(cls):
    pool, rec = make(cls)
    assert check(pool, rec, lambda: pool.free([]), [], ticks=0) is None
    assert check(pool, rec, lambda: pool.allocate(0), [], ticks=0) == []


def test_allocate_by_splitting(cls):
    pool, rec = make(cls, 8, block_sizes=[4, 8, 16])  # two FREE blocks of class 2: 0 and 4
    # 0 (class 2) -> 0 + 2 (class 1); 0 (class 1) -> 0 + 1 (class 0); 0 is taken
    assert check(pool, rec, lambda: pool.allocate(1, owner=2),
                 lambda t: [Split(t, 0, 2, 2), Split(t, 0, 1, 1),
                            Allocated(t, (0,), 0, 2, "ALLOCATED", "split")]) == [0]
    assert check(pool, rec, lambda: pool.allocate(1),
                 lambda t: [Allocated(t, (1,), 0, -1, "ALLOCATED", "free")]) == [1]
    # one block split off 2 (class 1), the other its buddy from the stack: a tie names the first strategy
    assert check(pool, rec, lambda: pool.allocate(2),
                 lambda t: [Split(t, 2, 1, 3), Allocated(t, (2, 3), 0, -1, "ALLOCATED", "free")]) == [2, 3]
    assert check(pool, rec, lambda: pool.allocate(1, size_class=1),
                 lambda t: [Split(t, 4, 2, 6), Allocated(t, (4,), 1, -1, "ALLOCATED", "split")]) == [4]
    pool.check_invariants()


def test_allocate_by_evicting(cls):
    pool, rec = make(cls, 4)
    ids = check(pool, rec, lambda: pool.allocate(4), lambda t: [Allocated(t, (0, 1, 2, 3), 0, -1, "ALLOCATED", "free")])
    check(pool, rec, lambda: pool.mark_reusable(ids), [])  # a tick, no transition
    released = {}
    for b in (2, 0, 3):
        check(pool, rec, lambda: pool.free([b]), lambda t: [Cached(t, (b,))])
        released[b] = pool.clock.now()
    t2, t0, t3 = released[2], released[0], released[3]
    # LRU: 2 then 0; each Evicted ranks the candidates left, victim first, scored by last access
    assert check(pool, rec, lambda: pool.allocate(2, owner=1), lambda t: [
        Evicted(t, 2, "lru", "allocation pressure", ((2, float(t2)), (0, float(t0)), (3, float(t3)))),
        Evicted(t, 0, "lru", "allocation pressure", ((0, float(t0)), (3, float(t3)))),
        Allocated(t, (2, 0), 0, 1, "ALLOCATED", "evict")]) == [2, 0]
    check(pool, rec, lambda: pool.free([0]), lambda t: [Freed(t, (0,))])
    # one block off the free stack, one by evicting 3: the tie names the free stack
    assert check(pool, rec, lambda: pool.allocate(2), lambda t: [
        Evicted(t, 3, "lru", "allocation pressure", ((3, float(t3)),)),
        Allocated(t, (0, 3), 0, -1, "ALLOCATED", "free")]) == [0, 3]
    assert pool.stats()["served_evict"] == 3
    pool.check_invariants()


def test_reserve_commit_and_abort(cls):
    pool, rec = make(cls)
    ids = check(pool, rec, lambda: pool.reserve(2, owner=5),
                lambda t: [Allocated(t, (0, 1), 0, 5, "PENDING", "free")])
    check(pool, rec, lambda: pool.commit(ids), lambda t: [StatusChanged(t, (0, 1), "PENDING", "ALLOCATED")])
    (b,) = check(pool, rec, lambda: pool.reserve(1), lambda t: [Allocated(t, (2,), 0, -1, "PENDING", "free")])
    check(pool, rec, lambda: pool.free([b]), lambda t: [Freed(t, (2,))])  # a PENDING block aborted to FREE
    assert pool.free_ids()[0] == 2
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------------- free, refs
def test_free_to_free_on_every_path(cls):
    pool, rec = make(cls, 32)
    ids = pool.allocate(20)
    rec.events.clear()
    check(pool, rec, lambda: pool.free([ids[0]]), lambda t: [Freed(t, (0,))])  # one block
    check(pool, rec, lambda: pool.free(ids[1:4]), lambda t: [Freed(t, (1, 2, 3))])  # a few
    many = ids[4:14][::-1]  # ten, tail first
    check(pool, rec, lambda: pool.free(many), lambda t: [Freed(t, tuple(many))])
    assert pool.free_ids()[:10] == many  # the first id freed comes out first
    check(pool, rec, lambda: pool.free((ids[14], ids[15])), lambda t: [Freed(t, (14, 15))])  # a tuple: general path
    pool.check_invariants()


def test_free_to_cached_on_every_path(cls):
    pool, rec = make(cls, 32)
    ids = pool.allocate(20)
    pool.mark_reusable(ids)
    rec.events.clear()
    check(pool, rec, lambda: pool.free([ids[0]]), lambda t: [Cached(t, (0,))])
    check(pool, rec, lambda: pool.free(ids[1:4]), lambda t: [Cached(t, (1, 2, 3))])
    many = ids[4:14][::-1]
    check(pool, rec, lambda: pool.free(many), lambda t: [Cached(t, tuple(many))])
    assert [b for b, _ in pool.policy.order()] == [0, 1, 2, 3, *many]
    assert pool.num_cached_blocks == 14 and pool.num_free_blocks == 12
    pool.check_invariants()


def test_one_free_publishes_left_cached_and_freed_in_that_order(cls):
    pool, rec = make(cls, 32)
    ids = pool.allocate(12)
    pool.incref(ids[:2])
    pool.mark_reusable(ids[2:5])
    rec.events.clear()
    mixed = [ids[11], ids[0], ids[2], ids[10], ids[1], ids[3], ids[9], ids[4], ids[8], ids[7]]  # ten
    check(pool, rec, lambda: pool.free(mixed), lambda t: [RefChanged(t, (0, 1), (-1, -1), (1, 1)), Cached(t, (2, 3, 4)),
                                                          Freed(t, (11, 10, 9, 8, 7))])
    assert pool.free_ids()[:5] == [11, 10, 9, 8, 7]
    pool.check_invariants()


def test_decref_to_cached_and_incref(cls):
    pool, rec = make(cls)
    a, b, c = pool.allocate(3)
    rec.events.clear()
    check(pool, rec, lambda: pool.incref([a, c]), lambda t: [RefChanged(t, (a, c), (1, 1), (2, 2))])
    check(pool, rec, lambda: pool.decref([c, b, a]),
          lambda t: [RefChanged(t, (c, a), (-1, -1), (1, 1)), Cached(t, (b,))])
    assert pool.is_cached(b)  # decref keeps the data whether or not the block is reusable
    check(pool, rec, lambda: pool.incref([b]), lambda t: [RefChanged(t, (b,), (1,), (1,))])  # a cached block
    assert b not in pool.policy
    check(pool, rec, lambda: pool.decref([a, b, c]), lambda t: [Cached(t, (a, b, c))])
    assert [x for x, _ in pool.policy.order()] == [a, b, c]
    pool.check_invariants()


def test_ref_changed_deltas_are_the_change_of_each_count(cls):
    pool, rec = make(cls)
    a, b = pool.allocate(2)
    rec.events.clear()
    check(pool, rec, lambda: pool.incref([a, b, a]), lambda t: [RefChanged(t, (a, b), (2, 1), (3, 2))])
    check(pool, rec, lambda: pool.decref([b, a, a]), lambda t: [RefChanged(t, (b, a), (-1, -2), (1, 1))])
    check(pool, rec, lambda: pool.incref([a, a]), lambda t: [RefChanged(t, (a,), (2,), (3,))])
    check(pool, rec, lambda: pool.free([a, b, a]), lambda t: [RefChanged(t, (a,), (-2,), (1,)), Freed(t, (b,))])


def test_touch_ticks_and_publishes_nothing(cls):
    pool, rec = make(cls)
    ids = pool.allocate(2)
    rec.events.clear()
    check(pool, rec, lambda: pool.touch(ids + ids[:1]), [])
    assert pool.fields.hits[ids[0]] == 3 and pool.fields.last_access[ids[1]] == pool.clock.now()


def test_mark_reusable_false_releases_cached_blocks(cls):
    pool, rec = make(cls)
    a, b, c, d = pool.allocate(4)
    pool.mark_reusable([a, b, c])
    pool.free([a, b])
    rec.events.clear()
    check(pool, rec, lambda: pool.mark_reusable([c], False), [])  # c is still held: nothing is released
    check(pool, rec, lambda: pool.mark_reusable([a, d, b], False), lambda t: [Freed(t, (a, b))])
    assert pool.free_ids()[:2] == [a, b] and pool.num_cached_blocks == 0
    check(pool, rec, lambda: pool.mark_reusable([c, d]), [])
    pool.check_invariants()


def test_release_cached(cls):
    pool, rec = make(cls)
    a, b = pool.allocate(2)
    rec.events.clear()
    check(pool, rec, lambda: pool.decref([a, b]), lambda t: [Cached(t, (a, b))])
    check(pool, rec, lambda: pool.release_cached(b), lambda t: [Freed(t, (b,))])
    assert pool.free_ids()[0] == b and list(pool.policy.order())[0][0] == a
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------------- eviction
def test_evict_ranks_candidates_victim_first(cls):
    pool, rec = make(cls)
    ids = pool.allocate(10)
    stamps = {}
    rec.events.clear()
    for b in [4, 1, 7, 0, 9, 2, 8, 3, 6, 5]:  # released one at a time: distinct last-access stamps
        check(pool, rec, lambda: pool.decref([b]), lambda t: [Cached(t, (b,))])
        stamps[b] = float(pool.clock.now())
    order = [4, 1, 7, 0, 9, 2, 8, 3, 6, 5]
    assert check(pool, rec, lambda: pool.evict("test"),
                 lambda t: [Evicted(t, 4, "lru", "test", tuple((b, stamps[b]) for b in order[:8]))]) == 4
    pool.evict_guard = lambda b: b not in (1, 7)  # passed over: listed after the victim, then the next ones
    assert check(pool, rec, lambda: pool.evict(), lambda t: [
        Evicted(t, 0, "lru", "explicit", tuple((b, stamps[b]) for b in [0, 1, 7, 9, 2, 8, 3, 6]))]) == 0
    pool.evict_guard = None
    for _ in range(8):
        pool.evict()
    rec.events.clear()
    assert check(pool, rec, lambda: pool.evict(), [], ticks=0) is None  # nothing cached: no event, no tick
    assert ids == list(range(10))


@pytest.mark.parametrize("policy, expect", [
    ("fifo", ((2, 2.0), (0, 3.0), (1, 4.0))),  # by creation stamp
    ("lfu", ((1, 1.0), (0, 2.0), (2, 3.0))),  # by hits (ties by last access)
])
def test_evicted_event_scores_of_fifo_and_lfu(cls, policy, expect):
    pool, rec = make(cls, 4, eviction_policy=policy)
    for b in (3, 2, 0, 1):  # created at steps 1, 2, 3, 4
        pool.allocate(1, block_id=b)
    pool.incref([2, 2])  # block 2: 3 hits
    pool.touch([0])  # block 0: 2 hits
    pool.decref([1, 0, 2, 2, 2])  # all three cached at one step (LRU would take 1, 0, 2)
    rec.events.clear()
    check(pool, rec, lambda: pool.evict(), lambda t: [Evicted(t, expect[0][0], policy, "explicit", expect)])


def test_begin_and_finish_eviction(cls):
    pool, rec = make(cls)
    a, b, c = pool.allocate(3)
    rec.events.clear()
    check(pool, rec, lambda: pool.decref([c]), lambda t: [Cached(t, (c,))])  # a cached block may be swapped out
    check(pool, rec, lambda: pool.begin_eviction([b, c]), lambda t: [StatusChanged(t, (b, c), "ALLOCATED", "EVICTING")])
    assert pool.num_cached_blocks == 0 and pool.fields.last_access[b] == pool.clock.now()
    check(pool, rec, lambda: pool.finish_eviction([c, b]), lambda t: [StatusChanged(t, (c, b), "EVICTING", "FREE")])
    assert pool.free_ids()[:2] == [b, c]
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------------- buddies, moves
def test_split_block_and_merge_free_buddies(cls):
    pool, rec = make(cls, 8, block_sizes=[4, 8, 16])
    assert check(pool, rec, lambda: pool.split_block(0), lambda t: [Split(t, 0, 2, 2)]) == (0, 2)
    assert check(pool, rec, lambda: pool.split_block(2), lambda t: [Split(t, 2, 1, 3)]) == (2, 3)
    assert check(pool, rec, lambda: pool.merge_free_buddies(), lambda t: [Merged(t, 2, 1), Merged(t, 0, 2)]) == 2
    assert check(pool, rec, lambda: pool.merge_free_buddies(), [], ticks=0) == 0  # nothing to merge
    pool.split_block(4)
    pool.split_block(4)
    pool.split_block(6)
    rec.events.clear()
    assert check(pool, rec, lambda: pool.merge_free_buddies(max_merges=1), lambda t: [Merged(t, 4, 1)]) == 1
    pool.check_invariants()


def test_migrate(cls):
    pool, rec = make(cls)
    a, b, c = pool.allocate(3)
    rec.events.clear()
    check(pool, rec, lambda: pool.decref([b]), lambda t: [Cached(t, (b,))])
    check(pool, rec, lambda: pool.migrate([c, b], [9, 12], reason="test"),
          lambda t: [Migrated(t, (c, b), (9, 12), "test")])
    assert pool.is_cached(12) and pool.free_ids()[:2] == [b, c]  # sources pushed in order: the last on top
    check(pool, rec, lambda: pool.migrate([], []), [], ticks=0)
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------------- sequences
def test_copy_on_write_events(cls):
    pool, rec = make(cls)
    mgr = SequenceManager(pool)
    s = mgr.create()
    check(pool, rec, lambda: s.append(6), lambda t: [Allocated(t, (0, 1), 0, -1, "ALLOCATED", "free")])
    child = check(pool, rec, s.fork, lambda t: [RefChanged(t, (0, 1), (1, 1), (2, 2))])
    # the shared, partly filled tail is copied into a fresh block, then the child's reference to it dropped
    check(pool, rec, lambda: child.append(1), lambda t: [Allocated(t - 1, (2,), 0, -1, "ALLOCATED", "free"),
                                                         RefChanged(t, (1,), (-1,), (1,)),
                                                         CopiedOnWrite(t, child.seq_id, 1, 2)], ticks=2)
    assert child.block_table == [0, 2] and pool.fields.owner[2] == child.seq_id
    check(pool, rec, lambda: s.append(2), [], ticks=0)  # s alone holds block 1 now: no copy, no block
    check(pool, rec, s.free, lambda t: [RefChanged(t, (0,), (-1,), (1,)), Freed(t, (1,))])
    mgr.check_invariants()


def test_swap_events_and_token_counts(cls):
    pool, rec = make(cls)
    mgr = SequenceManager(pool)
    a = mgr.create()
    a.append(10)  # blocks 0, 1, 2 holding 4, 4 and 2 tokens
    rec.events.clear()
    check(pool, rec, a.swap_out, lambda t: [StatusChanged(t - 1, (0, 1, 2), "ALLOCATED", "EVICTING"),
                                            StatusChanged(t, (0, 1, 2), "EVICTING", "FREE"),
                                            Swapped(t, a.seq_id, "out", (0, 1, 2))], ticks=2)
    assert a.block_table == [-1, -1, -1] and a.swapped.tokens == [4, 4, 2]
    # the blocks come back off the free stack in the other order: 2, 1, 0
    check(pool, rec, a.swap_in, lambda t: [Allocated(t - 1, (2, 1, 0), 0, a.seq_id, "PENDING", "free"),
                                           StatusChanged(t, (2, 1, 0), "PENDING", "ALLOCATED"),
                                           Swapped(t, a.seq_id, "in", (2, 1, 0))], ticks=2)
    assert a.block_table == [2, 1, 0]
    assert [pool.fields.tokens[b] for b in a.block_table] == [4, 4, 2]  # each count follows its position
    mgr.check_invariants()


def test_swap_in_of_a_partly_shared_sequence_restores_each_count(cls):
    pool, rec = make(cls)
    mgr = SequenceManager(pool)
    a = mgr.create()
    a.append(9)  # blocks 0, 1, 2
    keep = a.fork()  # all shared
    a.append(6)  # the shared tail 2 (1 token) is copied to 3 (COW) and filled; block 4 holds the last 3
    assert a.block_table == [0, 1, 3, 4] and a.num_tokens == 15
    private = [3, 4]
    assert [pool.fields.tokens[b] for b in private] == [4, 3]
    a.swap_out()
    assert a.block_table == [0, 1, -1, -1] and a.swapped.positions == [2, 3]
    rec.events.clear()
    check(pool, rec, a.swap_in, lambda t: [Allocated(t - 1, (4, 3), 0, a.seq_id, "PENDING", "free"),
                                           StatusChanged(t, (4, 3), "PENDING", "ALLOCATED"),
                                           Swapped(t, a.seq_id, "in", (4, 3))], ticks=2)
    assert a.block_table == [0, 1, 4, 3] and [pool.fields.tokens[b] for b in (4, 3)] == [4, 3]
    mgr.check_invariants()
    keep.free()
    a.free()
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------------------- prefix cache
def _two_block_prompt(cls):
    """An 8-block pool with a recorder, a manager with a prefix cache, a 9-token prompt and its two blocks' hashes."""
    pool, rec = make(cls, 8)
    mgr = SequenceManager(pool, prefix_cache=True)
    prompt = list(range(9))
    h0 = PrefixCache.block_hash(None, prompt[:4])
    return pool, rec, mgr, prompt, h0, PrefixCache.block_hash(h0, prompt[4:8])


def test_prefix_store_hit_and_evict_events(cls):
    pool, rec, mgr, prompt, h0, h1 = _two_block_prompt(cls)
    s = check(pool, rec, lambda: mgr.create(prompt), [], ticks=0)  # an empty cache: no hit, nothing changes
    check(pool, rec, lambda: s.append(prompt), lambda t: [Allocated(t, (0, 1, 2), 0, -1, "ALLOCATED", "free")])
    # registering marks the chain's blocks reusable in one call (one tick) and publishes each hash at that step
    check(pool, rec, lambda: mgr.cache_full_blocks(s),
          lambda t: [PrefixStored(t, 0, h0.hex()), PrefixStored(t, 1, h1.hex())])
    check(pool, rec, s.free, lambda t: [Cached(t, (1, 0)), Freed(t, (2,))])
    s2 = check(pool, rec, lambda: mgr.create(prompt, tenant=None),
               lambda t: [RefChanged(t, (0, 1), (1, 1), (1, 1)), PrefixHit(t, (0, 1), 8, None)])
    assert s2.block_table == [0, 1] and s2.num_tokens == 8
    check(pool, rec, s2.free, lambda t: [Cached(t, (1, 0))])
    # LRU would take the head 0 first; the guard passes it over for its cached child 1, which the cache drops
    # (told by the pool's hook) before the pool publishes the eviction
    check(pool, rec, pool.evict, lambda t: [PrefixEvicted(t, 1, h1.hex()),
                                            Evicted(t, 1, "lru", "explicit", ((1, float(t - 1)), (0, float(t - 1))))])
    check(pool, rec, pool.evict,
          lambda t: [PrefixEvicted(t, 0, h0.hex()), Evicted(t, 0, "lru", "explicit", ((0, float(t - 2)),))])
    assert len(mgr.prefix_cache) == 0
    mgr.check_invariants()


def test_prefix_entries_leave_with_released_and_unmarked_blocks(cls):
    pool, rec, mgr, prompt, h0, h1 = _two_block_prompt(cls)
    s = mgr.create(prompt)
    s.append(prompt)
    mgr.cache_full_blocks(s)
    s.free()
    rec.events.clear()
    check(pool, rec, lambda: pool.mark_reusable([1], False), lambda t: [PrefixEvicted(t, 1, h1.hex()), Freed(t, (1,))])
    check(pool, rec, lambda: pool.release_cached(0), lambda t: [PrefixEvicted(t, 0, h0.hex()), Freed(t, (0,))])
    assert len(mgr.prefix_cache) == 0 and mgr.create(prompt).num_tokens == 0
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------------------- rejected calls
def test_rejected_calls_publish_nothing_and_do_not_tick(cls):
    pool, rec = make(cls, 4)
    a, b = pool.allocate(2)
    pool.decref([b])
    rec.events.clear()
    for call in (lambda: pool.allocate(5), lambda: pool.free([a, a]), lambda: pool.free([b]),
                 lambda: pool.decref([3]), lambda: pool.incref([3]), lambda: pool.commit([a]),
                 lambda: pool.finish_eviction([a]), lambda: pool.release_cached(a), lambda: pool.touch([3]),
                 lambda: pool.mark_reusable([3]), lambda: pool.migrate([a], [b]), lambda: pool.split_block(3),
                 lambda: pool.free([9]), lambda: pool.allocate(1, block_id=a)):
        t = pool.clock.now()
        with pytest.raises(KVLabError):
            call()
        assert pool.clock.now() == t and not rec.events
    pool.check_invariants()



def test_a_subscriber_that_raises_keeps_the_event_from_no_one(cls):
    """Subscribers before and after one that raises hear every event, the same ones; the raising one is
    unsubscribed after its first and its error kept (it only watches: see ``EventBus``)."""
    pool, before = make(cls)

    def wrong(e):
        raise RuntimeError("a bug in a view")
    pool.events.subscribe(wrong)
    after = EventRecorder(pool.events)
    pool.free(pool.allocate(3))
    assert [e.as_dict() for e in after] == [e.as_dict() for e in before] and after.counts() == {"Allocated": 1,
                                                                                              "Freed": 1}
    assert wrong not in pool.events and [str(x) for _, _, x in pool.events.failures] == ["a bug in a view"]


def test_a_recorder_listens_to_an_event_bus_only():
    from kvlab.core.errors import ConfigError

    for bad in (None, "bus", BlockPool(4, with_storage=False)):
        with pytest.raises(ConfigError, match="EventBus"):
            EventRecorder(bad)
