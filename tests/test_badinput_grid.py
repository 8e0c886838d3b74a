"""The bad-input grid: every public method of the pool-side classes, crossed with generated bad values.

Each method is described once (:data:`SPECS`): its argument slots, a good value for each, and the values to
try in each slot. A case replaces one slot (or a few, for the extras) and makes one call on a small world
(:class:`World`: a pool with storage and sequences, a forked sequence sharing a partly filled block, a prefix
cache with stored chains, a pool with size classes, allocators with waiting, served, cancelled and timed-out
tickets, a pre-allocator with a reserve). Then either

* the call raised a :class:`kvlab.KVLabError` subclass whose message names the value at fault, and the world is
  exactly as it was: metadata, free stacks, evictable set, counters, lock acquisitions, clock, events, the KV
  tensors (bitwise), sequences, the prefix cache, allocator queues and tickets, reserves; or
* the value is legitimate (a numpy integer id, an empty list, ...) and the call succeeded with every invariant
  holding; a reader (``check_id``, ``peek``, ...) must then have changed nothing either.

Anything else fails: an untyped error, a bad value accepted, a message that does not locate the fault.
The whole grid runs for the reference :class:`BlockPool`. Its twins, :class:`FastBlockPool` and, where that is
the compiled pool, :class:`PyFastBlockPool`, run a reduced grid (:func:`twin_values`): every method's good call
and hand-written cases, and in each slot the first value of each category (:func:`kind`: None, True, False, a
float, a wrong type, a negative or too large int, a block in each state, a short or a batch-sized list, ...), the
same cases every time; the equivalence property tests (tests/test_perf.py, tests/test_pool_stateful.py) hold
them equal to the reference beyond that. Every object of the world is built on the pool class under test. A
rejected call leaves the world unchanged (that is what the case proves), so the next case reuses it; a world is
rebuilt only after a call that changed it.

``python tests/test_badinput_grid.py`` runs the grid outside pytest and prints the counts (docs/reliability.md);
with ``KVLAB_LONG=1`` (either way) the twins run the full grid too.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from _util import assert_same_state, pool_state, small_spec
from kvlab import (BlockPool, BlockStatus, DefragmentationStrategy, DynamicAllocator, EventRecorder, FastBlockPool,
                   FragmentationDetector, KVBlock, KVLabError, Preallocator, PrefixCache, ReferenceManager, Sequence,
                   SequenceManager, Ticket, TicketState)
from kvlab.fast.pool import BATCH_MIN, PyFastBlockPool
from kvlab.textbook.pool import TextbookPool

SPEC = small_spec(device="cpu")  # 2 layers, 2 KV heads, head_dim 4, 4 tokens per block
NAN, INF, BIG = float("nan"), float("inf"), 2**63
# FastBlockPool is the compiled pool where kvlab/fast/_fastpath.c was built, else PyFastBlockPool itself
POOL_CLASSES = (BlockPool, FastBlockPool) + ((PyFastBlockPool,) if PyFastBlockPool is not FastBlockPool else ())


# ---------------------------------------------------------------------------------------------------- the world
class World:
    """Everything a case may touch, built the same way for every case on pool class ``cls``.

    ``P`` (uniform, 32 blocks of 4 tokens): manager ``M`` with prefix cache ``C``; ``A`` tracks 10 token ids
    (two full blocks registered in ``C``, a tail of 2 tokens) and ``F`` is its fork, sharing all three blocks;
    ``N`` counts 5 tokens; ``S`` is swapped out; ``X`` was freed; ``O`` lives in a second manager ``M2``;
    a freed prompt's chain is cached at refcount 0; ten raw blocks ``R`` (refcount 1), one with refcount 3, a
    PENDING, an EVICTING and an EVICTING block with refcount 0; a pre-allocator ``pre`` holding 2 PENDING blocks
    for owner 7. ``Q`` (16 base blocks, sizes 4/8/16/32): allocator ``D`` with waiter ``T`` (class 3, which
    cannot be served while blocks 4 and 8 are held) and served, cancelled and timed-out tickets; ``D2`` has no
    waiter (its class-2 requests are served by evicting cached block 2); ``D3`` has its own waiter ``T3``.
    """

    def __init__(self, cls: type[BlockPool]) -> None:
        g = torch.Generator().manual_seed(0)
        P = self.P = cls(32, spec=SPEC)
        P.storage.kv.copy_(torch.randn(P.storage.kv.shape, generator=g))  # bitwise checks see real data
        self.rec_p = EventRecorder(P.events)  # so every event is built, and a rejected call's event is seen
        M = self.M = SequenceManager(P, prefix_cache=True)
        self.C = M.prefix_cache
        A = self.A = M.create(list(range(10)))
        A.append(list(range(10)))
        M.cache_full_blocks(A)
        self.F = A.fork()
        self.N = M.create()
        self.N.append(5)
        Z = M.create(list(range(100, 108)))
        Z.append(list(range(100, 108)))
        M.cache_full_blocks(Z)
        z = Z.block_table[-1]  # the chain's tail: releasing it orphans nothing
        Z.free()
        self.R = P.allocate(10, owner=5)
        r3 = P.allocate(1, owner=5)[0]
        P.incref([r3, r3])
        pd = P.reserve(1, owner=6)[0]
        ev = P.allocate(1)[0]
        P.begin_eviction([ev])
        ev0 = P.allocate(1)[0]
        P.mark_reusable([ev0])
        P.free([ev0])
        P.begin_eviction([ev0])  # EVICTING with refcount 0
        self.pre = Preallocator(P)
        self.pre.observe(7, 0, 2)
        self.pre.replenish()
        self.M2 = SequenceManager(P)
        self.O = self.M2.create()  # seq_id 0, like A: only identity tells them apart
        self.O.append(3)
        self.S = M.create()
        self.S.append(3)
        self.S.swap_out()
        X = self.X = M.create()
        X.append(2)
        f = X.block_table[0]
        X.free()
        self.refs = ReferenceManager(P)
        self.det_p, self.strat_p = FragmentationDetector(P), DefragmentationStrategy(P)

        Q = self.Q = cls(16, spec=SPEC, block_sizes=[4, 8, 16, 32])
        Q.storage.kv.copy_(torch.randn(Q.storage.kv.shape, generator=g))
        self.rec_q = EventRecorder(Q.events)
        D, D2, D3 = self.D, self.D2, self.D3 = DynamicAllocator(Q), DynamicAllocator(Q), DynamicAllocator(Q)
        self.Cq = PrefixCache(Q)
        b0, b1 = Q.allocate(1)[0], Q.allocate(1)[0]
        c1 = Q.allocate(1, size_class=1)[0]
        self.Ts = D.allocate_optimal_block(size_class=2, owner=1)
        Q.allocate(1, owner=2)
        self.T2 = D2.allocate_optimal_block(size_class=2, owner=3)
        Q.free([b0, b1])
        Q.mark_reusable([c1])
        Q.free([c1])
        self.Tc = D.allocate_optimal_block(size_class=3)
        self.Tt = D.allocate_optimal_block(size_class=3, timeout=0)
        Q.touch([8])  # one step later: Tt is past its deadline
        D.handle_wait_queue()
        self.T = D.allocate_optimal_block(size_class=3, owner=4)
        D.cancel(self.Tc)
        self.T3 = D3.allocate_optimal_block(size_class=3)
        self.det_q, self.strat_q = FragmentationDetector(Q), DefragmentationStrategy(Q)

        self.ids = {"FREE": f, "PENDING": pd, "EVICTING": ev, "EVICTING rc0": ev0, "cached": z, "held": self.R[0],
                    "held x3": r3, "shared tail": A.block_table[-1],
                    "Q FREE c0": 0, "Q cached c1": 2, "Q held c2": 4, "Q inner": 5, "Q held c0": 8, "Q FREE c1": 10}
        self.seqs = (A, self.F, self.N, self.S, X, self.O)
        self.tickets = (self.T, self.Ts, self.Tc, self.Tt, self.T2, self.T3)
        self.check()
        assert (self.Ts.block.block_id, self.T2.block.block_id) == (4, 12) and list(D.waiters) == [self.T]
        assert self.Tc.state is TicketState.CANCELLED and self.Tt.state is TicketState.TIMED_OUT
        assert P.fields.status[f] == 0 and P.is_cached(z) and Q.is_cached(2) and self.F.block_table == A.block_table
        assert sorted(Q.free_ids(0)) == [0, 1, 9] and Q.free_ids(1) == [10] and not Q.free_ids(2)

    def check(self) -> None:
        """Every invariant of every part (raw blocks are held outside the tables, hence exclusive=False)."""
        self.P.check_invariants()
        self.Q.check_invariants()
        self.M.check_invariants(exclusive=False)
        self.M2.check_invariants(exclusive=False)


def _seq_state(s: Sequence) -> tuple:
    sw = s.swapped
    return (s.seq_id, tuple(s.block_table), s.num_tokens, None if s.token_ids is None else tuple(s.token_ids),
            s.alive, s.tenant, s.num_cached_tokens, s.cached_blocks, s.prefix_hash, s.cacheable,
            None if sw is None else (tuple(sw.positions), tuple(sw.tokens),
                                     None if sw.data is None else sw.data.numpy().tobytes()))


def _cache_state(c: PrefixCache) -> tuple:
    return (c.entries(), c.get_stats())


def _alloc_state(d: DynamicAllocator) -> tuple:
    return (tuple(map(id, d.waiters)), dict(d.stats), d._next_ticket, tuple(d.allocation_history),
            d.allocation_history.maxlen)


def _ticket_state(t: Ticket) -> tuple:
    return (t.state, None if t.block is None else t.block.block_id, t.strategy, t.served_at, t.deadline,
            t.kv_data is None)


def observe(w: World) -> tuple:
    """Everything observable, copied (not deep-copied: each part as plain values)."""
    pools = (pool_state(w.P), pool_state(w.Q))
    rest = (len(w.rec_p), len(w.rec_q),
            [(len(p.relocation_hooks), len(p.evict_hooks), id(p.evict_guard), len(p.events.subscribers))
             for p in (w.P, w.Q)],
            [(m._next_id, tuple(m.seqs)) for m in (w.M, w.M2)], [_seq_state(s) for s in w.seqs],
            _cache_state(w.C), _cache_state(w.Cq), [_alloc_state(d) for d in (w.D, w.D2, w.D3)],
            [_ticket_state(t) for t in w.tickets],
            ({k: tuple(v) for k, v in w.pre.reserves.items()}, {k: tuple(v) for k, v in w.pre.demand.items()},
             dict(w.pre.stats)))
    return pools, rest


def assert_unchanged(before: tuple, after: tuple) -> None:
    for b, a in zip(before[0], after[0]):
        assert_same_state(b, a)
    for i, (b, a) in enumerate(zip(before[1], after[1])):
        assert b == a, f"part {i} of the world changed: {b!r} -> {a!r}"


# ---------------------------------------------------------------------------------------------------- values
class W:
    """A value read off the world at call time (ids, sequences and tickets belong to one build)."""

    def __init__(self, f: Callable[[World], Any]) -> None:
        self.f = f


def resolve(v: Any, w: World) -> Any:
    return v.f(w) if isinstance(v, W) else v


VALUE = object()  # "the message names the value itself"


@dataclass(frozen=True)
class V:
    """One value for one slot: ``ok`` values must be accepted, the others refused with a message that names
    ``at`` (default: the value itself; for a list, the bad element) or contains one of ``needle``."""
    label: str
    value: Any
    ok: bool = False
    at: Any = VALUE
    needle: tuple[str, ...] = ()


def bad(label: str, value: Any, at: Any = VALUE, *needle: str) -> V:
    return V(label, value, False, at, needle)


def ok(label: str, value: Any) -> V:
    return V(label, value, True)


def wid(state: str) -> W:
    return W(lambda w: w.ids[state])


def without(vals: list[V], *labels: str) -> list[V]:
    return [v for v in vals if v.label not in labels]


NOT_INT = [bad("None", None), bad("True", True), bad("False", False), bad("1.0", 1.0), bad("nan", NAN),
           bad("inf", INF), bad("np.bool_", np.bool_(True)), bad("np.float64", np.float64(1.0)), bad("str", "1"),
           bad("list", [1]), bad("bytes", b"1")]
TOKEN_JUNK = [("None", None), ("True", True), ("False", False), ("1.0", 1.0), ("1.5", 1.5), ("nan", NAN),
              ("inf", INF), ("-1", -1), ("2**63", BIG), ("np.float64", np.float64(1.0)), ("np.bool_", np.bool_(True)),
              ("str", "x"), ("nested", [1]), ("bytes", b"x")]
OWNER = NOT_INT + [bad("-2", -2), bad("2**31", 2**31), bad("2**63", BIG), ok("np.int32", np.int32(3)), ok("-1", -1),
                   ok("int32 max", 2**31 - 1)]
REASON = [bad("None", None), bad("int", 1), bad("bytes", b"x"), bad("True", True), bad("list", ["r"]),
          bad("nan", NAN), ok("str", "x"), ok("np.str_", np.str_("y")), ok("empty", "")]
FLAG = [bad("None", None), bad("1", 1), bad("0", 0), bad("1.0", 1.0), bad("str", "yes"), bad("empty str", ""),
        bad("np.float64", np.float64(1.0)), bad("list", [True]), bad("np.int64", np.int64(1)),
        ok("True", True), ok("False", False), ok("np.bool_", np.bool_(True))]
TENANT = [bad("int", 1), bad("bytes", b"t"), bad("True", True), bad("list", ["t"]), bad("nan", NAN),
          bad("np.int64", np.int64(1)), bad("tuple", ("t",)), ok("str", "t"), ok("np.str_", np.str_("t")),
          ok("None", None), ok("empty", "")]
NUMBER = [bad("None", None), bad("str", "20"), bad("nan", NAN), bad("True", True), bad("False", False),
          bad("-1", -1), bad("list", [20]), bad("np.bool_", np.bool_(True)),
          ok("0", 0), ok("100", 100), ok("np.float64", np.float64(10.0)), ok("np.int64", np.int64(20)),
          ok("20.5", 20.5)]
BYTES_OR_INT = [bad("-1", -1), bad("None", None), bad("True", True), bad("1.0", 1.0), bad("nan", NAN),
                bad("str", "1"), bad("np.float64", np.float64(8.0)), bad("np.bool_", np.bool_(True)), bad("list", [1]),
                ok("0", 0), ok("np.int64", np.int64(8)), ok("2**63", BIG)]


def count_values(*, zero: bool = True, big: bool = False, none: bool = False) -> list[V]:
    """A count >= 0: ``zero``/``big``/``none`` say whether 0, 2**63 and None are legitimate."""
    vals = without(NOT_INT, "None") if none else list(NOT_INT)
    vals += [bad("-1", -1), ok("np.int64", np.int64(1)), ok("np.uint8", np.uint8(1)),
             ok("0", 0) if zero else bad("0", 0), ok("2**63", BIG) if big else bad("2**63", BIG)]
    return vals + [ok("None", None)] if none else vals


def class_values(top: int, *more: V, none: bool = False) -> list[V]:
    """A size class of a pool whose largest class is ``top``."""
    vals = without(NOT_INT, "None") if none else list(NOT_INT)
    return vals + [bad("-1", -1), bad("top+1", top + 1), bad("2**63", BIG), bad("0.0", 0.0),
                   bad("np.float64 0", np.float64(0.0)), ok("np.int64", np.int64(0)), *more] \
        + ([ok("None", None)] if none else [])


def _pool(w: World, which: str) -> BlockPool:
    return w.Q if which == "Q" else w.P


def id_values(good: str, *, pool: str = "P", bad_states: tuple[str, ...] = (), ok_states: tuple[str, ...] = (),
              none: bool = False) -> list[V]:
    """One block id of ``pool``, its good value the world's ``good`` block."""
    vals = without(NOT_INT, "None") if none else list(NOT_INT)
    vals += [bad("-1", -1), bad("2**63", BIG), bad("other pool's id", W(lambda w: _pool(w, pool).num_blocks)),
             bad("far id", W(lambda w: 2 * _pool(w, pool).num_blocks + 3)),
             ok("np.int64", W(lambda w: np.int64(w.ids[good]))), ok("np.int32", W(lambda w: np.int32(w.ids[good])))]
    vals += [bad(s, wid(s)) for s in bad_states] + [ok(s, wid(s)) for s in ok_states]
    return vals + [ok("None", None)] if none else vals


