"""FragmentationDetector against plain-loop references; DefragmentationStrategy moves data bitwise, rewrites
block tables through relocation hooks, leaves PENDING/EVICTING blocks alone, and keeps attention outputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _util import assert_same_state, pool_state, small_spec
from kvlab import BlockPool, BlockStatus, DefragmentationStrategy, FragmentationDetector
from kvlab.core.attention import paged_attention
from kvlab.textbook.pool import KVBlock

FREE, ALLOCATED = BlockStatus.FREE, BlockStatus.ALLOCATED


def _reference(pool: BlockPool) -> dict:
    """The detector's numbers computed with plain loops over base blocks."""
    st = pool.arrays.status.tolist()
    runs, run = [], 0
    for s in st + [-1]:
        if s == FREE:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    used = [i for i, s in enumerate(st) if s != FREE]
    heads = [b for b in range(pool.num_blocks) if b % (1 << pool.fields.size_class[b]) == 0]
    alloc = [b for b in heads if st[b] == ALLOCATED]
    slots = sum(KVBlock(pool, b).capacity_tokens for b in alloc)
    return {"external_fragmentation": 1 - max(runs) / sum(runs) if runs else 0.0,
            "largest_free_run": max(runs, default=0),
            "free_run_histogram": {k: runs.count(k) for k in sorted(set(runs))},
            "internal_waste": 1 - sum(KVBlock(pool, b).token_count for b in alloc) / slots if slots else 0.0,
            "scatter": (used[-1] + 1) / len(used) if used else 1.0}


def _checkerboard(pool: BlockPool) -> list[int]:
    """Allocate everything, then free every other block; each kept block holds tokens and a pattern."""
    ids = pool.allocate(pool.num_blocks)
    pool.free(ids[::2])
    for b in ids[1::2]:
        pool.set_token_count(b, 1 + b % pool.block_size)
        KVBlock(pool, b).kv_data.copy_(torch.randn_like(KVBlock(pool, b).kv_data))
    return ids[1::2]


def test_detector_matches_reference_and_keeps_the_texts_keys():
    pool = BlockPool(16, spec=small_spec())
    _checkerboard(pool)
    pool.free([15])
    d = FragmentationDetector(pool, threshold=20).detect_fragmentation()
    assert {k: d[k] for k in _reference(pool)} == _reference(pool)
    # A uniform pool: any free block serves any request, so nothing free is unusable...
    assert d["fragmentation_percent"] == 0 and d["free_blocks"] == {4: 9}
    # ...yet the free space is in 8 pieces: external fragmentation is high and drives should_defragment.
    assert d["external_fragmentation"] == pytest.approx(1 - 2 / 9) and d["should_defragment"]
    assert d["memory_info"]["free"] == 9 * pool.bytes_per_block


def test_multi_class_pool_unusable_and_external_measures():
    pool = BlockPool(16, spec=small_spec(), block_sizes=[4, 8])
    ids = pool.allocate(8, size_class=0)  # splits 0..7 into eight class-0 blocks
    pool.free(ids[::2])
    d = FragmentationDetector(pool).detect_fragmentation()
    assert {k: d[k] for k in _reference(pool)} == _reference(pool)
    assert d["free_blocks"] == {4: 4, 8: 4}
    assert d["fragmentation_percent"] == 33  # 4 of 12 free base blocks cannot form an 8-token block
    assert d["external_fragmentation"] == pytest.approx(1 - 8 / 12)


def test_empty_and_full_pools():
    pool = BlockPool(4, spec=small_spec())
    d = FragmentationDetector(pool).detect_fragmentation()
    assert (d["external_fragmentation"], d["scatter"], d["internal_waste"], d["should_defragment"]) == (0, 1, 0, False)
    pool.allocate(4)
    d = FragmentationDetector(pool).detect_fragmentation()
    assert (d["external_fragmentation"], d["free_run_histogram"], d["internal_waste"]) == (0, {}, 1.0)


