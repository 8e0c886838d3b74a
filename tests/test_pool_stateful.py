"""Random operation sequences on a pool, checked step by step against a plain reference model. (Threads
hammering one pool: tests/test_reliability.py.)

The model keeps its own clock (one tick per accepted public mutation), every block's stamps (created, last
access, hits), the free stack and the evictable set, so it predicts the exact ids of every allocation and the
victim of every eviction under LRU, FIFO, LFU, CLOCK (a textbook ring with a hand, kept alongside) and OPT (a
fixed periodic future, asked at the model's own clock), for the reference pool and the fast one."""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from _util import small_spec
from kvlab import (BlockPool, BlockStatus, DoubleFreeError, FastBlockPool, KVLabError, OutOfBlocksError,
                   RefcountUnderflowError, PyFastBlockPool)
from kvlab.core.eviction import OPTPolicy
from kvlab.textbook.pool import KVBlock
from test_eviction import TextbookClock

N = 12
STATUS = {int(s): s.name for s in BlockStatus}


def next_use(b: int, now: int) -> float:
    """OPT's future in this model: blocks 3, 7, 11 are never used again, block b at every t = 5b + 1 (mod 7), so
    answers pass as the clock moves and blocks b and b + 7 tie (the lower id goes first)."""
    return math.inf if b % 4 == 3 else float(now + (5 * b + 1 - now) % 7)