def ids_values(good: str, *, pool: str = "P", bad_states: tuple[str, ...] = (), ok_states: tuple[str, ...] = (),
               dup: bool | None = None, long: bool = False, alone: bool = False) -> list[V]:
    """A list of block ids (its good value ``[the world's good block]``): bad elements after a good one (and
    after nine held blocks when ``long``: FastBlockPool's batch path), bad containers, repeats if ``dup`` says
    what they mean, and the legitimate spellings (tuple, int arrays and tensors, numpy ints, empty). With
    ``alone`` a block in a bad state is tried on its own (``[x]``, for calls that pair lists up)."""
    def g(w: World) -> list[int]:
        return [w.ids[good]]

    elems = [(v.label, v.value) for v in NOT_INT] + [("-1", -1), ("2**63", BIG),
                                                     ("other pool's id", W(lambda w: _pool(w, pool).num_blocks))]
    vals = [bad(f"[{s}]", W(lambda w, s=s: [w.ids[s]]), wid(s)) for s in bad_states] if alone else []
    elems += [] if alone else [(s, wid(s)) for s in bad_states]
    for label, x in elems:
        vals.append(bad(f"[good, {label}]", W(lambda w, x=x: g(w) + [resolve(x, w)]), x))
        if long:
            vals.append(bad(f"[9 held, {label}]", W(lambda w, x=x: w.R[1:10] + [resolve(x, w)]), x))
    vals += [ok(f"[{s}]", W(lambda w, s=s: [w.ids[s]])) for s in ok_states]
    vals += [bad("None", None), bad("bare int", W(lambda w: g(w)[0])), bad("str", "01"),
             bad("set", W(lambda w: set(g(w)))), bad("dict", W(lambda w: dict.fromkeys(g(w), 1))),
             bad("float array", W(lambda w: np.array(g(w), dtype=np.float64))),
             bad("bool array", np.array([True])), bad("2-D array", W(lambda w: np.array([g(w)]))),
             bad("0-d array", W(lambda w: np.array(g(w)[0]))),
             bad("float tensor", W(lambda w: torch.tensor(g(w), dtype=torch.float32))),
             bad("bool tensor", torch.tensor([True])),
             ok("tuple", W(lambda w: tuple(g(w)))), ok("int64 array", W(lambda w: np.array(g(w)))),
             ok("int32 array", W(lambda w: np.array(g(w), dtype=np.int32))),
             ok("tensor", W(lambda w: torch.tensor(g(w)))),
             ok("np ints", W(lambda w: [np.int64(b) for b in g(w)])), ok("empty", [])]
    if dup is not None:
        twice = W(lambda w: g(w) * 2)
        vals.append(ok("repeat", twice) if dup else bad("repeat", twice, wid(good)))
    if long:
        vals.append(ok("ten held", W(lambda w: list(w.R))))
    return vals


def kv_values(capacity: int, fits: int | None = None) -> list[V]:
    """K/V data ``[2, layers, tokens, heads, dim]`` for blocks of at most ``capacity`` tokens; ``fits`` tokens
    are the most a legitimate call may bring (default ``capacity``)."""
    def kv(t: int, **kw: Any) -> torch.Tensor:
        return torch.zeros(2, 2, t, 2, 4, **kw)

    return [bad("list", [[0.0]], None, "list"), bad("ndarray", np.zeros((2, 2, 1, 2, 4), np.float32), None, "ndarray"),
            bad("4-D", torch.zeros(2, 2, 1, 2), None, "[2, 2, 1, 2]"),
            bad("wrong heads", torch.zeros(2, 2, 1, 3, 4), None, "[2, 2, 1, 3, 4]"),
            bad("3 planes", torch.zeros(3, 2, 1, 2, 4), None, "[3, 2, 1, 2, 4]"),
            bad("float64", kv(1, dtype=torch.float64), None, "torch.float64"),
            bad("int32", kv(1, dtype=torch.int32), None, "torch.int32"),
            bad("meta device", kv(1, device="meta"), None, "meta"),
            bad("too many tokens", kv(capacity + 1), None, f"{capacity + 1} tokens"),
            ok("1 token", kv(1)), ok("full", kv(fits or capacity)), ok("0 tokens", kv(0))]