@pytest.mark.parametrize("sizes", [None, [4, 8, 16]])
def test_compaction_moves_data_bitwise_and_rewrites_tables(sizes):
    pool = BlockPool(32, spec=small_spec(), block_sizes=sizes)
    kept = _checkerboard(pool)
    data = {b: KVBlock(pool, b).kv_data.clone() for b in kept}
    tokens = {b: KVBlock(pool, b).token_count for b in kept}
    table = {b: b for b in kept}  # logical id -> physical block, rewritten by the hook
    pool.relocation_hooks.append(lambda s, d: table.update(
        {k: dict(zip(s.tolist(), d.tolist())).get(v, v) for k, v in table.items()}))
    report = DefragmentationStrategy(pool).defragment()
    pool.check_invariants()
    assert report.ran and len(report.moves) == 8 and report.bytes_moved == 8 * pool.bytes_per_block
    assert all(s > d for s, d in report.moves)  # always downward
    assert sorted(table.values()) == list(range(16))  # packed at the bottom
    for b in kept:
        moved = KVBlock(pool, table[b])
        assert torch.equal(moved.kv_data, data[b]) and moved.token_count == tokens[b]
    assert report.fragmentation_after == {"fragmentation_percent": 0.0, "external_fragmentation": 0.0}
    assert report.fragmentation_before["external_fragmentation"] > 0.4
    assert FragmentationDetector(pool).detect_fragmentation()["scatter"] == 1.0
    assert DefragmentationStrategy(pool).defragment(force=True).moves == ()  # nothing left to do


def test_multi_class_compaction_splits_a_low_hole_to_the_movers_class():
    pool = BlockPool(16, spec=small_spec(), block_sizes=[4, 8, 16])
    low = pool.allocate(1, size_class=2)  # block 0, class 2
    high = pool.allocate(1, size_class=1)  # block 4 (class 2 at 4 split)
    top = pool.allocate(1, size_class=0)  # block 6
    pool.free(low)
    KVBlock(pool, high[0]).kv_data.fill_(3.0)
    KVBlock(pool, top[0]).kv_data.fill_(5.0)
    report = DefragmentationStrategy(pool).defragment(force=True)
    pool.check_invariants()
    assert report.moves == ((6, 0), (4, 2))
    assert (KVBlock(pool, 2).kv_data == 3.0).all() and (KVBlock(pool, 0).kv_data == 5.0).all()
    # Three used base blocks leave one of the first four unusable for a class-2 request: 1 of 13 free, the least
    # possible; the free space is now one run above them.
    assert report.fragmentation_after == {"fragmentation_percent": 8.0, "external_fragmentation": 1 - 12 / 13}
    assert report.fragmentation_before["external_fragmentation"] == 1 - 9 / 13


def test_pending_and_evicting_blocks_never_move():
    pool = BlockPool(12, spec=small_spec())
    ids = pool.allocate(10)
    pool.free(ids[:6])
    pending = pool.reserve(2)  # blocks 0 and 1 come back PENDING... they stay where they are
    pool.begin_eviction([9])
    before = pool.arrays.status.copy()
    report = DefragmentationStrategy(pool).defragment(force=True)
    pool.check_invariants()
    moved_from = {s for s, _ in report.moves}
    assert moved_from == {8, 7, 6} and not moved_from & {9, *pending}
    assert pool.arrays.status[9] == BlockStatus.EVICTING and (pool.arrays.status[pending] == BlockStatus.PENDING).all()
    assert before[9] == pool.arrays.status[9]


def test_cached_blocks_move_and_stay_evictable():
    pool = BlockPool(8, spec=small_spec())
    ids = pool.allocate(8)
    pool.free(ids[:4])
    pool.mark_reusable([7])
    pool.free([7])
    DefragmentationStrategy(pool).defragment(force=True)
    pool.check_invariants()
    assert [b for b, _ in pool.policy.order()] == [0] and pool.evict() == 0


def test_incremental_cap_and_threshold():
    pool = BlockPool(64, spec=small_spec())
    _checkerboard(pool)
    strat = DefragmentationStrategy(pool, minimum_fragmentation=15, max_moves=5)
    reports = []
    while (r := strat.defragment()):
        reports.append(r)
        pool.check_invariants()
    # After 15 moves the top 30 base blocks are one free run: 1 - 30/32 = 6% < 15%, so the fourth call only measures.
    assert [len(r.moves) for r in reports] == [5, 5, 5] and not r.ran and r.moves == ()
    assert r.fragmentation_before["external_fragmentation"] == 1 - 30 / 32
    assert len(strat.defragment(force=True).moves) == 1  # hole 30 < mover 33; hole 32 lies above mover 31
    assert not strat.defragment(force=True)
    before = pool_state(pool)
    assert not DefragmentationStrategy(pool).defragment()
    assert_same_state(before, pool_state(pool))


