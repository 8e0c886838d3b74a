"""Random mixes of allocator requests (split, merge, evict, wait, timeout, cancel), frees, cache hits, reserves,
evictions in flight and defragmentation on a four-class buddy pool. After every step: the pool's invariants hold,
every block holding data still holds exactly the pattern written into it (followed through every move), and
PENDING/EVICTING blocks never moved."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from _util import small_spec
from kvlab import BlockPool, BlockStatus, DefragmentationStrategy, DynamicAllocator, TicketState
from kvlab.textbook.pool import KVBlock

N, SIZES = 16, [4, 8, 16, 32]
ALLOCATED, FREE = int(BlockStatus.ALLOCATED), int(BlockStatus.FREE)


class AllocMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N, spec=small_spec(), block_sizes=SIZES)
        self.alloc = DynamicAllocator(self.pool)
        self.data: dict[int, torch.Tensor] = {}  # block id -> pattern, for ALLOCATED and EVICTING blocks
        self.pending: set[int] = set()
        self.evicting: set[int] = set()
        self.tickets = []
        self.stamp = 0
        self.pool.relocation_hooks.append(self._moved)
        self.pool.evict_hooks.append(self._evicted)

    def _moved(self, src, dst) -> None:
        moved = {s: self.data.pop(s) for s in src.tolist()}
        assert not moved.keys() & (self.pending | self.evicting)
        self.data.update({d: moved[s] for s, d in zip(src.tolist(), dst.tolist())})

    def _evicted(self, b: int) -> None:
        assert KVBlock(self.pool, b).status is BlockStatus.FREE
        del self.data[b]

    def _write(self, b: int) -> None:
        self.stamp += 1
        view = KVBlock(self.pool, b).kv_data
        pattern = (self.stamp * 2048 + torch.arange(view.numel(), dtype=view.dtype, device=view.device)).view_as(view)
        view.copy_(pattern)
        self.data[b] = pattern

    def _record(self, served) -> None:
        for t in served:
            assert t.state is TicketState.SERVED and t.block.reference_count == 1
            self._write(t.block.block_id)

    def _held(self, referenced: bool) -> list[int]:
        pool = self.pool
        return sorted(b for b in self.data if b not in self.evicting and (pool.fields.refcount[b] > 0) == referenced)

    @rule(ks=st.lists(st.sampled_from([0, 0, 0, 1, 1, 2, 3]), min_size=1, max_size=4),
          timeout=st.none() | st.integers(0, 4))
    def request(self, ks: list[int], timeout) -> None:
        for k in ks:
            waiting = list(self.alloc.waiters)
            t = self.alloc.allocate_optimal_block(size_class=k, timeout=timeout)
            self.tickets.append(t)
            self._record([w for w in waiting if w.served])  # older waiters are served first
            if t.served:
                assert not self.alloc.waiters  # no overtaking: served only behind an emptied queue
                assert t.block.size_class == k and t.strategy in ("exact", "split", "merge", "evict")
                self._write(t.block.block_id)
            else:
                assert self.alloc.waiters[-1] is t

    @rule(data=st.data(), keep=st.booleans(), n=st.integers(1, 3))
    def free(self, data, keep: bool, n: int) -> None:
        for _ in range(n):
            held = self._held(referenced=True)
            if held:
                self._free_one(data.draw(st.sampled_from(held)), keep)

    def _free_one(self, b: int, keep: bool) -> None:
        if keep:
            self.pool.mark_reusable([b])
        gone = self.pool.fields.refcount[b] == 1 and not self.pool.fields.reusable[b]
        served = self.alloc.deallocate_block(b)
        if gone:
            del self.data[b]
        self._record(served)

    @rule(data=st.data())
    def cache_hit(self, data) -> None:
        cached = self._held(referenced=False)
        if cached:
            self.pool.incref([data.draw(st.sampled_from(cached))])

    @rule()
    def evict(self) -> None:
        self.pool.evict()
        self._record(self.alloc.handle_wait_queue())

    @rule(data=st.data())
    def split(self, data) -> None:
        big = [b for o in range(1, 4) for b in self.pool.free_ids(o)]
        if big:
            b = data.draw(st.sampled_from(sorted(big)))
            k = data.draw(st.integers(0, self.pool.fields.size_class[b] - 1))
            assert self.alloc.split_block(b, k)[0] == b and self.pool.fields.size_class[b] == k

    @rule()
    def merge(self) -> None:
        self.pool.merge_free_buddies()
        self._record(self.alloc.handle_wait_queue())

    @rule(data=st.data())
    def cancel(self, data) -> None:
        if self.alloc.waiters:
            t = data.draw(st.sampled_from(list(self.alloc.waiters)))
            self._record(self.alloc.cancel(t))
            assert t.state is TicketState.CANCELLED

    @rule(steps=st.integers(1, 4))
    def tick(self, steps: int) -> None:
        for _ in range(steps):
            self.pool.clock.tick()
        now = self.pool.clock.now()
        self._record(self.alloc.handle_wait_queue())
        assert all(t.deadline is None or t.deadline >= now for t in self.alloc.waiters)

    @precondition(lambda self: not self.alloc.waiters)
    @rule(k=st.integers(0, 2))
    def reserve(self, k: int) -> None:
        if self.alloc.make_room(k) is not None:
            self.pending.update(self.pool.reserve(1, size_class=k))

    @rule(data=st.data())
    def commit(self, data) -> None:
        if self.pending:
            b = data.draw(st.sampled_from(sorted(self.pending)))
            self.pool.commit([b])
            self.pending.discard(b)
            self._write(b)

    @rule(data=st.data())
    def begin_eviction(self, data) -> None:
        held = self._held(referenced=True)
        if held:
            b = data.draw(st.sampled_from(held))
            self.pool.begin_eviction([b])
            self.evicting.add(b)

    @rule(data=st.data())
    def finish_eviction(self, data) -> None:
        if self.evicting:
            b = data.draw(st.sampled_from(sorted(self.evicting)))
            self.pool.finish_eviction([b])
            self.evicting.discard(b)
            del self.data[b]
            self._record(self.alloc.handle_wait_queue())

    @rule(cap=st.none() | st.integers(1, 3))
    def defragment(self, cap) -> None:
        frozen = {b: int(self.pool.fields.status[b]) for b in self.pending | self.evicting}
        report = DefragmentationStrategy(self.pool, max_moves=cap).defragment(force=True)
        assert cap is None or len(report.moves) <= cap
        assert all(s > d for s, d in report.moves)
        assert {b: int(self.pool.fields.status[b]) for b in frozen} == frozen

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        pool.check_invariants()
        for b, pattern in self.data.items():
            assert pool.fields.status[b] in (ALLOCATED, int(BlockStatus.EVICTING)), b
            assert torch.equal(KVBlock(pool, b).kv_data, pattern), f"block {b} lost its data"
        live = {b for b in range(N)
                if pool.fields.status[b] == ALLOCATED and b % (1 << pool.fields.size_class[b]) == 0} - self.pending
        assert live == self.data.keys() - self.evicting
        assert all(pool.fields.status[b] == int(BlockStatus.PENDING) for b in self.pending)
        assert all(t.state is TicketState.WAITING for t in self.alloc.waiters)
        assert sum(t.served for t in self.tickets) == sum(self.alloc.stats[s] for s in
                                                          ("exact", "split", "merge", "evict"))


AllocMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestAllocMachine = AllocMachine.TestCase