POOLARG = [bad("None", None), bad("str", "pool"), bad("manager", W(lambda w: w.M)),
           bad("pool class", W(lambda w: type(w.P)))]


def tokens_values(good: list[int], *, counts_ok: bool = False) -> list[V]:
    """Token ids (the good value ``good``): a bad id after good ones, bad containers, legitimate spellings."""
    vals = [bad(f"[.., {label}]", good[:-1] + [x], x) for label, x in TOKEN_JUNK]
    vals += [bad("str", "abcd"), bad("bytes", b"ab"), bad("set", set(good)), bad("dict", dict.fromkeys(good)),
             bad("float", 1.5), bad("None", None),
             bad("float array", np.array(good, dtype=np.float64), float(good[0])),
             bad("str array", np.array(["a"] * len(good)), "a"),
             bad("2-D array", np.array([good]), None, f"{(1, len(good))}"),
             bad("2-D tensor", torch.tensor([good]), None, f"{(1, len(good))}"),
             bad("float tensor", torch.tensor(good, dtype=torch.float32), float(good[0])),
             ok("tuple", tuple(good)), ok("np ints", [np.int64(t) for t in good]), ok("int array", np.array(good)),
             ok("tensor", torch.tensor(good)), ok("range", range(good[0], good[0] + len(good)))]
    if not counts_ok:
        vals.append(bad("int", 5))
    return vals


SEQS = [bad("None", None), bad("freed", W(lambda w: w.X)), bad("other manager's", W(lambda w: w.O)),
        bad("seq id", 0), bad("str", "A"), ok("forked", W(lambda w: w.F)), ok("count seq", W(lambda w: w.N))]
SEQS_RES = SEQS + [bad("swapped", W(lambda w: w.S))]  # where the sequence must be resident
SEQS_ANY = SEQS + [ok("swapped", W(lambda w: w.S))]
APPEND_TRACKED = tokens_values([7, 8, 9]) + [
    bad("count", 5), bad("-1", -1), bad("2**63", BIG), bad("nan", NAN), bad("True", True),
    bad("np.bool_", np.bool_(True)),
    ok("one id", [7]), ok("empty", []), ok("0", 0), ok("max id", [BIG - 1])]
APPEND_COUNT = [bad("None", None), bad("True", True), bad("False", False), bad("1.5", 1.5), bad("nan", NAN),
                bad("inf", INF), bad("-1", -1), bad("str", "3"), bad("np.float64", np.float64(2.0)),
                bad("np.bool_", np.bool_(True)), bad("nested", [[1]], [1]), bad("[1.5]", [1.5], 1.5),
                bad("2**63", BIG), bad("bytes", b"x"), bad("set", {1}),
                ok("2", 2), ok("np.int64", np.int64(2)), ok("0", 0), ok("ids", [1, 2]),
                ok("id array", np.array([1, 2])),
                ok("np.uint8", np.uint8(3))]
TICKETS = [bad("None", None), bad("served", W(lambda w: w.Ts)), bad("cancelled", W(lambda w: w.Tc)),
           bad("timed out", W(lambda w: w.Tt)), bad("other allocator's", W(lambda w: w.T3)),
           bad("ticket id", W(lambda w: w.T.id)), bad("str", "T")]
STATUS = [bad("None", None), bad("True", True), bad("False", False), bad("2.0", 2.0), bad("str", "ALLOCATED"),
          bad("FREE", BlockStatus.FREE), bad("EVICTING", BlockStatus.EVICTING), bad("4", 4),
          bad("np.float64", np.float64(2.0)), bad("np.bool_", np.bool_(True)),
          ok("PENDING", BlockStatus.PENDING), ok("1", 1)]
CAP = count_values(none=True, big=True)
KVBLOCK = ("FREE", "PENDING", "EVICTING", "EVICTING rc0", "cached", "held", "held x3")


def kvblock(state: str) -> W:
    return W(lambda w: KVBlock(w.P, w.ids[state]))


def kvblock_values(good: str, bad_states: tuple[str, ...], ok_states: tuple[str, ...] = ()) -> list[V]:
    return [bad(s, kvblock(s), wid(s)) for s in bad_states] + [ok(s, kvblock(s)) for s in ok_states]


# ---------------------------------------------------------------------------------------------------- methods
@dataclass
class Spec:
    """One public method: ``call(world, args)``, good arguments, the values to try per slot. ``reader``: a
    successful call changes nothing. ``override[slot]``: other arguments for that slot's cases. ``extra``:
    hand-written cases ``(label, argument overrides, expectation)``."""
    name: str
    call: Callable[[World, dict[str, Any]], Any]
    good: dict[str, Any]
    slots: dict[str, list[V]]
    reader: bool = False
    override: dict[str, dict[str, Any]] | None = None
    extra: list[tuple[str, dict[str, Any], V]] | None = None


def method(target: Callable[[World], Any], name: str, pos: tuple[str, ...] = (), kw: tuple[str, ...] = ()):
    """``target(w).name(*pos, **kw)`` with the case's arguments."""
    def call(w: World, a: dict[str, Any]) -> Any:
        return getattr(target(w), name)(*(a[p] for p in pos), **{k: a[k] for k in kw})
    return call


def via_self(name: str, pos: tuple[str, ...] = ()):
    """``a['self'].name(*pos)``: the object itself is a slot (a KVBlock, a Sequence)."""
    return lambda w, a: getattr(a["self"], name)(*(a[p] for p in pos))


def P(w: World) -> BlockPool:
    return w.P


def TB(w: World) -> TextbookPool:
    return TextbookPool(w.P)


def Q(w: World) -> BlockPool:
    return w.Q


