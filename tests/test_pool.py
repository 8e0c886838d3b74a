"""Unit tests of the foundation: spec, storage, block state machine, pool operations, errors, events."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvlab
from kvlab import (BlockPool, BlockStatus, ConfigError, DoubleFreeError, EventRecorder, IllegalTransitionError,
                   KVDataError, KVSpec, OutOfBlocksError, RefcountUnderflowError, ReferenceManager, UnknownBlockError)
from kvlab.textbook.pool import KVBlock, TextbookPool

from _util import assert_same_state, pool_state, small_spec


def kv_for(pool: BlockPool, tokens: int, seed: int = 0) -> torch.Tensor:
    s = pool.spec
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, s.num_layers, tokens, s.num_kv_heads, s.head_dim, generator=g).to(s.device, s.dtype)


# ---------------------------------------------------------------- spec, storage, device
def test_spec_sizes():
    s = small_spec()
    assert s.bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert s.bytes_per_block == s.bytes_per_token * 4
    assert s.blocks_for_budget(10 * s.bytes_per_block + 7) == 10
    with pytest.raises(ConfigError, match="head_dim"):
        KVSpec(head_dim=0)
    with pytest.raises(ConfigError, match="holds no block"):
        s.blocks_for_budget(3)


class FixedClock:
    """A clock that always reads ``value``: what a pool is given decides whether it is accepted."""

    def __init__(self, value: object) -> None:
        self.value = value

    def now(self) -> object:
        return self.value

    tick = now


@pytest.mark.parametrize("cls", [BlockPool, kvlab.FastBlockPool])
@pytest.mark.parametrize("reading", [True, 1.0, -1, 2**62 + 1, 2**63 - 1, None, np.int64(3)])
def test_a_pool_refuses_a_clock_that_cannot_stamp_int64(cls, reading):
    """Stamps are int64 and every mutation ticks: a clock reading a non-int, a negative value or a value too
    close to 2**63 is refused when the pool is built, not by an OverflowError half-way through an allocation."""
    with pytest.raises(ConfigError, match=re.escape(f"now() gave {reading!r}")):
        cls(4, with_storage=False, clock=FixedClock(reading))


@pytest.mark.parametrize("cls", [BlockPool, kvlab.FastBlockPool])
def test_a_clock_at_the_latest_start_still_ticks_into_int64(cls):
    pool = cls(4, with_storage=False, clock=kvlab.LogicalClock(kvlab.core.checks.CLOCK_MAX))
    b = pool.allocate(1)[0]
    pool.free([b])
    top = kvlab.core.checks.CLOCK_MAX
    assert pool.arrays.created[b] == top + 1 and pool.clock.now() == top + 2
    pool.check_invariants()


@pytest.mark.parametrize("start", [True, -5, None, "1", 1.0, np.int64(1)])
def test_a_logical_clock_starts_at_an_int(start):
    with pytest.raises(ConfigError, match=re.escape(f"not {start!r}")):
        kvlab.LogicalClock(start)


def test_pool_from_budget_and_one_tensor(spec):
    p = BlockPool(total_memory=8 * spec.bytes_per_block + 1, spec=spec)
    assert p.num_blocks == 8
    assert p.storage.kv.shape == (2, 2, 8, 4, 2, 4)
    assert p.storage.nbytes == 8 * spec.bytes_per_block
    with pytest.raises(ConfigError, match="exactly one"):
        BlockPool(4, total_memory=10**6, spec=spec)


def test_default_device_env(monkeypatch):
    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    assert kvlab.default_device() == torch.device("cpu")
    monkeypatch.setenv("KVLAB_DEVICE", "not-a-device")
    with pytest.raises(ConfigError, match="not-a-device"):
        kvlab.default_device()
    if not torch.cuda.is_available():
        monkeypatch.setenv("KVLAB_DEVICE", "cuda")
        with pytest.raises(ConfigError, match="CUDA is not available"):
            kvlab.default_device()


def test_import_does_not_load_jupyter():
    code = ("import sys, kvlab; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('ipywidgets', 'anywidget', 'jupyterlab', 'ipykernel', 'IPython', 'traitlets')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_storage_slot_write_read_and_copy(pool):
    st = pool.storage
    k = torch.arange(3 * 2 * 4, dtype=torch.float32, device=st.kv.device).view(3, 2, 4)
    st.write_slots(1, [5, 9, 0], k, -k)
    k2, v2 = st.read_slots(1, [5, 9, 0])
    assert torch.equal(k2, k) and torch.equal(v2, -k)
    assert torch.equal(st.kv[0, 1, 1, 1], k[0])  # slot 5 = block 1, offset 1
    st.copy_blocks([1], [3])
    assert torch.equal(st.kv[:, :, 3], st.kv[:, :, 1])
    with pytest.raises(KVDataError, match="shape"):
        st.write_slots(0, [0], torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))
    with pytest.raises(KVDataError, match="dtype"):
        st.write_slots(0, [0], torch.zeros(1, 2, 4, dtype=torch.float64), torch.zeros(1, 2, 4, dtype=torch.float64))


# ---------------------------------------------------------------- block state machine and KVBlock view
@pytest.mark.parametrize("old,new,ok", [
    (BlockStatus.FREE, BlockStatus.PENDING, True), (BlockStatus.FREE, BlockStatus.ALLOCATED, True),
    (BlockStatus.FREE, BlockStatus.EVICTING, False), (BlockStatus.PENDING, BlockStatus.ALLOCATED, True),
    (BlockStatus.PENDING, BlockStatus.EVICTING, False), (BlockStatus.ALLOCATED, BlockStatus.EVICTING, True),
    (BlockStatus.ALLOCATED, BlockStatus.PENDING, False), (BlockStatus.EVICTING, BlockStatus.FREE, True),
    (BlockStatus.EVICTING, BlockStatus.ALLOCATED, False),
])
def test_state_machine_edges(old, new, ok):
    if ok:
        BlockStatus.check(7, old, new)
    else:
        with pytest.raises(IllegalTransitionError, match=f"block 7: illegal transition {old.name} -> {new.name}"):
            BlockStatus.check(7, old, new)


def test_kvblock_is_a_view(pool, spec):
    blk = KVBlock(pool, 3)
    assert blk.status is BlockStatus.FREE and blk.memory_usage == spec.bytes_per_block  # capacity is fixed
    assert blk.is_compatible(spec.bytes_per_block) and not blk.is_compatible(spec.bytes_per_block + 1)
    data = kv_for(pool, 3)
    blk.allocate(data)
    assert blk.status is BlockStatus.ALLOCATED and blk.reference_count == 1 and blk.token_count == 3
    assert torch.equal(blk.kv_data[:, :, :3], data)
    assert blk.kv_data.data_ptr() == pool.storage.kv[:, :, 3].data_ptr()  # no copy
    blk.kv_data[0, 0, 3] = 7.0  # writes go to the one tensor
    assert torch.all(pool.storage.kv[0, 0, 3, 3] == 7.0)
    blk.increment_reference()
    assert blk.reference_count == 2 and KVBlock(pool, 3).reference_count == 2
    blk.decrement_reference()
    blk.decrement_reference()
    assert blk.is_cached and blk.status is BlockStatus.ALLOCATED
    blk.release()
    assert blk.status is BlockStatus.FREE and blk.token_count == 0
    with pytest.raises(IllegalTransitionError):
        blk.release()


def test_kvblock_allocate_rejects_bad_data(pool):
    blk = KVBlock(pool, 0)
    before = pool_state(pool)
    for bad in (torch.zeros(2, 2, 5, 2, 4), torch.zeros(2, 2, 1, 3, 4), torch.zeros(2, 2, 1, 2, 4, dtype=torch.half),
                "not a tensor"):
        with pytest.raises(KVDataError):
            blk.allocate(bad)
        assert_same_state(before, pool_state(pool))
    with pytest.raises(UnknownBlockError, match="block 16 is not in this pool"):
        KVBlock(pool, 16)


# ---------------------------------------------------------------- allocation and release
def test_allocate_free_lowest_first_and_counts(pool):
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert pool.status_counts() == {"FREE": 13, "PENDING": 0, "ALLOCATED": 3, "EVICTING": 0}
    pool.free(ids)
    pool.check_invariants()
    assert pool.num_free_blocks == 16
    big = pool.allocate(100 // 10)  # vectorised path
    assert len(set(big)) == 10
    pool.free(big)
    many = pool.allocate(16)
    assert sorted(many) == list(range(16))
    pool.check_invariants()


def test_out_of_blocks_changes_nothing(pool):
    pool.allocate(10)
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError, match="asked for 7 blocks"):
        pool.allocate(7)
    assert_same_state(before, pool_state(pool))


@pytest.mark.parametrize("bad", [[99], [-1], ["x"], [1.5]])
def test_unknown_ids_rejected(pool, bad):
    pool.allocate(2)
    before = pool_state(pool)
    for op in (pool.free, pool.incref, pool.decref):
        with pytest.raises(UnknownBlockError):
            op(bad)
        assert_same_state(before, pool_state(pool))


def test_double_free_and_underflow(pool):
    a, b = pool.allocate(2)
    pool.free([a])
    before = pool_state(pool)
    with pytest.raises(DoubleFreeError, match=f"block {a} is FREE"):
        pool.free([a])
    with pytest.raises(DoubleFreeError):
        pool.free([b, b])  # released twice in one call with refcount 1
    with pytest.raises(DoubleFreeError):
        pool.free([b, a])  # the batch is all or nothing: b must still be allocated afterwards
    assert_same_state(before, pool_state(pool))
    pool.decref([b])  # b is cached now (refcount 0)
    before = pool_state(pool)
    with pytest.raises(RefcountUnderflowError, match=f"block {b} has refcount 0"):
        pool.decref([b])
    with pytest.raises(DoubleFreeError, match="cached"):
        pool.free([b])
    with pytest.raises(IllegalTransitionError, match="only ALLOCATED"):
        pool.incref([a])
    assert_same_state(before, pool_state(pool))


def test_reusable_blocks_become_cached_then_evicted_lru(pool):
    ids = pool.allocate(4)
    pool.mark_reusable(ids)
    for b in (ids[2], ids[0], ids[3]):
        pool.free([b])
    assert pool.num_cached_blocks == 3
    assert [b for b, _ in pool.policy.rank()] == [ids[2], ids[0], ids[3]]
    pool.incref([ids[0]])  # a cache hit takes it out of the evictable set
    assert ids[0] not in pool.policy
    assert pool.evict() == ids[2]
    assert pool.evict() == ids[3]
    assert pool.evict() is None  # ids[0] and ids[1] are referenced: never candidates
    pool.check_invariants()


def test_allocation_evicts_when_free_runs_out(pool):
    ids = pool.allocate(16)
    pool.mark_reusable(ids[:4])
    pool.decref(ids[:4])
    rec = EventRecorder(pool.events)
    got = pool.allocate(3)
    assert sorted(got) == sorted(ids[:3])  # LRU order: the first three decref'd together, ties by block order
    assert pool.stats()["served_evict"] == 3
    evs = rec.of(kvlab.Evicted)
    assert len(evs) == 3 and all(e.reason == "allocation pressure" for e in evs)
    assert evs[0].candidates[0][0] == evs[0].block_id
    pool.check_invariants()


def test_evict_guard_vetoes_and_next_candidate_is_taken(pool):
    ids = pool.allocate(3)
    pool.decref(ids)
    pool.evict_guard = lambda b: b != ids[0]
    assert pool.evict() == ids[1]
    seen = []
    pool.evict_hooks.append(seen.append)
    assert pool.evict() == ids[2]
    assert pool.evict() is None and seen == [ids[2]]


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "random"])
def test_policies_rank_with_scores_and_never_pick_referenced(spec, policy):
    p = BlockPool(8, spec=spec, eviction_policy=policy, seed=3)
    ids = p.allocate(8)
    p.incref([ids[5], ids[5], ids[6]])
    p.decref(ids[:5] + [ids[5], ids[5]])  # ids[5] ends with refcount 1: referenced
    ranked = p.policy.rank(10)
    assert sorted(b for b, _ in ranked) == sorted(ids[:5])
    if policy in ("lru", "fifo", "lfu"):
        assert [s for _, s in ranked] == sorted(s for _, s in ranked)
    victims = [p.evict() for _ in range(5)]
    assert sorted(victims) == sorted(ids[:5]) and p.evict() is None
    p.check_invariants()


def test_lfu_prefers_rarely_used(spec):
    p = BlockPool(4, spec=spec, eviction_policy="lfu")
    a, b = p.allocate(2)
    p.touch([a, a, a])
    p.decref([a, b])
    assert p.evict() == b


def test_random_policy_is_seeded(spec):
    def victims(seed):
        p = BlockPool(16, spec=spec, eviction_policy="random", seed=seed)
        p.decref(p.allocate(16))
        return [p.evict() for _ in range(8)]
    assert victims(1) == victims(1) and victims(1) != victims(2)
    with pytest.raises(ConfigError, match="unknown eviction policy 'mru'"):
        BlockPool(4, spec=spec, eviction_policy="mru")


def test_pending_and_evicting_lifecycle(pool):
    r = pool.reserve(2)
    assert pool.status_counts()["PENDING"] == 2
    before = pool_state(pool)
    with pytest.raises(IllegalTransitionError, match="PENDING -> EVICTING"):
        pool.begin_eviction(r[:1])
    assert_same_state(before, pool_state(pool))
    pool.commit(r)
    pool.begin_eviction([r[0]])
    assert KVBlock(pool, r[0]).status is BlockStatus.EVICTING
    with pytest.raises(DoubleFreeError):
        pool.free([r[0]])
    with pytest.raises(IllegalTransitionError):
        pool.incref([r[0]])
    pool.finish_eviction([r[0]])
    pool.free([pool.reserve(1)[0]])  # a PENDING block freed is aborted back to FREE
    pool.free([r[1]])
    assert pool.num_free_blocks == 16
    pool.check_invariants()


def test_get_best_block_and_allocate_block(pool, spec):
    assert TextbookPool(pool).get_best_block(spec.bytes_per_block).block_id == 0
    assert TextbookPool(pool).get_best_block(spec.bytes_per_block + 1) is None  # nothing that large in a uniform pool
    blk = TextbookPool(pool).allocate_block(5)
    assert blk.block_id == 5 and blk.status is BlockStatus.ALLOCATED
    before = pool_state(pool)
    with pytest.raises(IllegalTransitionError, match="ALLOCATED -> ALLOCATED"):
        TextbookPool(pool).allocate_block(5)
    assert_same_state(before, pool_state(pool))
    TextbookPool(pool).release_block(5)
    pool.check_invariants()


def test_reference_manager_is_one_truth(pool):
    rm = ReferenceManager(pool)
    (b,) = pool.allocate(1)
    rm.add_reference(b)
    assert rm.get_reference_count(b) == 2 == KVBlock(pool, b).reference_count
    pool.free([b])
    assert rm.get_reference_count(b) == 1
    assert rm.get_all_references() == {b: 1}
    assert not rm.is_safe_to_evict(b)
    rm.remove_reference(b)
    assert rm.is_safe_to_evict(b) and rm.get_all_references() == {}
    with pytest.raises(RefcountUnderflowError):
        rm.remove_reference(b)


def test_batch_ops_take_one_lock_each(pool):
    n0 = pool.lock_acquisitions
    ids = pool.allocate(12)
    pool.incref(ids)
    pool.decref(ids)
    pool.free(ids)
    assert pool.lock_acquisitions - n0 == 4


def test_events_are_typed_and_stamped(pool):
    rec = EventRecorder(pool.events)
    ids = pool.allocate(2)
    pool.incref(ids[:1])
    pool.free(ids)
    pool.free(ids[:1])
    kinds = [e.kind for e in rec]
    assert kinds == ["Allocated", "RefChanged", "RefChanged", "Freed", "Freed"]
    steps = [e.step for e in rec]
    assert steps == sorted(steps) and len(set(steps)) == 4
    assert rec.events[0].as_dict()["block_ids"] == (0, 1)
    rec.close()
    pool.allocate(1)
    assert len(rec) == 5


def test_snapshot_is_a_consistent_copy(pool):
    ids = pool.allocate(3)
    pool.set_token_count(ids[0], 4)
    pool.decref([ids[2]])
    snap = pool.snapshot()
    assert snap["status"].dtype == np.uint8 and snap["status"][:3].tolist() == [2, 2, 2]
    assert snap["tokens"][ids[0]] == 4 and snap["cached"][ids[2]] and not snap["cached"][ids[0]]
    pool.free(ids[:2])
    assert snap["status"][0] == 2  # a copy, not a live view


def test_memory_usage_and_fragmentation(pool, spec):
    ids = pool.allocate(4)
    pool.set_token_count(ids[0], 3)
    mu = TextbookPool(pool).get_memory_usage()
    assert mu["used"] == 4 * spec.bytes_per_block and mu["free"] == 12 * spec.bytes_per_block
    assert mu["token_bytes"] == 3 * spec.bytes_per_token
    pool.free(ids[::2])
    assert TextbookPool(pool).calculate_fragmentation() == 0  # uniform pool: any free block serves any request
    with pytest.raises(KVDataError, match="at most 4 tokens"):
        pool.set_token_count(ids[1], 5)


def test_buddy_pool_split_and_merge(spec):
    p = BlockPool(16, spec=spec, block_sizes=[4, 8, 16])
    assert p.block_sizes == [4, 8, 16] and p.max_order == 2
    a, a2 = p.allocate(2, size_class=0)
    assert p.stats()["splits"] == 2 and KVBlock(p, a).capacity_tokens == 4
    big = p.allocate(1, size_class=2)[0]
    assert KVBlock(p, big).memory_usage == 4 * spec.bytes_per_block
    p.free([a])
    frag = TextbookPool(p).calculate_fragmentation()
    assert frag == round(100 * 3 / 11)  # 3 of 11 free base blocks sit in a window that a2 keeps from merging
    assert p.merge_free_buddies() == 0  # a's buddy a2 is allocated
    p.free([a2])
    assert TextbookPool(p).calculate_fragmentation() == 0  # the window is all free: merging can rebuild a largest block
    assert p.merge_free_buddies() == 2 and p.free_lists.count(2) == 3
    with pytest.raises(UnknownBlockError, match="inside block"):
        KVBlock(p, big + 1)
    with pytest.raises(ConfigError, match="power-of-two"):
        BlockPool(16, spec=spec, block_sizes=[4, 12])
    p.check_invariants()


def test_migrate_moves_data_and_calls_hooks(pool):
    ids = pool.allocate(2)
    data = kv_for(pool, 4, seed=1)
    pool.storage.block_view(ids[1])[:] = data
    pool.set_token_count(ids[1], 4)
    moved = []
    pool.relocation_hooks.append(lambda s, d: moved.append((s.tolist(), d.tolist())))
    pool.migrate([ids[1]], [9])
    assert moved == [([ids[1]], [9])]
    assert torch.equal(KVBlock(pool, 9).kv_data, data) and KVBlock(pool, 9).token_count == 4
    assert KVBlock(pool, ids[1]).status is BlockStatus.FREE
    before = pool_state(pool)
    with pytest.raises(IllegalTransitionError, match="not FREE"):
        pool.migrate([ids[0]], [9])
    assert_same_state(before, pool_state(pool))
    pool.check_invariants()


def test_metadata_only_pool_is_large_and_cheap():
    p = BlockPool(1_000_000, with_storage=False)
    assert p.storage is None
    ids = p.allocate(1000)
    p.free(ids)
    with pytest.raises(ConfigError, match="metadata-only"):
        KVBlock(p, 0).kv_data
    p.check_invariants()


def test_pool_larger_than_device_memory_fails_fast_with_what_fits():
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, device="cpu")
    with pytest.raises(ConfigError, match=r"at most \d+ blocks fit"):
        BlockPool(10**9, spec=spec)


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "random"])
def test_evicted_event_ranks_runners_up_and_listening_changes_nothing(spec, policy):
    def run(listen: bool):
        p = BlockPool(16, spec=spec, eviction_policy=policy, seed=5)
        rec = EventRecorder(p.events) if listen else None
        ids = p.allocate(16)
        p.touch(ids[::3])
        p.decref(ids)
        victims = [p.evict() for _ in range(6)]
        return victims, rec
    victims, rec = run(True)
    assert victims == run(False)[0]  # observing the ranking never changes the policy's choices
    evs = rec.of(kvlab.Evicted)
    assert [e.block_id for e in evs] == victims
    first = evs[0]
    assert first.candidates[0][0] == first.block_id and len(first.candidates) == 8
    assert len({b for b, _ in first.candidates}) == 8
    if policy != "random":
        scores = [s for _, s in first.candidates]
        assert scores == sorted(scores)


POOL_CLASSES = [BlockPool, kvlab.PyFastBlockPool, kvlab.FastBlockPool]


@pytest.mark.parametrize("cls", POOL_CLASSES, ids=lambda c: c.__name__)
def test_migrations_are_counted_in_blocks(cls):
    """``counts["migrations"]`` (and ``get_stats``) counts blocks moved, not calls: a defragmentation's report
    and the counter agree."""
    p = cls(6, with_storage=False)
    p.free(p.allocate(4)[:2])
    p.migrate([2, 3], [0, 1])
    assert p.counts["migrations"] == p.stats()["migrations"] == 2
    assert sorted(p.allocate(4)) == [2, 3, 4, 5]
    p.free([2, 3])  # holes below blocks 4 and 5
    report = kvlab.DefragmentationStrategy(p).defragment(force=True)
    assert len(report.moves) == 2 and p.counts["migrations"] == 2 + 2


@pytest.mark.parametrize("cls", POOL_CLASSES, ids=lambda c: c.__name__)
def test_merge_cap_counts_merges_across_size_classes(cls):
    """``max_merges`` caps the merges of one call over every class: four free class-0 blocks, cap 2, make two
    class-1 blocks and stop there (without the cap they would go on into one class-2 block)."""
    p = cls(4, spec=KVSpec(block_size=16), block_sizes=[16, 32, 64], with_storage=False)
    rec = EventRecorder(p.events)
    p.split_block(0), p.split_block(0), p.split_block(2)
    assert [len(p.free_ids(k)) for k in range(3)] == [4, 0, 0]
    assert p.merge_free_buddies(max_merges=2) == 2
    assert [len(p.free_ids(k)) for k in range(3)] == [0, 2, 0] and len(rec.of(kvlab.Merged)) == 2
    assert p.merge_free_buddies() == 1 and [len(p.free_ids(k)) for k in range(3)] == [0, 0, 1]


def _free_block(p):
    """A block that was allocated and freed again (so it has a history), and the pool."""
    (b,) = p.allocate(1, owner=3)
    p.set_token_count(b, 2)
    p.free([b])
    return b


def _cached_block(p):
    (b,) = p.allocate(1)
    p.mark_reusable([b])
    p.free([b])
    return b


CORRUPTIONS = {  # what is broken -> (how, the words the assertion names)
    "owner of a FREE block": (lambda p: p.meta.owner.__setitem__(_free_block(p), 7), "owner"),
    "refcount of a FREE block": (lambda p: p.meta.refcount.__setitem__(_free_block(p), 1), "refcount"),
    "tokens of a FREE block": (lambda p: p.meta.tokens.__setitem__(_free_block(p), 3), "tokens"),
    "reusable FREE block": (lambda p: p.meta.reusable.__setitem__(_free_block(p), 1), "reusable"),
    "negative refcount": (lambda p: p.meta.refcount.__setitem__(p.allocate(1)[0], -1), "negative refcount"),
    "tokens over capacity": (lambda p: p.meta.tokens.__setitem__(p.allocate(1)[0], p.block_size + 1),
                             "more tokens than it holds"),
    "block twice on a free stack": (lambda p: p.free_lists.stacks[0].append(p.free_ids()[0]), "twice"),
    "FREE status off the free stack": (lambda p: p.free_lists.stacks[0].remove(p.free_ids()[-1]),
                                       "free stacks disagree"),
    "ALLOCATED status on the free stack": (lambda p: p.meta.status.__setitem__(p.free_ids()[0], 2),
                                           "free stacks disagree"),
    "cached block missing from the policy": (lambda p: p.policy.discard(_cached_block(p)), "evictable set"),
    "referenced block in the policy": (lambda p: p.policy.add(p.allocate(1)[0]), "evictable set"),
}


@pytest.mark.parametrize("cls", POOL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_check_invariants_names_each_broken_invariant(cls, what):
    """``check_invariants`` is the property tests' detector, so it is tested as one: each invariant broken on
    purpose (by writing the pool's fields behind its back) fails it with a message naming what broke."""
    p = cls(8, spec=KVSpec(block_size=4), with_storage=False)
    p.check_invariants()
    corrupt, words = CORRUPTIONS[what]
    corrupt(p)
    with pytest.raises(AssertionError, match=words):
        p.check_invariants()


# ---------------------------------------------------------------- what a block view reports
def test_only_an_allocated_block_without_references_is_cached(pool):
    """``KVBlock.is_cached`` (and ``ReferenceManager.is_safe_to_evict``, which reads it) needs both halves:
    ALLOCATED *and* refcount 0. A FREE block and an EVICTING one also have refcount 0 but hold nothing that may
    be evicted; a PENDING block is owned; a referenced one is in use. Only the cached block answers True."""
    rm = ReferenceManager(pool)
    (held,) = pool.allocate(1)
    cached = _cached_block(pool)
    (pending,) = pool.reserve(1)
    evicting = _cached_block(pool)
    pool.begin_eviction([evicting])
    free = pool.free_ids()[0]
    blocks = {"free": free, "pending": pending, "held": held, "evicting": evicting, "cached": cached}
    assert {name: KVBlock(pool, b).status.name for name, b in blocks.items()} == {
        "free": "FREE", "pending": "PENDING", "held": "ALLOCATED", "evicting": "EVICTING", "cached": "ALLOCATED"}
    refs = {name: KVBlock(pool, b).reference_count for name, b in blocks.items()}
    assert refs == {"free": 0, "pending": 1, "held": 1, "evicting": 0, "cached": 0}
    expected = {"free": False, "pending": False, "held": False, "evicting": False, "cached": True}
    assert {name: KVBlock(pool, b).is_cached for name, b in blocks.items()} == expected
    assert {name: rm.is_safe_to_evict(b) for name, b in blocks.items()} == expected
    assert {name: pool.is_cached(b) for name, b in blocks.items()} == expected  # the pool's own answer agrees


def test_capacity_tokens_follows_the_size_class(spec):
    """A buddy block of class k holds ``block_size << k`` tokens (and as many bytes as that many base blocks):
    with sizes 16, 32 and 64 a class-1 block holds 32 tokens and a class-2 block 64, not the base 16."""
    p = BlockPool(8, spec=spec, block_sizes=[16, 32, 64])
    b0, b1, b2 = (p.allocate(1, size_class=k)[0] for k in (0, 1, 2))
    assert [KVBlock(p, b).size_class for b in (b0, b1, b2)] == [0, 1, 2]
    assert [KVBlock(p, b).capacity_tokens for b in (b0, b1, b2)] == [16, 32, 64]
    bpb = p.bytes_per_block
    assert [KVBlock(p, b).memory_usage for b in (b0, b1, b2)] == [bpb, 2 * bpb, 4 * bpb]


def test_a_budget_of_exactly_one_block_makes_a_one_block_pool(spec):
    """``total_memory`` equal to one block's bytes is enough for one block; one byte less holds none and is
    refused (the boundary of ``blocks_for_budget``)."""
    p = BlockPool(total_memory=spec.bytes_per_block, spec=spec)
    assert p.num_blocks == 1 and p.storage.nbytes == spec.bytes_per_block
    assert spec.blocks_for_budget(spec.bytes_per_block) == 1
    with pytest.raises(ConfigError, match=f"total_memory={spec.bytes_per_block - 1} bytes holds no block"):
        BlockPool(total_memory=spec.bytes_per_block - 1, spec=spec)
