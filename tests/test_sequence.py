"""Sequences: block tables, vectorised slots, fork / copy-on-write, tail-first free, swap, migration, errors, and
a hypothesis state machine checking pool invariants, refcounts and every token's K/V bitwise after each step."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab import (BlockPool, BlockStatus, EventRecorder, FastBlockPool, IllegalTransitionError, KVDataError, KVSpec,
                   OutOfBlocksError, PyFastBlockPool, StatusChanged)
from kvlab.core.errors import ConfigError
from kvlab.core.sequence import CopiedOnWrite, SequenceManager, Swapped

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, device="cpu")


def make(num_blocks=32, spec=SPEC, **kw):
    pool = BlockPool(num_blocks, spec=spec, **kw)
    return pool, SequenceManager(pool)


def tokens_kv(n, start):
    """Distinct K/V per token and layer: ``[layers, 2, n, heads, dim]``, value encodes (token, layer, k/v)."""
    base = torch.arange(start, start + n, dtype=torch.float32)[None, None, :, None, None]
    lay = torch.arange(SPEC.num_layers, dtype=torch.float32)[:, None, None, None, None] * 1e4
    kv = torch.arange(2, dtype=torch.float32)[None, :, None, None, None] * 1e5
    return (base + lay + kv + torch.arange(SPEC.num_kv_heads * SPEC.head_dim).view(SPEC.num_kv_heads,
                                                                                   SPEC.head_dim) / 100)


def write(pool, slots, kv):
    for layer in range(SPEC.num_layers):
        pool.storage.write_slots(layer, slots, kv[layer, 0], kv[layer, 1])


def read(pool, seq):
    slots = seq.slots()
    return torch.stack([torch.stack(pool.storage.read_slots(layer, slots)) for layer in range(SPEC.num_layers)])


def test_append_allocates_on_demand_and_maps_slots():
    pool, mgr = make()
    s = mgr.create()
    slots = s.append(6)
    assert s.num_blocks == 2 and s.num_tokens == 6
    t = s.block_table
    assert slots.tolist() == [t[p // 4] * 4 + p % 4 for p in range(6)]
    assert [pool.fields.tokens[b] for b in t] == [4, 2]
    assert s.append(2).tolist() == [t[1] * 4 + 2, t[1] * 4 + 3] and s.num_blocks == 2
    assert s.append(1).tolist() == [s.block_table[2] * 4]
    assert all(pool.fields.owner[b] == s.seq_id for b in s.block_table)
    mgr.check_invariants()


def test_batch_slots_are_vectorised_per_sequence():
    pool, mgr = make()
    a, b = mgr.create(), mgr.create()
    a.append(3)
    batch = mgr.append_batch([a, b], [5, 2])
    assert batch.query_lens == [5, 2] and batch.seq_lens == [8, 2]
    assert batch.positions.tolist() == [3, 4, 5, 6, 7, 0, 1]
    want = [a.block_table[p // 4] * 4 + p % 4 for p in range(3, 8)] + [b.block_table[0] * 4 + p for p in (0, 1)]
    assert batch.slots.tolist() == want
    assert batch.block_tables.shape == (2, 2)
    assert torch.equal(mgr.slot_mapping([a, b], [0, 0], [8, 2]),
                       torch.cat((a.slots(), b.slots())))


def test_kv_written_through_slots_reads_back_bitwise():
    pool, mgr = make()
    a, b = mgr.create(), mgr.create()
    batch = mgr.append_batch([a, b], [7, 5])
    kv = tokens_kv(12, 0)
    write(pool, batch.slots, kv)
    assert torch.equal(read(pool, a), kv[:, :, :7]) and torch.equal(read(pool, b), kv[:, :, 7:])


def test_metadata_only_pool_counts_tokens():
    pool = BlockPool(8, spec=SPEC, with_storage=False)
    mgr = SequenceManager(pool)
    s = mgr.create()
    slots = s.append(9)
    assert slots.numel() == 9 and s.num_blocks == 3
    c = s.fork()
    c.append(1)  # copy-on-write bookkeeping without a tensor
    assert c.block_table[2] != s.block_table[2]
    s.swap_out()
    assert s.swapped.data is None and pool.num_free_blocks == 8 - 3  # 2 shared + c's copy stay
    s.swap_in()
    mgr.check_invariants()


def test_fork_shares_and_cow_copies_partial_tail():
    pool, mgr = make()
    rec = EventRecorder(pool.events)
    a = mgr.create()
    write(pool, a.append(6), tokens_kv(6, 0))
    b = a.fork()
    assert b.block_table == a.block_table and all(pool.fields.refcount[x] == 2 for x in a.block_table)
    shared_tail = a.block_table[1]
    write(pool, a.append(1), tokens_kv(1, 100))  # a copies the shared, partly filled tail
    assert a.block_table[1] != shared_tail and b.block_table[1] == shared_tail
    assert a.block_table[0] == b.block_table[0] and pool.fields.refcount[a.block_table[0]] == 2
    assert pool.fields.refcount[shared_tail] == 1 and pool.fields.tokens[a.block_table[1]] == 3
    write(pool, b.append(1), tokens_kv(1, 200))  # b now holds the tail alone: writes in place
    assert b.block_table[1] == shared_tail
    base = tokens_kv(6, 0)
    assert torch.equal(read(pool, a), torch.cat((base, tokens_kv(1, 100)), 2))
    assert torch.equal(read(pool, b), torch.cat((base, tokens_kv(1, 200)), 2))
    assert [(e.seq_id, e.src) for e in rec.of(CopiedOnWrite)] == [(a.seq_id, shared_tail)]
    mgr.check_invariants()


def test_full_shared_blocks_are_never_copied():
    pool, mgr = make()
    a = mgr.create()
    a.append(8)
    b = a.fork()
    b.append(1)
    assert b.block_table[:2] == a.block_table and pool.stats()["allocations"] == 3


def test_two_sharers_in_one_batch_copy_once():
    pool, mgr = make()
    a = mgr.create()
    write(pool, a.append(2), tokens_kv(2, 0))
    b, c = a.fork(), a.fork()
    orig, allocations = a.block_table[0], pool.counts["allocations"]
    batch = mgr.append_batch([a, b, c], [1, 1, 1])
    write(pool, batch.slots, tokens_kv(3, 50))
    tails = {a.block_table[0], b.block_table[0], c.block_table[0]}
    assert len(tails) == 3 and c.block_table == [orig]  # the first two copied, the last kept the original
    assert pool.counts["allocations"] == allocations + 2
    for i, s in enumerate((a, b, c)):
        assert torch.equal(read(pool, s), torch.cat((tokens_kv(2, 0), tokens_kv(1, 50 + i)), 2))
    mgr.check_invariants()


@pytest.mark.parametrize("cls", [BlockPool, PyFastBlockPool, FastBlockPool], ids=lambda c: c.__name__)
def test_the_last_sharer_of_a_partial_tail_appends_in_place_even_in_one_batch(cls):
    """A pool with two blocks: a sequence's partial tail and its fork. Appending to both in one batch needs one
    copy (the first sharer's), the second writes into the original: it fits, and nothing is left over."""
    pool = cls(2, spec=SPEC)
    mgr = SequenceManager(pool)
    x = mgr.create()
    x.append(3)
    y = x.fork()
    mgr.append_batch([x, y], [1, 1])
    assert pool.num_free_blocks == 0 and y.block_table == [0] and x.block_table == [1]
    mgr.check_invariants()


def test_free_releases_tail_first():
    pool, mgr = make()
    mgr.prefix_cache = None
    s = mgr.create()
    s.append(12)
    pool.mark_reusable(s.block_table)
    table = list(s.block_table)
    s.free()
    assert [b for b, _ in pool.policy.order()] == table[::-1]
    with pytest.raises(IllegalTransitionError, match="not live"):
        s.free()
    mgr.check_invariants()


def test_swap_round_trip_is_bitwise_and_uses_state_machine():
    pool, mgr = make(12)
    a, other = mgr.create(), mgr.create()
    kv = tokens_kv(10, 0)
    write(pool, a.append(10), kv)
    keep = a.fork()  # block 0..2 shared: they stay resident
    write(pool, a.append(3), tokens_kv(3, 10))  # a's tail is now private (copied on write)
    rec = EventRecorder(pool.events)
    private = [b for b in a.block_table if pool.fields.refcount[b] == 1]
    a.swap_out()
    assert a.swapped is not None and a.block_table.count(-1) == len(private)
    assert all(pool.fields.status[b] == BlockStatus.FREE for b in private)
    with pytest.raises(IllegalTransitionError, match="swapped out"):
        a.append(1)
    other.append(4 * pool.num_free_blocks)  # reuse (and overwrite) the swapped blocks
    write(pool, other.slots(), tokens_kv(other.num_tokens, 500))
    with pytest.raises(OutOfBlocksError):
        a.swap_in()
    assert a.swapped is not None
    other.free()
    a.swap_in()
    moves = [(e.old, e.new) for e in rec.of(StatusChanged)]
    assert moves[:2] == [("ALLOCATED", "EVICTING"), ("EVICTING", "FREE")]
    assert ("PENDING", "ALLOCATED") in moves
    assert [e.direction for e in rec.of(Swapped)] == ["out", "in"]
    assert torch.equal(read(pool, a), torch.cat((kv, tokens_kv(3, 10)), 2))
    assert torch.equal(read(pool, keep), kv)
    mgr.check_invariants()


def test_migrate_rewrites_every_table():
    pool, mgr = make(16)
    a = mgr.create()
    write(pool, a.append(9), tokens_kv(9, 0))
    b = a.fork()
    before = list(a.block_table)
    free = [x for x in range(16) if pool.fields.status[x] == BlockStatus.FREE][-3:]
    pool.migrate(before, free)
    assert a.block_table == free == b.block_table
    assert torch.equal(read(pool, a), tokens_kv(9, 0)) and torch.equal(read(pool, b), tokens_kv(9, 0))
    mgr.check_invariants()


def test_out_of_blocks_changes_nothing():
    pool, mgr = make(4)
    a, b = mgr.create(), mgr.create()
    a.append(6)
    snap = pool.snapshot()
    with pytest.raises(OutOfBlocksError):
        mgr.append_batch([a, b], [3, 6])  # needs 1 + 2 blocks, 2 are free
    assert a.num_tokens == 6 and b.num_tokens == 0 and b.block_table == []
    for k, v in pool.snapshot().items():
        assert (v == snap[k]).all(), k


def test_bad_appends_raise_typed_errors():
    pool, mgr = make()
    s = mgr.create([1, 2])
    with pytest.raises(KVDataError, match="tracks token ids"):
        s.append(3)
    with pytest.raises(ConfigError, match="cannot append"):
        mgr.create().append(-1)
    with pytest.raises(ConfigError, match="distinct"):
        mgr.append_batch([s, s], [[1], [2]])
    with pytest.raises(ConfigError, match="positions"):
        mgr.slot_mapping([s], [0], [5])
    s.append([1, 2, 3])
    assert s.token_ids == [1, 2, 3] and s.num_tokens == 3
    with pytest.raises(IllegalTransitionError, match="not swapped out"):
        s.swap_in()


class SequenceMachine(RuleBasedStateMachine):
    """Random appends, forks, frees, swaps and migrations; every token's K/V must survive bitwise."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.mgr = make(24)
        self.shadow: dict[int, torch.Tensor] = {}  # seq id -> [layers, 2, tokens, heads, dim]
        self.stamp = 0

    def live(self, resident=True):
        return [s for s in self.mgr.seqs.values() if not resident or s.swapped is None]

    @rule()
    def create(self):
        s = self.mgr.create()
        self.shadow[s.seq_id] = tokens_kv(0, 0)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), n=st.integers(0, 9))
    def append(self, data, n):
        s = data.draw(st.sampled_from(self.live()))
        try:
            slots = s.append(n)
        except OutOfBlocksError:
            return
        kv = tokens_kv(n, self.stamp)
        self.stamp += n
        write(self.pool, slots, kv)
        self.shadow[s.seq_id] = torch.cat((self.shadow[s.seq_id], kv), 2)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def fork(self, data):
        s = data.draw(st.sampled_from(self.live()))
        self.shadow[s.fork().seq_id] = self.shadow[s.seq_id].clone()

    @precondition(lambda self: self.live(False))
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.live(False)))
        s.free()
        del self.shadow[s.seq_id]

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def swap_out(self, data):
        data.draw(st.sampled_from(self.live())).swap_out()

    @precondition(lambda self: any(s.swapped for s in self.live(False)))
    @rule(data=st.data())
    def swap_in(self, data):
        s = data.draw(st.sampled_from([s for s in self.live(False) if s.swapped]))
        try:
            s.swap_in()
        except OutOfBlocksError:
            assert s.swapped is not None

    @rule(data=st.data())
    def migrate(self, data):
        used = [b for b in range(self.pool.num_blocks) if self.pool.fields.status[b] == BlockStatus.ALLOCATED]
        free = [b for b in range(self.pool.num_blocks) if self.pool.fields.status[b] == BlockStatus.FREE]
        k = data.draw(st.integers(0, min(len(used), len(free), 4)))
        src = data.draw(st.permutations(used))[:k]
        self.pool.migrate(src, data.draw(st.permutations(free))[:k])

    @invariant()
    def consistent(self):
        self.mgr.check_invariants()
        for s in self.live():
            assert torch.equal(read(self.pool, s), self.shadow[s.seq_id]), f"sequence {s.seq_id} lost K/V"


TestSequenceMachine = SequenceMachine.TestCase
TestSequenceMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])


def test_an_empty_prefix_cache_given_to_the_manager_is_used():
    from kvlab.core.prefix import PrefixCache
    pool = BlockPool(8, spec=SPEC)
    cache = PrefixCache(pool)
    assert len(cache) == 0
    assert SequenceManager(pool, prefix_cache=cache).prefix_cache is cache
    with pytest.raises(ConfigError, match="prefix_cache must be"):
        SequenceManager(pool, prefix_cache="yes")