def _pool_specs() -> list[Spec]:
    held, free, pend, ev, cached = "held", "FREE", "PENDING", "EVICTING", "cached"
    not_alloc = (free, pend, ev, "EVICTING rc0")
    specs = [
        Spec("BlockPool()", lambda w, a: type(w.P)(a["num_blocks"], spec=SPEC, block_sizes=a["block_sizes"],
                                                   eviction_policy=a["policy"], with_storage=a["with_storage"]),
             {"num_blocks": 4, "block_sizes": None, "policy": "lru", "with_storage": False},
             {"num_blocks": without(NOT_INT, "None") + [bad("0", 0), bad("-1", -1), bad("2**31", 2**31),
                                                       ok("np.int64", np.int64(4))],
              "block_sizes": [bad("[4, 6]", [4, 6], None, "[6]"), bad("[0]", [0]), bad("[4.0]", [4.0]),
                              bad("[True]", [True]), bad("[]", []), bad("str", "4"), bad("int", 4),
                              ok("[4, 8]", [4, 8]), ok("np ints", [np.int64(4), np.int64(16)])],
              "policy": [bad("mru", "mru"), bad("None", None), bad("int", 1), ok("fifo", "fifo")],
              "with_storage": [bad("str", "no"), bad("None", None), bad("1", 1), ok("True", True),
                               ok("np.bool_", np.bool_(False))]}, reader=True),
        Spec("BlockPool.allocate", method(P, "allocate", ("n",), ("size_class", "owner", "status", "block_id")),
             {"n": 1, "size_class": 0, "owner": -1, "status": BlockStatus.ALLOCATED, "block_id": None},
             {"n": count_values(), "size_class": class_values(0), "owner": OWNER, "status": STATUS,
              "block_id": id_values(free, none=True, bad_states=(pend, ev, "EVICTING rc0", cached, held, "shared tail"),
                                    ok_states=(free,))},
             extra=[("n=2 by id", {"n": 2, "block_id": wid(free)}, bad("", None, None, "n=2")),
                    ("reserve by id", {"status": BlockStatus.PENDING, "block_id": wid(free)}, ok("", None)),
                    ("too many", {"n": 99}, bad("", None, None, "99"))]),
        Spec("BlockPool.allocate@Q", method(Q, "allocate", ("n",), ("size_class", "owner")),
             {"n": 1, "size_class": 1, "owner": -1},
             {"size_class": class_values(3, ok("1", 1)), "owner": OWNER}),
        # allocate(n) and allocate(n, owner=o), the only forms FastBlockPool's compiled path serves itself
        Spec("BlockPool.allocate@plain", method(P, "allocate", ("n",), ("owner",)), {"n": 1, "owner": -1},
             {"n": count_values(), "owner": OWNER}),
        Spec("BlockPool.reserve", method(P, "reserve", ("n",), ("size_class", "owner")),
             {"n": 1, "size_class": 0, "owner": -1},
             {"n": count_values(), "size_class": class_values(0), "owner": OWNER}),
        Spec("BlockPool.free", method(P, "free", ("ids",)), {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, bad_states=(cached, ev, "EVICTING rc0", free), ok_states=(pend, "held x3"),
                                dup=False, long=True)},
             extra=[("held x3 thrice", {"ids": W(lambda w: [w.ids["held x3"]] * 3)}, ok("", None)),
                    ("held x3 four times", {"ids": W(lambda w: [w.ids["held x3"]] * 4)}, bad("", None, wid("held x3"))),
                    ("held 40 times", {"ids": W(lambda w: [w.R[0]] * 40)}, bad("", None, wid(held))),
                    ("10 held + a freed one", {"ids": W(lambda w: list(w.R) + [w.ids[free]])},
                     bad("", None, wid(free)))]),
        Spec("BlockPool.decref", method(P, "decref", ("ids",)), {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, bad_states=(cached, *not_alloc), ok_states=("held x3",), dup=False, long=True)},
             extra=[("held x3 thrice", {"ids": W(lambda w: [w.ids["held x3"]] * 3)}, ok("", None)),
                    ("held x3 four times", {"ids": W(lambda w: [w.ids["held x3"]] * 4)},
                     bad("", None, wid("held x3")))]),
        Spec("BlockPool.incref", method(P, "incref", ("ids",)), {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, bad_states=not_alloc, ok_states=(cached,), dup=True, long=True)},
             extra=[("20 times", {"ids": W(lambda w: [w.R[0]] * 20)}, ok("", None)),
                    ("a FREE one 20 times", {"ids": W(lambda w: [w.ids[free]] * 20)}, bad("", None, wid(free)))]),
        Spec("BlockPool.touch", method(P, "touch", ("ids",)), {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, bad_states=not_alloc, ok_states=(cached,), dup=True, long=True)}),
        Spec("BlockPool.mark_reusable", method(P, "mark_reusable", ("ids", "reusable")),
             {"ids": W(lambda w: [w.R[0]]), "reusable": True},
             {"ids": ids_values(held, bad_states=(free, ev, "EVICTING rc0"), ok_states=(pend, cached), dup=True),
              "reusable": FLAG},
             extra=[("unmark a cached block", {"ids": W(lambda w: [w.ids[cached]]), "reusable": False}, ok("", None))]),
        # mark_reusable(ids), the only form FastBlockPool's compiled path serves itself
        Spec("BlockPool.mark_reusable@plain", method(P, "mark_reusable", ("ids",)), {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, bad_states=(free, ev, "EVICTING rc0"), ok_states=(pend, cached), dup=True)}),
        Spec("BlockPool.set_token_counts", method(P, "set_token_counts", ("ids", "counts")),
             {"ids": W(lambda w: [w.R[0]]), "counts": [2]},
             {"ids": [v for v in ids_values(held, bad_states=(free,)) if not v.ok or v.label in ("tuple", "np ints")],
              "counts": [bad("None", None), bad("[1.0]", [1.0], 1.0), bad("[nan]", [NAN], NAN),
                         bad("[True]", [True], True), bad("[-1]", [-1], -1), bad("[5]", [5], 5),
                         bad("[2**63]", [BIG], BIG), bad("['1']", ["1"], "1"),
                         bad("[[1]]", [[1]], [1]), bad("[np.float64]", [np.float64(1.0)], np.float64(1.0)),
                         bad("[np.bool_]", [np.bool_(True)], np.bool_(True)), bad("two counts", [1, 1]),
                         bad("str", "1"), bad("int", 1),
                         ok("[np.int64]", [np.int64(2)]), ok("tuple", (3,)), ok("[0]", [0]), ok("[4]", [4])]}),
        Spec("BlockPool.set_token_count", method(P, "set_token_count", ("block_id", "count")),
             {"block_id": wid(held), "count": 2},
             {"block_id": id_values(held, bad_states=(free,), ok_states=(pend, cached)),
              "count": without(NOT_INT, "list") + [bad("-1", -1), bad("5", 5), bad("2**63", BIG),
                                                   ok("np.int64", np.int64(3)), ok("0", 0)]}),
        Spec("BlockPool.set_owner", method(P, "set_owner", ("ids", "owner")),
             {"ids": W(lambda w: [w.R[0]]), "owner": 9},
             {"ids": ids_values(held, bad_states=(free,), ok_states=(pend, cached), dup=True), "owner": OWNER}),
        Spec("BlockPool.commit", method(P, "commit", ("ids",)), {"ids": W(lambda w: [w.ids["PENDING"]])},
             {"ids": ids_values(pend, bad_states=(free, held, ev, cached), dup=False)}),
        Spec("BlockPool.begin_eviction", method(P, "begin_eviction", ("ids",)), {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, bad_states=(free, pend, ev), ok_states=(cached,), dup=False, long=True)}),
        Spec("BlockPool.finish_eviction", method(P, "finish_eviction", ("ids",)), {"ids": W(lambda w: [w.ids[ev]])},
             {"ids": ids_values(ev, bad_states=(free, held, pend, cached), ok_states=("EVICTING rc0",), dup=False)}),
        Spec("BlockPool.evict", method(P, "evict", ("reason",)), {"reason": "explicit"}, {"reason": REASON}),
        Spec("TextbookPool.evict_block", method(TB, "evict_block", ("reason",)), {"reason": "explicit"},
             {"reason": REASON}),
        Spec("BlockPool.release_cached", method(P, "release_cached", ("block_id",)), {"block_id": wid(cached)},
             {"block_id": id_values(cached, bad_states=(held, "held x3", *not_alloc))}),
        Spec("TextbookPool.release_block", method(TB, "release_block", ("block_id",)), {"block_id": wid(held)},
             {"block_id": id_values(held, bad_states=(free, cached, ev, "EVICTING rc0"), ok_states=(pend, "held x3"))}),
        Spec("BlockPool.split_block", method(Q, "split_block", ("block_id",)), {"block_id": wid("Q FREE c1")},
             {"block_id": id_values("Q FREE c1", pool="Q",
                                    bad_states=("Q FREE c0", "Q cached c1", "Q held c2", "Q inner"))},
             extra=[("uniform pool", {"block_id": wid(free)}, bad("", None, wid(free)))]),
        Spec("BlockPool.merge_free_buddies", method(Q, "merge_free_buddies", ("max_merges",)), {"max_merges": None},
             {"max_merges": CAP}),
        Spec("BlockPool.sort_free_lists", method(P, "sort_free_lists"), {}, {}),
        Spec("BlockPool.migrate", method(P, "migrate", ("src", "dst", "reason")),
             {"src": W(lambda w: [w.R[0]]), "dst": W(lambda w: [w.ids["FREE"]]), "reason": "compaction"},
             {"src": [v for v in ids_values(held, bad_states=(free, pend, ev), alone=True)
                      if not v.ok or v.label == "tuple"],
              "dst": [v for v in ids_values(free, bad_states=("held x3", pend, ev, cached), alone=True)
                      if not v.ok or v.label == "np ints"],
              "reason": REASON},
             extra=[("onto itself", {"dst": W(lambda w: [w.R[0]])}, bad("", None, W(lambda w: w.R[0]))),
                    ("2 sources, 1 destination", {"src": W(lambda w: w.R[:2])}, bad("", None, None, "2 sources")),
                    ("nothing", {"src": [], "dst": []}, ok("", None))]),
        Spec("BlockPool.check_id", method(P, "check_id", ("block_id",)), {"block_id": wid(held)},
             {"block_id": id_values(held, ok_states=KVBLOCK)}, reader=True),
        Spec("BlockPool.check_id@Q", method(Q, "check_id", ("block_id",)), {"block_id": wid("Q held c2")},
             {"block_id": id_values("Q held c2", pool="Q", bad_states=("Q inner",), ok_states=("Q FREE c1",))},
             reader=True),
        Spec("BlockPool.check_ids", method(P, "check_ids", ("ids",)), {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, ok_states=KVBLOCK, dup=True)}, reader=True),
        Spec("TextbookPool.block", method(TB, "block", ("block_id",)), {"block_id": wid(held)},
             {"block_id": id_values(held, ok_states=KVBLOCK)}, reader=True),
        Spec("BlockPool.span", method(Q, "span", ("block_id",)), {"block_id": wid("Q held c2")},
             {"block_id": id_values("Q held c2", pool="Q", bad_states=("Q inner",))}, reader=True),
        Spec("BlockPool.is_cached", method(P, "is_cached", ("block_id",)), {"block_id": wid(cached)},
             {"block_id": id_values(cached, ok_states=KVBLOCK)}, reader=True),
        Spec("BlockPool.check_class", method(P, "check_class", ("size_class",)), {"size_class": 0},
             {"size_class": class_values(0)}, reader=True),
        Spec("BlockPool.check_class@Q", method(Q, "check_class", ("size_class",)), {"size_class": 3},
             {"size_class": class_values(3, ok("3", 3))}, reader=True),
        Spec("TextbookPool()", lambda w, a: TextbookPool(a["pool"]), {"pool": W(lambda w: w.P)},
             {"pool": POOLARG}, reader=True),
        Spec("BlockPool.free_ids", method(P, "free_ids", ("size_class",)), {"size_class": 0},
             {"size_class": class_values(0)}, reader=True),
        Spec("BlockPool.free_ids@Q", method(Q, "free_ids", ("size_class",)), {"size_class": 3},
             {"size_class": class_values(3, ok("3", 3))}, reader=True),
        Spec("TextbookPool.get_best_block", method(TB, "get_best_block", ("required_size",)),
             {"required_size": 64},
             {"required_size": BYTES_OR_INT}, reader=True),
        Spec("TextbookPool.allocate_block", method(TB, "allocate_block", ("block_id", "kv_data", "owner")),
             {"block_id": wid(free), "kv_data": None, "owner": -1},
             {"block_id": id_values(free, none=True, bad_states=(held, pend, ev, "EVICTING rc0", cached)),
              "kv_data": kv_values(4), "owner": OWNER},
             extra=[("by size", {"block_id": None, "kv_data": torch.zeros(2, 2, 3, 2, 4)}, ok("", None))]),
    ]
    for name in ("stats", "snapshot", "status_counts", "free_runs", "check_invariants", "storage_of"):
        specs.append(Spec(f"BlockPool.{name}", method(P, name), {}, {}, reader=True))
    for name in ("calculate_fragmentation", "get_memory_usage", "get_stats"):
        specs.append(Spec(f"TextbookPool.{name}", method(TB, name), {}, {}, reader=True))
    # More repeats than the pool has blocks: a repeat means one reference per occurrence, never an index
    forty = {"ids": W(lambda w: [w.R[0]] * 40)}
    for s in specs:
        name = s.name.split(".")[-1]
        if name in ("incref", "touch", "mark_reusable", "set_owner", "check_ids"):
            s.extra = [*(s.extra or []), ("40 repeats", forty, ok("", None))]
        elif name in ("decref", "commit", "begin_eviction"):
            s.extra = [*(s.extra or []), ("40 repeats", forty, bad("", None, W(lambda w: w.R[0])))]
    return specs