def test_attention_of_live_sequences_is_unchanged():
    spec = small_spec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    pool = BlockPool(64, spec=spec)
    gen = torch.Generator().manual_seed(0)
    lens = [13, 7, 22, 4, 17]
    tables = {i: [] for i in range(len(lens))}
    filler = pool.allocate(20)  # blocks 0..19; freeing half of them later leaves holes below the sequences
    for step in range(max(lens)):  # interleaved appends: each sequence's blocks are scattered over the pool
        for i, n in enumerate(lens):
            if step < n and step % spec.block_size == 0:
                tables[i] += pool.allocate(1, owner=i)
            if step < n:
                slot = tables[i][step // spec.block_size] * spec.block_size + step % spec.block_size
                for layer in range(spec.num_layers):
                    k, v = (torch.randn(1, 2, 8, generator=gen).to(spec.device) for _ in range(2))
                    pool.storage.write_slots(layer, [slot], k, v)
    pool.free(filler[::2])
    live = [0, 2, 4]
    for i in (1, 3):
        pool.free(tables.pop(i))
    pool.relocation_hooks.append(lambda s, d: [t.__setitem__(j, dict(zip(s.tolist(), d.tolist())).get(b, b))
                                               for t in tables.values() for j, b in enumerate(t)])
    q = torch.randn(len(live), 4, 8, generator=gen).to(spec.device)

    def outputs() -> list[torch.Tensor]:
        return [paged_attention(q, pool, layer, [tables[i] for i in live], [lens[i] for i in live])
                for layer in range(spec.num_layers)]

    before, old_tables = outputs(), {i: list(t) for i, t in tables.items()}
    report = DefragmentationStrategy(pool).defragment(force=True)
    assert report.moves and tables != old_tables
    pool.storage.kv[:, :, torch.from_numpy(np.flatnonzero(pool.arrays.status == FREE))] = float("nan")  # vacated
    assert all(torch.equal(a, b) for a, b in zip(before, outputs()))
    assert FragmentationDetector(pool).detect_fragmentation()["scatter"] == 1.0
    pool.check_invariants()
    np.testing.assert_array_equal(np.sort(np.concatenate([tables[i] for i in live] + [filler[1::2]])),
                                  np.flatnonzero(pool.arrays.status != FREE))


def test_sequence_manager_tables_follow_compaction():
    from kvlab.core.sequence import SequenceManager

    spec = small_spec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    pool = BlockPool(64, spec=spec)
    mgr = SequenceManager(pool)
    gen = torch.Generator().manual_seed(1)
    seqs = [mgr.create() for _ in range(5)]
    for _ in range(6):  # interleaved growth scatters every table over the pool
        for s in seqs:
            slots = s.append(3)
            for layer in range(spec.num_layers):
                k, v = (torch.randn(3, 2, 8, generator=gen).to(spec.device) for _ in range(2))
                pool.storage.write_slots(layer, slots, k, v)
    seqs.append(seqs[0].fork())  # shared blocks move once and both tables follow
    for s in (seqs.pop(3), seqs.pop(1)):
        s.free()
    q = torch.randn(len(seqs), 4, 8, generator=gen).to(spec.device)

    def outputs() -> list[torch.Tensor]:
        return [paged_attention(q, pool, layer, mgr.block_tables(seqs), [len(s) for s in seqs])
                for layer in range(spec.num_layers)]

    before, tables = outputs(), [list(s.block_table) for s in seqs]
    report = DefragmentationStrategy(pool).defragment(force=True)
    assert report.moves and tables != [s.block_table for s in seqs]
    pool.storage.kv[:, :, torch.from_numpy(np.flatnonzero(pool.arrays.status == FREE))] = float("nan")
    assert all(torch.equal(a, b) for a, b in zip(before, outputs()))
    assert seqs[0].block_table == seqs[-1].block_table
    mgr.check_invariants()
    pool.check_invariants()


@pytest.mark.parametrize("sizes", [None, [4, 8, 16]])
def test_after_compaction_the_free_region_is_handed_out_as_runs(sizes):
    pool = BlockPool(512, spec=small_spec(), with_storage=False, block_sizes=sizes)
    rng = np.random.default_rng(3)
    ids = pool.allocate(512)
    keep = set(rng.choice(ids, 150, replace=False).tolist())
    pool.free(rng.permutation([b for b in ids if b not in keep]).tolist())
    got = pool.allocate(64)
    assert got != list(range(got[0], got[0] + 64))  # scattered before
    pool.free(got)
    DefragmentationStrategy(pool).defragment(force=True)
    pool.check_invariants()
    got = pool.allocate(64)
    assert got == list(range(150, 214))  # the lowest free ids, consecutive: one run