def multiplicity(ids: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for b in ids:
        out[b] = out.get(b, 0) + 1
    return out


class PoolMachine(RuleBasedStateMachine):
    """Reference model: ``status``/``refs``/``reusable`` dicts, stamps, the free stack (top last), the cached
    set, and the expected K/V of every block with data."""

    POLICY = "lru"
    POOL = BlockPool

    def __init__(self) -> None:
        super().__init__()
        policy = OPTPolicy(lambda b: next_use(b, self.pool.clock.now())) if self.POLICY == "opt" else self.POLICY
        self.pool = self.POOL(N, spec=small_spec(), eviction_policy=policy)
        self.status = {b: "FREE" for b in range(N)}
        self.refs = {b: 0 for b in range(N)}
        self.reusable = {b: False for b in range(N)}
        self.created = {b: 0 for b in range(N)}
        self.last = {b: 0 for b in range(N)}
        self.hits = {b: 0 for b in range(N)}
        self.free_stack = list(range(N - 1, -1, -1))  # a fresh pool hands out the lowest ids first
        self.cached: dict[int, int] = {}  # cached block -> when it (re)entered the policy, for LRU ties
        self.ring = TextbookClock()  # the cached blocks as CLOCK keeps them (its hand matters under CLOCK only)
        self.entered = 0
        self.clock = 0
        self.data: dict[int, torch.Tensor] = {}
        self.pattern = 0

    # ------------------------------------------------------------------ the model
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _blocks(self, status: str, referenced: bool | None = None) -> list[int]:
        return [b for b in range(N) if self.status[b] == status
                and (referenced is None or (self.refs[b] > 0) == referenced)]

    def _cache(self, b: int) -> None:
        """``b`` becomes evictable, or is re-ranked if it already is (LRU: newest; CLOCK: it keeps its place)."""
        if b not in self.cached:
            self.ring.insert(b)
        self.entered += 1
        self.cached[b] = self.entered

    def _leave(self, b: int) -> None:
        """``b`` stops being evictable (if it was)."""
        if self.cached.pop(b, None) is not None and b in self.ring.bit:
            self.ring.remove(b)

    def _victim(self, now: int) -> int | None:
        """The block the policy must evict next at step ``now``, from the model's own stamps."""
        if not self.cached:
            return None
        if self.POLICY == "clock":
            return self.ring.sweep()[0]
        key = {"lru": lambda b: (self.last[b], self.cached[b]),  # least recent; same step: first released
               "fifo": lambda b: (self.created[b], b),
               "lfu": lambda b: (self.hits[b], self.last[b], b),
               "opt": lambda b: (-next_use(b, now), b)}[self.POLICY]
        return min(self.cached, key=key)

    def _evict(self, now: int) -> int | None:
        """Evict the policy's victim at step ``now`` (under CLOCK the hand moves on); returns it."""
        victim = self._victim(now)
        if victim is not None:
            if self.POLICY == "clock":
                assert self.ring.evict() == victim
            self._to_free(victim)
        return victim

    def _write(self, b: int) -> None:
        self.pattern += 1
        pattern = torch.full_like(KVBlock(self.pool, b).kv_data, float(self.pattern))
        KVBlock(self.pool, b).kv_data.copy_(pattern)
        self.data[b] = pattern

    def _to_free(self, b: int) -> None:
        """``b`` goes FREE and onto the top of the free stack; its stamps stay."""
        self.status[b], self.refs[b], self.reusable[b] = "FREE", 0, False
        self._leave(b)
        self.data.pop(b, None)
        self.free_stack.append(b)

    def _take(self, n: int, t: int, status: str) -> list[int]:
        """What ``allocate(n)`` hands out at step ``t``: the free stack's top, else the policy's victim."""
        out = []
        for _ in range(n):
            if not self.free_stack:
                self._evict(t)
            b = self.free_stack.pop()
            self.status[b], self.refs[b], self.reusable[b] = status, 1, False
            self.created[b] = self.last[b] = t
            self.hits[b] = 1
            out.append(b)
        return out

    # ------------------------------------------------------------------ rules
    @rule(n=st.integers(1, 5), pending=st.booleans())
    def allocate(self, n: int, pending: bool) -> None:
        avail = len(self.free_stack) + len(self.cached)
        if n > avail:
            try:
                self.pool.reserve(n) if pending else self.pool.allocate(n)
            except OutOfBlocksError:
                return
            raise AssertionError(f"allocate({n}) with {avail} available was accepted")
        ids = self.pool.reserve(n) if pending else self.pool.allocate(n)
        assert ids == self._take(n, self._tick(), "PENDING" if pending else "ALLOCATED")
        for b in ids:
            self._write(b)

    @rule(data=st.data())
    def commit(self, data) -> None:
        pending = self._blocks("PENDING")
        if pending:
            ids = data.draw(st.lists(st.sampled_from(pending), min_size=1, max_size=3, unique=True))
            self.pool.commit(ids)
            t = self._tick()
            for b in ids:
                self.status[b], self.last[b] = "ALLOCATED", t

    @rule(data=st.data())
    def free(self, data) -> None:
        held = self._blocks("ALLOCATED", referenced=True) + self._blocks("PENDING")
        if not held:
            try:
                self.pool.free([0])
            except KVLabError:
                return
            raise AssertionError("free of an unheld block was accepted")
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=5))  # repeats drop one each
        want = multiplicity(ids)
        ok = all(self.refs[b] >= c if self.status[b] == "ALLOCATED" else c == 1 for b, c in want.items())
        if not ok:
            try:
                self.pool.free(ids)
            except DoubleFreeError:
                return
            raise AssertionError(f"free({ids}) past the references was accepted")
        self.pool.free(ids)
        t = self._tick()
        gone = []
        for b, c in want.items():
            self.refs[b] -= c
            if self.refs[b]:
                self.last[b] = t
            elif self.status[b] == "ALLOCATED" and self.reusable[b]:
                self.last[b] = t
                self._cache(b)
            else:
                gone.append(b)
        for b in reversed(gone):  # the first id freed comes out first
            self._to_free(b)

    @rule(data=st.data())
    def incref(self, data) -> None:
        live = self._blocks("ALLOCATED")
        if live:
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4))
            self.pool.incref(ids)
            t = self._tick()
            for b, c in multiplicity(ids).items():
                self._leave(b)
                self.refs[b] += c
                self.hits[b] += c
                self.last[b] = t

    @rule(data=st.data())
    def decref(self, data) -> None:
        live = self._blocks("ALLOCATED")
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4))
        want = multiplicity(ids)
        if any(self.refs[b] < c for b, c in want.items()):
            try:
                self.pool.decref(ids)
            except RefcountUnderflowError:
                return
            raise AssertionError("underflow accepted")
        self.pool.decref(ids)
        t = self._tick()
        for b, c in want.items():
            self.refs[b] -= c
            self.last[b] = t
            if not self.refs[b]:
                self._cache(b)

    @rule(data=st.data())
    def touch(self, data) -> None:
        live = self._blocks("ALLOCATED")
        if live:
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4))
            self.pool.touch(ids)
            t = self._tick()
            for b, c in multiplicity(ids).items():
                self.last[b] = t
                self.hits[b] += c
                if b in self.cached:  # LRU moves it last, LFU counts the reads, FIFO and OPT ignore them
                    self.ring.bit[b] = True  # CLOCK sets its reference bit
                    self._cache(b)

    @rule(data=st.data(), reusable=st.booleans())
    def mark_reusable(self, data, reusable: bool) -> None:
        live = self._blocks("ALLOCATED") + self._blocks("PENDING")
        if live:
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3))
            self.pool.mark_reusable(ids, reusable)
            self._tick()
            gone = [b for b in dict.fromkeys(ids) if not reusable and b in self.cached]
            for b in ids:
                self.reusable[b] = reusable
            for b in reversed(gone):
                self._to_free(b)

    @rule()
    def evict(self) -> None:
        victim = self._evict(self.clock + 1)  # the pool's clock ticks before it evicts
        got = self.pool.evict()
        assert got == victim, f"{self.POLICY} evicted {got}, the model's stamps say {victim}"
        if victim is not None:
            self._tick()

    @rule(data=st.data())
    def release_cached(self, data) -> None:
        if self.cached:
            b = data.draw(st.sampled_from(sorted(self.cached)))
            self.pool.release_cached(b)
            self._tick()
            self._to_free(b)

    @rule(data=st.data())
    def begin_eviction(self, data) -> None:
        live = self._blocks("ALLOCATED")
        if live:
            b = data.draw(st.sampled_from(live))
            self.pool.begin_eviction([b])
            self.last[b] = self._tick()
            self.status[b] = "EVICTING"
            self._leave(b)
            assert torch.equal(KVBlock(self.pool, b).kv_data, self.data[b])

    @rule(data=st.data())
    def finish_eviction(self, data) -> None:
        leaving = self._blocks("EVICTING")
        if leaving:
            ids = data.draw(st.lists(st.sampled_from(leaving), min_size=1, max_size=3, unique=True))
            self.pool.finish_eviction(ids)
            self._tick()
            for b in ids:  # pushed in order: the last on top
                self._to_free(b)

    @rule(data=st.data())
    def illegal(self, data) -> None:
        """Any illegal call raises a typed error and changes nothing the model can see (not even the clock)."""
        b = data.draw(st.integers(-2, N + 2))
        op = data.draw(st.sampled_from(["free", "decref", "incref", "commit", "finish_eviction", "release_cached",
                                        "begin_eviction", "touch"]))
        legal = 0 <= b < N and {
            "free": self.status.get(b) in ("ALLOCATED", "PENDING") and self.refs.get(b, 0) > 0,
            "decref": self.status.get(b) == "ALLOCATED" and self.refs.get(b, 0) > 0,
            "incref": self.status.get(b) == "ALLOCATED",
            "touch": self.status.get(b) == "ALLOCATED",
            "begin_eviction": self.status.get(b) == "ALLOCATED",
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
        assert p.clock.now() == self.clock
        assert sum(p.status_counts().values()) == N
        for b in range(N):
            assert STATUS[p.fields.status[b]] == self.status[b], b
            assert p.fields.refcount[b] == self.refs[b] >= 0, b
            assert bool(p.fields.reusable[b]) == self.reusable[b], b
            assert (p.fields.created[b], p.fields.last_access[b], p.fields.hits[b]) == \
                (self.created[b], self.last[b], self.hits[b]), b
        assert p.free_ids() == self.free_stack[::-1]
        assert {b for b, _ in p.policy.order()} == set(self.cached)
        assert (p.policy.rank(1) or [(None, 0)])[0][0] == self._victim(self.clock)
        for b, expect in self.data.items():  # K/V written through kv_data reads back bitwise until freed
            assert torch.equal(KVBlock(p, b).kv_data, expect), b


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def machine(policy: str, pool_cls: type) -> type:
    cls = type(f"PoolMachine_{policy}_{pool_cls.__name__}", (PoolMachine,), {"POLICY": policy, "POOL": pool_cls})
    case = cls.TestCase
    case.settings = SETTINGS
    return case


TestPoolMachineLRU = machine("lru", BlockPool)
TestPoolMachineFIFO = machine("fifo", BlockPool)
TestPoolMachineLFU = machine("lfu", BlockPool)
TestPoolMachineCLOCK = machine("clock", BlockPool)
TestPoolMachineOPT = machine("opt", BlockPool)
TestFastPoolMachineLRU = machine("lru", FastBlockPool)
TestFastPoolMachineFIFO = machine("fifo", FastBlockPool)
TestFastPoolMachineLFU = machine("lfu", FastBlockPool)
TestFastPoolMachineCLOCK = machine("clock", FastBlockPool)
TestFastPoolMachineOPT = machine("opt", FastBlockPool)
if PyFastBlockPool is not FastBlockPool:  # compiled: its Python paths too
    TestPyFastPoolMachineLRU = machine("lru", PyFastBlockPool)
    TestPyFastPoolMachineFIFO = machine("fifo", PyFastBlockPool)
    TestPyFastPoolMachineLFU = machine("lfu", PyFastBlockPool)
    TestPyFastPoolMachineCLOCK = machine("clock", PyFastBlockPool)
    TestPyFastPoolMachineOPT = machine("opt", PyFastBlockPool)