def _block_specs() -> list[Spec]:
    free, cached, held = "FREE", "cached", "held"
    nonalloc = ("FREE", "PENDING", "EVICTING", "EVICTING rc0")
    return [
        Spec("KVBlock()", lambda w, a: KVBlock(a["pool"], a["block_id"]), {"pool": W(lambda w: w.P), "block_id": 0},
             {"pool": POOLARG, "block_id": id_values(held, ok_states=KVBLOCK)}, reader=True),
        Spec("KVBlock.allocate", via_self("allocate", ("kv_data",)), {"self": kvblock(free), "kv_data": None},
             {"self": kvblock_values(free, ("PENDING", "EVICTING", held, cached)), "kv_data": kv_values(4)}),
        Spec("KVBlock.release", via_self("release"), {"self": kvblock(cached)},
             {"self": kvblock_values(cached, (held, "held x3", *nonalloc))}),
        Spec("KVBlock.increment_reference", via_self("increment_reference"), {"self": kvblock(held)},
             {"self": kvblock_values(held, nonalloc, (cached,))}),
        Spec("KVBlock.decrement_reference", via_self("decrement_reference"), {"self": kvblock(held)},
             {"self": kvblock_values(held, (cached, *nonalloc), ("held x3",))}),
        Spec("KVBlock.is_compatible", via_self("is_compatible", ("required_size",)),
             {"self": kvblock(free), "required_size": 64},
             {"required_size": BYTES_OR_INT, "self": kvblock_values(free, (), (held,))}, reader=True),
    ]


def _refs_specs() -> list[Spec]:
    R = lambda w: w.refs  # noqa: E731
    held, cached = "held", "cached"
    nonalloc = ("FREE", "PENDING", "EVICTING", "EVICTING rc0")
    return [
        Spec("ReferenceManager()", lambda w, a: ReferenceManager(a["pool"]), {"pool": W(lambda w: w.P)},
             {"pool": POOLARG}, reader=True),
        Spec("ReferenceManager.add_reference", method(R, "add_reference", ("block_id",)), {"block_id": wid(held)},
             {"block_id": id_values(held, bad_states=nonalloc, ok_states=(cached,))}),
        Spec("ReferenceManager.remove_reference", method(R, "remove_reference", ("block_id",)),
             {"block_id": wid(held)},
             {"block_id": id_values(held, bad_states=(cached, *nonalloc), ok_states=("held x3",))}),
        Spec("ReferenceManager.add_references", method(R, "add_references", ("ids",)), {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, bad_states=nonalloc, ok_states=(cached,), dup=True)}),
        Spec("ReferenceManager.remove_references", method(R, "remove_references", ("ids",)),
             {"ids": W(lambda w: [w.R[0]])},
             {"ids": ids_values(held, bad_states=(cached, *nonalloc), ok_states=("held x3",), dup=False)}),
        Spec("ReferenceManager.get_reference_count", method(R, "get_reference_count", ("block_id",)),
             {"block_id": wid(held)}, {"block_id": id_values(held, ok_states=KVBLOCK)}, reader=True),
        Spec("ReferenceManager.is_safe_to_evict", method(R, "is_safe_to_evict", ("block_id",)),
             {"block_id": wid(cached)}, {"block_id": id_values(cached, ok_states=KVBLOCK)}, reader=True),
        Spec("ReferenceManager.get_all_references", method(R, "get_all_references"), {}, {}, reader=True),
    ]


def _sequence_specs() -> list[Spec]:
    M = lambda w: w.M  # noqa: E731
    A, F, N, S = (W(lambda w, n=n: getattr(w, n)) for n in "AFNS")
    seq_lists = [bad("None", None), bad("bare seq", A), bad("repeat", W(lambda w: [w.A, w.A]), A),
                 bad("[freed, N]", W(lambda w: [w.X, w.N]), W(lambda w: w.X)),
                 bad("[swapped, N]", W(lambda w: [w.S, w.N]), S), bad("[None, N]", W(lambda w: [None, w.N]), None),
                 bad("[other manager's, N]", W(lambda w: [w.O, w.N]), W(lambda w: w.O)),
                 bad("[seq id, N]", W(lambda w: [0, w.N]), 0), bad("str", "AN"),
                 ok("tuple", W(lambda w: (w.A, w.N))), ok("[F, N]", W(lambda w: [w.F, w.N]))]
    news = [bad("None", None), bad("one entry", [[7]]), bad("[.., None]", [[7], None], None),
            bad("[.., str]", [[7], "x"], "x"), bad("[[7, str], ..]", [[7, "x"], 2], "x"),
            bad("[.., 1.5]", [[7], 1.5], 1.5),
            bad("[.., -1]", [[7], -1], -1), bad("[.., nested]", [[7], [[1]]], [1]), bad("[[nan], ..]", [[NAN], 2], NAN),
            bad("[[inf], ..]", [[INF], 2], INF), bad("[.., 2**63]", [[7], BIG], BIG), bad("str", "ab"),
            ok("tuple", ([7], 2)), ok("nothing", [[], 0]), ok("numpy", [np.array([7]), np.int64(2)])]
    batch = {"seqs": W(lambda w: [w.A, w.N]), "new": [[7], 2]}

    def append_spec(who: str, values: list[V], seq_slot: bool = False) -> Spec:
        slots = {"new": values} | ({"seq": SEQS_RES + [ok("A", A)]} if seq_slot else {})
        over = {"seq": {"new": 0}} if seq_slot else None  # 0 tokens suit every sequence
        return Spec(f"SequenceManager.append[{who}]", method(M, "append", ("seq", "new")),
                    {"seq": W(lambda w: getattr(w, who)), "new": [7] if who != "N" else 2}, slots, override=over)

    return [
        Spec("SequenceManager()", lambda w, a: SequenceManager(a["pool"], a["prefix_cache"]),
             {"pool": W(lambda w: w.P), "prefix_cache": None},
             {"pool": POOLARG + [bad("prefix cache", W(lambda w: w.C))],
              "prefix_cache": [bad("str", "yes"), bad("1", 1), bad("0", 0), bad("np.float64", np.float64(1.0)),
                               bad("another pool's", W(lambda w: w.Cq), None, "another pool"),
                               ok("True", True), ok("False", False), ok("np.bool_", np.bool_(True)),
                               ok("its cache", W(lambda w: w.C))]}),
        Spec("SequenceManager.create", method(M, "create", ("prompt",), ("tenant",)),
             {"prompt": list(range(10)), "tenant": None},
             {"prompt": without(tokens_values(list(range(10))), "None") + [ok("None", None), ok("empty", []),
                                                                          ok("one", [3])],
              "tenant": TENANT}),
        Spec("SequenceManager.fork", method(M, "fork", ("seq",)), {"seq": A}, {"seq": SEQS_RES}),
        Spec("SequenceManager.free", method(M, "free", ("seq",)), {"seq": N}, {"seq": SEQS_ANY}),
        append_spec("A", APPEND_TRACKED, seq_slot=True),
        append_spec("F", APPEND_TRACKED),
        append_spec("N", APPEND_COUNT),
        Spec("SequenceManager.append_batch", method(M, "append_batch", ("seqs", "new")), batch,
             {"seqs": seq_lists, "new": news}),
        Spec("SequenceManager.append_tokens", method(M, "append_tokens", ("seqs", "new")), batch,
             {"seqs": seq_lists, "new": news}),
        Spec("SequenceManager.block_tables", method(M, "block_tables", ("seqs",)), {"seqs": W(lambda w: [w.A, w.N])},
             {"seqs": [bad("None", None), bad("bare seq", A), bad("[None]", [None], None),
                       bad("[freed]", W(lambda w: [w.X]), W(lambda w: w.X)), bad("[swapped]", W(lambda w: [w.S]), S),
                       bad("[other manager's]", W(lambda w: [w.O]), W(lambda w: w.O)), bad("[seq id]", [0], 0),
                       bad("str", "AN"), ok("tuple", W(lambda w: (w.A,))), ok("empty", []),
                       ok("[F]", W(lambda w: [w.F]))]}, reader=True),
        Spec("SequenceManager.slot_mapping", method(M, "slot_mapping", ("seqs", "starts", "stops")),
             {"seqs": W(lambda w: [w.A]), "starts": [0], "stops": [10]},
             {"seqs": [bad("None", None), bad("bare seq", A), bad("[None]", [None], None),
                       bad("[freed]", W(lambda w: [w.X]), W(lambda w: w.X)), bad("[swapped]", W(lambda w: [w.S]), S),
                       bad("[other manager's]", W(lambda w: [w.O]), W(lambda w: w.O)),
                       bad("two seqs", W(lambda w: [w.A, w.N]), None, "2 sequences"), ok("tuple", W(lambda w: (w.A,)))],
              "starts": [bad("None", None), bad("[1.0]", [1.0], 1.0), bad("[None]", [None], None),
                         bad("[-1]", [-1], -1),
                         bad("[True]", [True], True), bad("[nan]", [NAN], NAN), bad("['0']", ["0"], "0"),
                         bad("[np.float64]", [np.float64(0.0)], np.float64(0.0)), bad("[11]", [11], 11),
                         bad("two starts", [0, 0]), bad("str", "0"), bad("bare int", 0),
                         ok("[np.int64]", [np.int64(2)]), ok("tuple", (0,)), ok("int array", np.array([3])),
                         ok("[10]", [10])],
              "stops": [bad("None", None), bad("[1.0]", [1.0], 1.0), bad("[None]", [None], None), bad("[11]", [11], 11),
                        bad("[2**63]", [BIG], BIG), bad("[-1]", [-1], -1), bad("[True]", [True], True),
                        bad("['10']", ["10"], "10"), ok("[np.int64]", [np.int64(5)]), ok("[0]", [0])]}, reader=True),
        Spec("SequenceManager.cache_full_blocks", method(M, "cache_full_blocks", ("seq",)), {"seq": A},
             {"seq": SEQS_RES}),
        Spec("SequenceManager.check_invariants", method(M, "check_invariants", ("exclusive",)), {"exclusive": False},
             {"exclusive": without(FLAG, "True", "np.bool_") + [ok("np.bool_", np.bool_(False))]}, reader=True),
        Spec("SequenceManager.swappable", method(M, "swappable", ("seq",)), {"seq": A}, {"seq": SEQS_RES},
             reader=True),
        Spec("SequenceManager.swap_out", method(M, "swap_out", ("seq",)), {"seq": N},
             {"seq": SEQS_RES + [ok("A", A)]}),
        Spec("SequenceManager.swap_in", method(M, "swap_in", ("seq",)), {"seq": S},
             {"seq": without(SEQS, "forked", "count seq") + [bad("resident", A)]}),
        Spec("Sequence.append", via_self("append", ("new",)), {"self": F, "new": [7]},
             {"self": [bad("freed", W(lambda w: w.X)), bad("swapped", S), ok("A", A)], "new": APPEND_TRACKED}),
        Spec("Sequence.fork", via_self("fork"), {"self": A},
             {"self": [bad("freed", W(lambda w: w.X)), bad("swapped", S), ok("forked", F)]}),
        Spec("Sequence.free", via_self("free"), {"self": N},
             {"self": [bad("freed", W(lambda w: w.X)), ok("swapped", S), ok("forked", F)]}),
        Spec("Sequence.swap_out", via_self("swap_out"), {"self": N},
             {"self": [bad("freed", W(lambda w: w.X)), bad("swapped", S)]}),
        Spec("Sequence.swap_in", via_self("swap_in"), {"self": S},
             {"self": [bad("freed", W(lambda w: w.X)), bad("resident", A)]}),
        Spec("Sequence.slots", via_self("slots"), {"self": A},
             {"self": [bad("freed", W(lambda w: w.X)), bad("swapped", S), ok("forked", F)]}, reader=True),
    ]


