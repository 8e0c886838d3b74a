"""Random operation sequences on a pool, checked step by step against a plain reference model. (Threads
hammering one pool: tests/test_reliability.py.)"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from _util import small_spec
from kvlab import BlockPool, BlockStatus, KVLabError, OutOfBlocksError

N = 12
STATUS = {int(s): s.name for s in BlockStatus}


class PoolMachine(RuleBasedStateMachine):
    """Reference model: ``status``/``refs``/``reusable`` dicts and the expected K/V of every block with data."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N, spec=small_spec())
        self.status = {b: "FREE" for b in range(N)}
        self.refs = {b: 0 for b in range(N)}
        self.reusable = {b: False for b in range(N)}
        self.data: dict[int, torch.Tensor] = {}
        self.stamp = 0

    def _blocks(self, status: str, referenced: bool | None = None) -> list[int]:
        return [b for b in range(N) if self.status[b] == status
                and (referenced is None or (self.refs[b] > 0) == referenced)]

    def _write(self, b: int) -> None:
        self.stamp += 1
        pattern = torch.full_like(self.pool.block(b).kv_data, float(self.stamp))
        self.pool.block(b).kv_data.copy_(pattern)
        self.data[b] = pattern

    def _to_free(self, b: int) -> None:
        self.status[b], self.refs[b], self.reusable[b] = "FREE", 0, False
        self.data.pop(b, None)

    @rule(n=st.integers(1, 5))
    def allocate(self, n: int) -> None:
        avail = len(self._blocks("FREE")) + len(self._blocks("ALLOCATED", referenced=False))
        try:
            ids = self.pool.allocate(n)
        except OutOfBlocksError:
            assert n > avail
            return
        assert n <= avail and len(set(ids)) == n
        for b in ids:
            assert self.status[b] in ("FREE", "ALLOCATED") and self.refs[b] == 0
            self._to_free(b)
            self.status[b], self.refs[b] = "ALLOCATED", 1
            self._write(b)

    @rule(data=st.data())
    def free(self, data) -> None:
        held = self._blocks("ALLOCATED", referenced=True) + self._blocks("PENDING")
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True) if held else st.just([0]))
        if not held:
            try:
                self.pool.free(ids)
            except KVLabError:
                return
            raise AssertionError("free of an unheld block was accepted")
        self.pool.free(ids)
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0 and not (self.status[b] == "ALLOCATED" and self.reusable[b]):
                self._to_free(b)

    @rule(data=st.data())
    def incref(self, data) -> None:
        live = self._blocks("ALLOCATED")
        if live:
            b = data.draw(st.sampled_from(live))
            self.pool.incref([b])
            self.refs[b] += 1

    @rule(data=st.data())
    def decref(self, data) -> None:
        live = self._blocks("ALLOCATED")
        if not live:
            return
        b = data.draw(st.sampled_from(live))
        if self.refs[b] == 0:
            try:
                self.pool.decref([b])
            except KVLabError:
                return
            raise AssertionError("underflow accepted")
        self.pool.decref([b])
        self.refs[b] -= 1

    @rule(data=st.data())
    def mark_reusable(self, data) -> None:
        live = self._blocks("ALLOCATED", referenced=True)
        if live:
            b = data.draw(st.sampled_from(live))
            self.pool.mark_reusable([b])
            self.reusable[b] = True

    @rule()
    def evict(self) -> None:
        cached = self._blocks("ALLOCATED", referenced=False)
        blk = self.pool.evict_block()
        if blk is None:
            assert not cached
        else:
            assert blk.block_id in cached
            self._to_free(blk.block_id)

    @rule()
    def reserve_commit(self) -> None:
        if self._blocks("FREE"):
            (b,) = self.pool.reserve(1)
            assert self.status[b] == "FREE"
            self.status[b], self.refs[b] = "PENDING", 1
            self._write(b)
            self.pool.commit([b])
            self.status[b] = "ALLOCATED"

    @rule(data=st.data())
    def swap_like_eviction(self, data) -> None:
        live = self._blocks("ALLOCATED", referenced=True)
        if live:
            b = data.draw(st.sampled_from(live))
            self.pool.begin_eviction([b])
            self.status[b] = "EVICTING"
            assert torch.equal(self.pool.block(b).kv_data, self.data[b])
            self.pool.finish_eviction([b])
            self._to_free(b)

    @rule(data=st.data())
    def illegal(self, data) -> None:
        """Any illegal call raises a typed error and changes nothing the model can see."""
        b = data.draw(st.integers(-2, N + 2))
        op = data.draw(st.sampled_from(["free", "decref", "incref", "commit", "finish_eviction", "release_cached"]))
        legal = 0 <= b < N and {
            "free": self.status.get(b) in ("ALLOCATED", "PENDING") and self.refs.get(b, 0) > 0,
            "decref": self.status.get(b) == "ALLOCATED" and self.refs.get(b, 0) > 0,
            "incref": self.status.get(b) == "ALLOCATED",
            "commit": self.status.get(b) == "PENDING",
            "finish_eviction": self.status.get(b) == "EVICTING",
            "release_cached": self.status.get(b) == "ALLOCATED" and self.refs.get(b, 0) == 0,
        }[op]
        if legal:
            return
        arg = b if op == "release_cached" else [b]
        try:
            getattr(self.pool, op)(arg)
        except KVLabError:
            return
        raise AssertionError(f"illegal {op}({b}) was accepted")

    @invariant()
    def matches_model(self) -> None:
        p = self.pool
        p.check_invariants()
        counts = p.status_counts()
        assert sum(counts.values()) == N
        for b in range(N):
            assert STATUS[p.fields.status[b]] == self.status[b], b
            assert p.fields.refcount[b] == self.refs[b] >= 0, b
            if self.status[b] == "FREE":
                assert p.fields.refcount[b] == 0
        assert p.num_cached_blocks == len(self._blocks("ALLOCATED", referenced=False))
        for b, expect in self.data.items():  # K/V written through kv_data reads back bitwise until freed
            assert torch.equal(p.block(b).kv_data, expect), b


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])