def _prefix_specs() -> list[Spec]:
    C = lambda w: w.C  # noqa: E731
    max_blocks = [bad("-1", -1), bad("1.0", 1.0), bad("True", True), bad("str", "1"), bad("nan", NAN),
                  bad("np.float64", np.float64(1.0)), bad("list", [1]), bad("inf", INF),
                  bad("np.bool_", np.bool_(True)),
                  ok("0", 0), ok("np.int64", np.int64(1)), ok("2**63", BIG), ok("None", None), ok("5", 5)]
    query = {"token_ids": tokens_values(list(range(10))) + [ok("empty", []), ok("short", [0, 1])],
             "tenant": TENANT, "max_blocks": max_blocks}
    good = {"token_ids": list(range(10)), "tenant": None, "max_blocks": None}
    parent = [bad("str", "abc"), bad("int", 1), bad("True", True), bad("list", [b"x"]),
              bad("bytearray", bytearray(16))]
    return [
        Spec("PrefixCache()", lambda w, a: PrefixCache(a["pool"]), {"pool": W(lambda w: w.P)}, {"pool": POOLARG}),
        # the references a hit takes are the caller's: given back, so the tables' refcounts hold again
        Spec("PrefixCache.match", lambda w, a: w.P.free(w.C.match(a["token_ids"], a["tenant"], a["max_blocks"])[0]),
             good, query),
        Spec("PrefixCache.peek", method(C, "peek", ("token_ids", "tenant", "max_blocks")), good, query, reader=True),
        Spec("PrefixCache.store", method(C, "store", ("block_id", "token_ids", "parent", "tenant")),
             {"block_id": wid("held"), "token_ids": [50, 51, 52, 53], "parent": None, "tenant": None},
             {"block_id": id_values("held", bad_states=("FREE", "cached", "PENDING", "EVICTING", "EVICTING rc0"),
                                    ok_states=("held x3",)),
              "token_ids": tokens_values([50, 51, 52, 53]) + [bad("2 ids", [50, 51]), bad("5 ids", [50] * 5)],
              "parent": parent + [bad("unknown", b"\0" * 16, None, "0" * 32),
                                  ok("A's chain", W(lambda w: w.A.prefix_hash))],
              "tenant": TENANT}),
        Spec("PrefixCache.store_blocks", method(C, "store_blocks", ("block_ids", "token_ids", "parent", "tenant")),
             {"block_ids": W(lambda w: [w.ids["held"]]), "token_ids": [50, 51, 52, 53], "parent": None,
              "tenant": None},
             {"block_ids": without(ids_values("held", bad_states=("FREE", "cached", "PENDING", "EVICTING",
                                                                  "EVICTING rc0"), ok_states=("held x3",)), "empty"),
              "token_ids": tokens_values([50, 51, 52, 53]) + [bad("2 ids", [50, 51]), bad("5 ids", [50] * 5)],
              "parent": parent + [bad("unknown", b"\0" * 16, None, "0" * 32),
                                  ok("A's chain", W(lambda w: w.A.prefix_hash))],
              "tenant": TENANT},
             extra=[("no blocks", {"block_ids": [], "token_ids": []}, ok("", None)),
                    ("a chain of two", {"block_ids": W(lambda w: [w.ids["held"], w.ids["held x3"]]),
                                        "token_ids": list(range(50, 58))}, ok("", None)),
                    ("one block twice", {"block_ids": W(lambda w: [w.ids["held"]] * 2),
                                         "token_ids": list(range(50, 58))}, bad("", None, wid("held")))]),
        Spec("PrefixCache.entries", method(C, "entries"), {}, {}, reader=True),
        Spec("PrefixCache.check_invariants", method(C, "check_invariants"), {}, {}, reader=True),
        Spec("PrefixCache.holds", method(C, "holds", ("block_id",)), {"block_id": wid("cached")},
             {"block_id": id_values("cached", ok_states=KVBLOCK)}, reader=True),
        Spec("PrefixCache.digest_of", method(C, "digest_of", ("block_id",)), {"block_id": wid("cached")},
             {"block_id": id_values("cached", ok_states=KVBLOCK)}, reader=True),
        Spec("PrefixCache.entry", method(C, "entry", ("block_id",)), {"block_id": wid("cached")},
             {"block_id": id_values("cached", ok_states=KVBLOCK)}, reader=True),
        Spec("PrefixCache.block_hash", method(C, "block_hash", ("parent", "token_ids", "tenant")),
             {"parent": None, "token_ids": [1, 2, 3, 4], "tenant": None},
             {"parent": parent + [ok("any bytes", b"\1" * 16)],
              "token_ids": tokens_values([1, 2, 3, 4]) + [ok("empty", [])], "tenant": TENANT}, reader=True),
        Spec("PrefixCache.future_uses", method(C, "future_uses", ("prompts", "block_size", "tenants")),
             {"prompts": [list(range(10)), [0, 1]], "block_size": 4, "tenants": None},
             {"prompts": [bad("str", "abcd"), bad("None", None), bad("int", 3), bad("a str prompt", ["abcd"], "abcd"),
                          bad("a float token", [[0, 1.5]], 1.5), bad("a negative token", [[0, -1]], -1),
                          ok("empty", []), ok("an empty prompt", [[]]), ok("tuples", ((0, 1, 2, 3, 4),))],
              "block_size": count_values(zero=False, big=True),  # a block larger than every prompt: no hashes
              "tenants": [bad("str", "t"), bad("one too few", [None], VALUE, "1 tenants for 2 prompts"),
                          bad("a bad tenant", [1, None], 1),
                          ok("two", ["t", None]), ok("Nones", [None, None])]}, reader=True),
        Spec("PrefixCache.cached_block", method(C, "cached_block", ("digest", "token_ids")),
             {"digest": b"\1" * 16, "token_ids": [1, 2, 3, 4]},
             {"digest": parent + [bad("None", None), ok("A's chain", W(lambda w: w.A.prefix_hash))],
              "token_ids": tokens_values([1, 2, 3, 4]) + [ok("empty", [])]}, reader=True),
        Spec("PrefixCache.get_stats", method(C, "get_stats"), {}, {}, reader=True),
        Spec("PrefixCache.held_back", method(C, "held_back", ("min_order", "kept")), {"min_order": 0, "kept": []},
             {"min_order": class_values(0), "kept": ids_values("cached", ok_states=KVBLOCK, dup=True)},
             reader=True),
    ]


def _allocator_specs() -> list[Spec]:
    D, D2 = (lambda w: w.D), (lambda w: w.D2)
    kw = ("kv_data", "tokens", "size_class", "owner", "timeout", "wait")
    sizes = {"kv_data": {"size_class": None}, "tokens": {"size_class": None}}
    tokens = without(NOT_INT, "None") + [bad("-1", -1), bad("33", 33), bad("2**63", BIG),
                                         ok("np.int64", np.int64(5)), ok("0", 0), ok("16", 16), ok("None", None)]
    timeout = [bad("-1", -1), bad("nan", NAN), bad("True", True), bad("str", "1"), bad("list", [1]),
               bad("np.bool_", np.bool_(True)), bad("-inf", -INF), bad("bytes", b"1"),
               ok("inf", INF), ok("np.float64", np.float64(2.0)), ok("np.int64", np.int64(3)), ok("0", 0),
               ok("None", None), ok("2.5", 2.5)]
    wait = [v for v in FLAG if not v.ok]

    def request(name: str, target, good: dict[str, Any], waits: list[V]) -> Spec:
        return Spec(name, method(target, "allocate_optimal_block", (), kw), good,
                    {"kv_data": kv_values(32, fits=16) + [ok("None", None)], "tokens": tokens,
                     "size_class": class_values(3, ok("1", 1), none=True), "owner": OWNER, "timeout": timeout,
                     "wait": wait + waits}, override=sizes,
                    extra=[("kv_data and tokens",
                            {"kv_data": torch.zeros(2, 2, 1, 2, 4), "tokens": 1, "size_class": None},
                            bad("", None, None, "kv_data")),
                           ("tokens and size_class", {"tokens": 1, "size_class": 0},
                            bad("", None, None, "size_class"))])

    qids = ("Q FREE c0", "Q cached c1", "Q inner", "Q FREE c1")
    return [
        Spec("DynamicAllocator()", lambda w, a: DynamicAllocator(a["pool"], history=a["history"]),
             {"pool": W(lambda w: w.Q), "history": 100},
             {"pool": POOLARG, "history": count_values(none=True)}, reader=True),
        # D2 has no waiter: a class-2 request is served by evicting cached block 2 (wait=False: the text's
        # "refuse instead of queueing" must not evict first and refuse after)
        request("DynamicAllocator.allocate_optimal_block", D2,
                {"kv_data": None, "tokens": None, "size_class": 2, "owner": -1, "timeout": None, "wait": False},
                [ok("True", True), ok("np.bool_", np.bool_(False))]),
        # D has a waiter: every request queues behind it, and a bad one must not be queued
        request("DynamicAllocator.allocate_optimal_block@waiting", D,
                {"kv_data": None, "tokens": None, "size_class": 0, "owner": -1, "timeout": None, "wait": True},
                [ok("np.bool_", np.bool_(True))]),
        Spec("DynamicAllocator.cancel", method(D, "cancel", ("ticket",)), {"ticket": W(lambda w: w.T)},
             {"ticket": TICKETS}),
        Spec("DynamicAllocator.deallocate_block", method(D, "deallocate_block", ("block_id",)),
             {"block_id": wid("Q held c2")},
             {"block_id": id_values("Q held c2", pool="Q", bad_states=qids, ok_states=("Q held c0",))}),
        Spec("DynamicAllocator.split_block", method(D2, "split_block", ("block_id", "size_class")),
             {"block_id": wid("Q FREE c1"), "size_class": 0},
             {"block_id": id_values("Q FREE c1", pool="Q", bad_states=("Q FREE c0", "Q cached c1", "Q held c2",
                                                                     "Q inner", "Q held c0")),
              "size_class": [bad("None", None), bad("-1", -1), bad("1", 1), bad("1.0", 1.0), bad("True", True),
                             bad("False", False), bad("str", "0"), bad("np.float64", np.float64(0.0)),
                             bad("np.bool_", np.bool_(False)), bad("nan", NAN), ok("np.int64", np.int64(0))]}),
        Spec("DynamicAllocator.make_room", method(D2, "make_room", ("size_class",)), {"size_class": 0},
             {"size_class": class_values(3, ok("evict", np.int64(2)), ok("1", 1), ok("3 (impossible)", 3))}),
        Spec("DynamicAllocator.size_class_for", method(D, "size_class_for", ("tokens",)), {"tokens": 5},
             {"tokens": NOT_INT + [bad("-1", -1), bad("33", 33), bad("2**63", BIG), ok("0", 0),
                                   ok("np.int64", np.int64(32)), ok("17", 17)]}, reader=True),
        Spec("DynamicAllocator.handle_wait_queue", method(D, "handle_wait_queue"), {}, {}),
    ]


def _fragmentation_specs() -> list[Spec]:
    specs = [
        Spec("FragmentationDetector()", lambda w, a: FragmentationDetector(a["pool"], a["threshold"]),
             {"pool": W(lambda w: w.P), "threshold": 20}, {"pool": POOLARG, "threshold": NUMBER}, reader=True),
        Spec("DefragmentationStrategy()", lambda w, a: DefragmentationStrategy(a["pool"], a["minimum"], a["max_moves"]),
             {"pool": W(lambda w: w.P), "minimum": 15, "max_moves": None},
             {"pool": POOLARG, "minimum": NUMBER, "max_moves": CAP}, reader=True),
    ]
    for where in ("p", "q"):
        det, strat = (lambda w, x=where: getattr(w, f"det_{x}")), (lambda w, x=where: getattr(w, f"strat_{x}"))
        at = "" if where == "p" else "@Q"
        specs.append(Spec(f"DefragmentationStrategy.defragment{at}",
                          method(strat, "defragment", (), ("force", "max_moves")),
                          {"force": True, "max_moves": None}, {"force": FLAG, "max_moves": CAP}))
        for name in ("detect_fragmentation", "external_fragmentation", "trigger_percent"):
            specs.append(Spec(f"FragmentationDetector.{name}{at}", method(det, name), {}, {}, reader=True))
    return specs


def _prealloc_specs() -> list[Spec]:
    pre = lambda w: w.pre  # noqa: E731
    counts = count_values()
    return [
        Spec("Preallocator()", lambda w, a: Preallocator(a["pool"], allocator=a["allocator"], window=a["window"],
                                                         horizon=a["horizon"], headroom=a["headroom"],
                                                         max_reserve=a["max_reserve"]),
             {"pool": W(lambda w: w.P), "allocator": None, "window": 64, "horizon": 1024, "headroom": 1.0,
              "max_reserve": None},
             {"pool": POOLARG,
              "allocator": [bad("str", "x"), bad("int", 1),
                            bad("another pool's", W(lambda w: w.D), None, "another pool"),
                            bad("prefix cache", W(lambda w: w.C)), ok("None", None),
                            ok("its pool's", W(lambda w: DynamicAllocator(w.P)))],
              "window": [bad("0", 0), bad("-1", -1), bad("1.0", 1.0), bad("True", True), bad("str", "64"),
                         bad("np.float64", np.float64(64.0)), bad("None", None), bad("over horizon", 2000),
                         ok("np.int64", np.int64(64)), ok("1", 1)],
              "horizon": [bad("0", 0), bad("-1", -1), bad("under window", 10), bad("1.0", 1.0), bad("True", True),
                          bad("str", "1024"), bad("None", None), ok("np.int64", np.int64(2048))],
              "headroom": [bad("0", 0), bad("-1", -1), bad("nan", NAN), bad("str", "1"), bad("True", True),
                           bad("None", None), bad("inf", INF), bad("np.bool_", np.bool_(True)),
                           ok("1.5", 1.5), ok("np.float64", np.float64(2.0)), ok("1", 1), ok("np.int64", np.int64(2))],
              "max_reserve": [bad("-1", -1), bad("1.0", 1.0), bad("True", True), bad("str", "3"), bad("nan", NAN),
                              ok("None", None), ok("0", 0), ok("np.int64", np.int64(4))]}, reader=True),
        Spec("Preallocator.observe", method(pre, "observe", ("owner", "size_class", "n")),
             {"owner": 7, "size_class": 0, "n": 1},
             {"owner": OWNER, "size_class": class_values(0), "n": counts}),
        Spec("Preallocator.predict", method(pre, "predict", ("owner", "size_class")), {"owner": 7, "size_class": 0},
             {"owner": OWNER, "size_class": class_values(0)}, reader=True),
        Spec("Preallocator.allocate", method(pre, "allocate", ("n",), ("owner", "size_class")),
             {"n": 1, "owner": 7, "size_class": 0},
             {"n": counts, "owner": OWNER, "size_class": class_values(0)}),
        Spec("Preallocator.replenish", method(pre, "replenish"), {}, {}),
        Spec("Preallocator.release_all", method(pre, "release_all"), {}, {}),
    ]


SPECS: list[Spec] = (_pool_specs() + _block_specs() + _refs_specs() + _sequence_specs() + _prefix_specs()
                     + _allocator_specs() + _fragmentation_specs() + _prealloc_specs())


# ---------------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    cls: type[BlockPool]
    spec: Spec
    label: str
    args: dict[str, Any]
    expect: V

    @property
    def id(self) -> str:
        return f"{self.cls.__name__}/{self.spec.name}[{self.label}]"


def cases_of(cls: type[BlockPool], keep: Callable[[Spec, str, V], bool] | None = None) -> list[Case]:
    """The cases on pool class ``cls``: every method's good call and hand-written extras, and each slot's values
    (those ``keep(spec, slot, value)`` accepts, when given)."""
    out = []
    for spec in SPECS:
        out.append(Case(cls, spec, "good", {}, ok("good", None)))
        for slot, values in spec.slots.items():
            for v in values:
                if keep is not None and not keep(spec, slot, v):
                    continue
                args = {**(spec.override or {}).get(slot, {}), slot: v.value}
                out.append(Case(cls, spec, f"{slot}={v.label}", args, v))
        for label, args, v in spec.extra or ():
            out.append(Case(cls, spec, label, args, v))
    return out


# ---------------------------------------------------------------------------------------------------- the twins
# The full grid runs on the reference pool. The twins (FastBlockPool and, when that is the compiled pool,
# PyFastBlockPool) run a reduced grid: every method's good call and hand-written extras, and per method, slot
# and verdict (refused or accepted) the first value of each kind (:func:`kind`), so every kind of bad value
# still reaches every argument of every method, and the same cases run every time. What holds the twins to the
# reference everywhere else: the equivalence property tests (tests/test_perf.py: random operation sequences,
# odd and bad arguments among them, give the same results, errors, messages, state and events;
# tests/test_pool_stateful.py: the state machine, illegal calls included, on each pool class).
REFERENCE, TWINS = POOL_CLASSES[0], POOL_CLASSES[1:]


def _block_state(pool: BlockPool, b: int) -> tuple | str:
    """What a pool's code can tell about block ``b``: out of range, or its status, size class, refcount,
    reusability and whether it heads its span."""
    if b >= pool.num_blocks:
        return "beyond"
    m = pool.meta
    return (int(m.status[b]), int(m.size_class[b]), min(int(m.refcount[b]), 2), int(m.reusable[b]),
            b % m.span(b) == 0)


def family(x: Any) -> str:
    """The type a slot takes or not: numpy's scalars count as Python's, lists as tuples and ranges."""
    if x is None or isinstance(x, (bool, np.bool_)):
        return "None" if x is None else "bool"
    for name, types in (("int", (int, np.integer)), ("float", (float, np.floating)), ("str", str),
                        ("bytes", bytes), ("list", (list, tuple, range))):
        if isinstance(x, types):
            return name
    return "class" if isinstance(x, type) else type(x).__name__


def kind(x: Any, w: World, takes: frozenset[str], inner: frozenset[str] = frozenset()) -> tuple:
    """The category of value ``x`` in a slot that takes the types ``takes`` (its elements: ``inner``), as far
    as the fast paths' tests tell values apart (exact type, truth, zero, sign, range, state). None is one
    category; True and False are two; a float where the slot takes none is one if zero and one if not; any other
    type the slot does not take (a wrong type) is one category if true and one if false. A value of a type the
    slot takes is told apart further: an int by its type (Python's, numpy's), sign, past int32, past int64, or
    else (a block id) its block's state in either pool; a float as NaN, infinite, negative, zero or positive; a
    string by whether it is empty; bytes by length; an
    object of the world by which one it is; a list, tuple or range by its length (empty, one, or below and
    from :data:`kvlab.fast.pool.BATCH_MIN`: the fast pools' batch path), whether it repeats, and its elements'
    categories; an array or tensor by dtype, dimensions and device; a block view by its block's state."""
    f = family(x)
    if f == "None":
        return (f,)
    if f == "bool":
        return (f, bool(x))
    if f == "float" and f not in takes:
        return (f, x == 0)
    if f not in takes:
        try:
            truth: bool | None = bool(x)
        except (TypeError, ValueError, RuntimeError):  # an array or tensor of many elements has no truth
            truth = None
        return ("wrong type", truth)
    if f == "int":
        i = int(x)
        return (f, type(x).__name__, "negative" if i < 0 else ">= 2**63" if i >= BIG else ">= 2**31" if i >= 2**31
                else (_block_state(w.P, i), _block_state(w.Q, i)))
    if f == "float":
        return (f, "nan" if x != x else "infinite" if abs(x) == INF else "negative" if x < 0 else "zero" if x == 0
                else "positive")
    if f in ("str", "bytes"):
        return (f, len(x) if f == "bytes" else x == "")
    if f == "list":
        n = len(x)
        size = "empty" if n == 0 else "one" if n == 1 else "short" if n < BATCH_MIN else "batch"
        repeats = len({repr(e) for e in x}) < n
        return (type(x).__name__, size, repeats, tuple(dict.fromkeys(kind(e, w, inner, inner) for e in x)))
    if isinstance(x, np.ndarray):
        return (f, x.dtype.str, x.ndim)
    if isinstance(x, torch.Tensor):
        return (f, str(x.dtype), x.dim(), x.device.type)
    if isinstance(x, KVBlock):
        return (f, kind(x.block_id, w, frozenset({"int"})))
    named = {id(v): k for k, v in vars(w).items() if not isinstance(v, (dict, list, tuple))}
    return (f, named.get(id(x)))


def categories() -> dict[tuple, list[str]]:
    """``(method, slot, accepted, category) -> labels``: each slot's values by category (:func:`kind`, read off
    a world of the reference pool), in the slot's order; a slot takes the types of its good value and of the
    values it accepts."""
    w = World(REFERENCE)
    out: dict[tuple, list[str]] = {}

    def category(v: V, takes: frozenset[str], inner: frozenset[str]) -> tuple:
        try:
            return kind(resolve(v.value, w), w, takes, inner)
        except Exception as e:  # noqa: BLE001 - a value this world cannot build: tried, a category of its own
            return ("unresolved", v.label, type(e).__name__)

    for spec in SPECS:
        for slot, values in spec.slots.items():
            legit = []
            for x in [spec.good.get(slot), *(v.value for v in values if v.ok)]:
                with contextlib.suppress(Exception):
                    legit.append(resolve(x, w))
            takes = frozenset(map(family, legit))
            inner = frozenset(family(e) for x in legit if family(x) == "list" for e in x)
            for v in values:
                out.setdefault((spec.name, slot, v.ok, category(v, takes, inner)), []).append(v.label)
    return out


def twin_values() -> set[tuple[str, str, str]]:
    """``(method, slot, label)`` of the values the twins try: the first of each category."""
    return {(name, slot, labels[0]) for (name, slot, _, _), labels in categories().items()}


TWIN_VALUES = twin_values()
TWINS_FULL = os.environ.get("KVLAB_LONG") == "1"  # the long profile (conftest.py): the full grid on the twins too


def _twin_value(spec: Spec, slot: str, v: V) -> bool:
    return (spec.name, slot, v.label) in TWIN_VALUES


CASES = cases_of(REFERENCE) + [c for cls in TWINS for c in cases_of(cls, None if TWINS_FULL else _twin_value)]
_dups = [i for i, n in Counter(c.id for c in CASES).items() if n > 1]
assert not _dups, f"case ids must be unique: {_dups[:5]}"

# Cases that fail because of code outside the modules this grid's author may change, as ``spec[label]``
# (both pool classes) or ``Class/spec[label]``; each one a bug to fix there, after which the xfail turns red.
KNOWN_BUGS: dict[str, str] = {}  # case id -> why it fails; each entry is a strict xfail until fixed


def _needles(w: World, v: V) -> list[str]:
    if v.needle:
        return list(v.needle)
    x = resolve(v.value if v.at is VALUE else v.at, w)
    if isinstance(x, Sequence):
        return [f"sequence {x.seq_id}", repr(x)]
    if isinstance(x, Ticket):
        return [f"ticket {x.id}"]
    if isinstance(x, KVBlock):
        return [f"block {x.block_id}"]
    if isinstance(x, (str, bytes)):
        return [repr(x)]  # quoted: a bare "1" would be found in any message with a 1 in it
    return [repr(x), str(x)]


def names(message: str, needle: str) -> bool:
    """Whether ``message`` contains ``needle``; a word or number must stand alone (``7`` is not in ``0..17``)."""
    if re.fullmatch(r"-?\w+(\.\w+)?", needle):
        return re.search(rf"(?<![\w.]){re.escape(needle)}(?!\w|\.\d)", message) is not None
    return needle in message


_WORLDS: dict[type, World] = {}


def world(cls: type[BlockPool]) -> World:
    """The pristine world of ``cls``, built again only after a call changed the last one."""
    w = _WORLDS.pop(cls, None)
    return w if w is not None else World(cls)


def run_case(case: Case) -> str:
    """Make the call and check the rules; returns "accepted" or "rejected" (an AssertionError otherwise)."""
    w = world(case.cls)
    args = {k: resolve(v, w) for k, v in {**case.spec.good, **case.args}.items()}
    before = observe(w)
    try:
        case.spec.call(w, args)
    except KVLabError as e:
        if case.expect.ok:
            raise AssertionError(f"{case.id}: a legitimate value was refused: {type(e).__name__}: {e}") from e
        wanted = _needles(w, case.expect)
        assert any(names(str(e), n) for n in wanted), \
            f"{case.id}: the message {str(e)!r} names none of {wanted}"
        assert_unchanged(before, observe(w))
        _WORLDS[case.cls] = w  # proven unchanged: the next case may use it
        return "rejected"
    except Exception as e:  # noqa: BLE001 - any other error is the failure under test
        raise AssertionError(f"{case.id}: untyped error {type(e).__name__}: {e}") from e
    if not case.expect.ok:
        raise AssertionError(f"{case.id}: a bad value was accepted")
    w.check()
    if case.spec.reader:
        assert_unchanged(before, observe(w))
        _WORLDS[case.cls] = w
    return "accepted"


def _known(case: Case) -> str | None:
    return KNOWN_BUGS.get(case.id) or KNOWN_BUGS.get(case.id.split("/", 1)[1])


def _param(case: Case):
    reason = _known(case)
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case: Case) -> None:
    run_case(case)


# The classes whose every public method must have grid cases (FastBlockPool: the pool's own names).
PUBLIC_CLASSES = (BlockPool, FastBlockPool, KVBlock, TextbookPool, ReferenceManager, SequenceManager, Sequence,
                  PrefixCache, DynamicAllocator, FragmentationDetector, DefragmentationStrategy, Preallocator)


def test_every_public_method_is_in_the_grid() -> None:
    covered = {s.name.split("[")[0].split("@")[0] for s in SPECS}
    missing = []
    for cls in PUBLIC_CLASSES:
        owner = "BlockPool" if issubclass(cls, BlockPool) else cls.__name__
        if f"{owner}()" not in covered and cls not in (FastBlockPool, Sequence):
            missing.append(f"{owner}()")
        for name, member in inspect.getmembers(cls):
            if not name.startswith("_") and callable(member) and f"{owner}.{name}" not in covered:
                missing.append(f"{owner}.{name}")
    assert not missing, f"public methods without grid cases: {sorted(set(missing))}"


def test_the_grid_is_large_and_two_sided() -> None:
    full = [c for c in CASES if c.cls is REFERENCE]
    counts = Counter("ok" if c.expect.ok else "bad" for c in full)
    assert len(full) >= 3000 and counts["ok"] >= 300 and counts["bad"] >= 2000, counts


def test_the_twins_try_every_slot_and_category() -> None:
    """Each twin tries every method's every slot both ways (a bad value, a legitimate one), one value of each
    category the reference tries there and fewer cases in all; the choice is the same at every import."""
    def tried(cls: type) -> tuple[set, int]:
        cases = [c for c in CASES if c.cls is cls]
        return {(c.spec.name, c.label.split("=")[0], c.expect.ok) for c in cases}, len(cases)

    cats = categories()
    assert {(name, slot, labels[0]) for (name, slot, _, _), labels in cats.items()} == TWIN_VALUES
    full, n_full = tried(REFERENCE)
    for cls in TWINS:
        got, n = tried(cls)
        assert got == full and (n == n_full if TWINS_FULL else n < 0.8 * n_full), (cls.__name__, n, n_full)
        labels = {(c.spec.name, c.label) for c in CASES if c.cls is cls}
        assert all((name, f"{slot}={first}") in labels for (name, slot, _, _), (first, *_) in cats.items())


# ---------------------------------------------------------------------------------------------------- counts
def summary() -> dict[str, Counter]:
    """Run every case outside pytest: per pool class, calls tried, accepted, rejected and known bugs."""
    out: dict[str, Counter] = {}
    for case in CASES:
        c = out.setdefault(case.cls.__name__, Counter())
        c["tried"] += 1
        try:
            c[run_case(case)] += 1
        except AssertionError:
            if not _known(case):
                raise
            c["known bugs"] += 1
            _WORLDS.pop(case.cls, None)
    return out


if __name__ == "__main__":
    import time
    t0 = time.perf_counter()
    table = summary()
    total = sum(table.values(), Counter())
    print(f"{'pool class':<16}{'tried':>8}{'accepted':>10}{'rejected':>10}{'known bugs':>12}")
    for name, c in [*table.items(), ("total", total)]:
        print(f"{name:<16}{c['tried']:>8}{c['accepted']:>10}{c['rejected']:>10}{c['known bugs']:>12}")
    print(f"{len(SPECS)} methods, {time.perf_counter() - t0:.1f} s")
