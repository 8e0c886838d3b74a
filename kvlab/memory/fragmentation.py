"""Measuring fragmentation and undoing it (text §2.2.4, "内存碎片整理").

Three different wastes, kept apart because they have different cures:

* **unusable free memory** (``fragmentation_percent``, the text's key, from :func:`unusable_free_percent`):
  the share of FREE memory that cannot form a block of the largest size class. This is what hurts a pool with
  several size classes. On a uniform pool every FREE block serves every request, so it is 0 whatever the layout.
* **external fragmentation** (``external_fragmentation``, a fraction): ``1 - largest free run / total free``,
  where a run is a stretch of consecutive FREE base blocks. It measures address contiguity: what an allocator that
  needs one contiguous region (the world before paging, or a swap-out in one copy) would suffer. A uniform paged
  pool can read 0.9 here and still serve every request, because a block table maps any block anywhere; it is a
  layout measure there, not a capacity loss.
* **internal waste** (``internal_waste``): token slots of ALLOCATED blocks not holding a token, over all their
  slots — the half-empty last block of each sequence. Compaction cannot cure it; only a smaller block size can.

``scatter`` = (highest used block id + 1) / used blocks: 1.0 when the used blocks are packed at the bottom.

:class:`DefragmentationStrategy` first merges FREE buddies, then compacts: it moves the highest-addressed ALLOCATED
blocks into the lowest FREE holes of the same class with one batched :meth:`BlockPool.migrate`, whose relocation
hooks let every owner rewrite its block table. PENDING and EVICTING blocks are never moved (their data is in
flight). ``max_moves`` bounds the work of one call, so compaction can run a little per engine step.

What the text's ``_reallocate_active_blocks`` gets wrong: it returns after the first move (one block per call);
the copy leaves the target exactly the source's size; with FREE blocks as the text builds them (no data) every
migration is refused; it writes the target's fields directly, bypassing the pool's free lists and state machine;
no block table learns the new location; the source stays referenced, so its release fails and the data is held
twice; and the target is left at refcount 0, immediately evictable. Compaction moves data into blocks of the
*same* size, toward low addresses, through the pool, and tells the owners.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlab.core import events as ev
from kvlab.core.block import ALLOCATED, FREE
from kvlab.core.errors import ConfigError
from kvlab.core.checks import check_count, check_flag, check_real
from kvlab.core.pool import BlockPool
from kvlab.core.interrupts import atomic



def unusable_free_percent(pool: BlockPool) -> int:
    """Unusable free memory in percent: the share of FREE memory that the largest request cannot use. A request
    asks for one block of at most the largest class, so only free space that forms whole aligned blocks of that
    class counts as usable. With one size class every free block serves every request: 0 by construction,
    whatever the layout. (The text's ``calculate_fragmentation``.)"""
    with pool.lock:
        total = pool.num_free_blocks
        if not total or not pool.max_order:  # one class: every free block is usable, no scan needed
            return 0
        top = 1 << pool.max_order
        aligned = pool.arrays.status[:pool.num_blocks // top * top].reshape(-1, top)
        usable = top * int((aligned == FREE).all(axis=1).sum())
        return int(round(100 * (1 - usable / total)))


def memory_usage(pool: BlockPool) -> dict[str, int]:
    """Bytes: ``total``, ``used`` (PENDING/ALLOCATED/EVICTING), ``free``, ``cached`` (inside ``used``) and
    ``token_bytes`` (bytes holding real tokens)."""
    with pool.lock:
        c, size = pool.status_counts(), pool.bytes_per_block
        cached = sum(1 << pool.fields.size_class[b] for b, _ in pool.policy.order())
        return {"total": pool.num_blocks * size, "used": (pool.num_blocks - c["FREE"]) * size,
                "free": c["FREE"] * size, "cached": cached * size,
                "token_bytes": int(pool.arrays.tokens.sum()) * pool.spec.bytes_per_token}


def _check_pool(pool: object, who: str) -> BlockPool:
    if not isinstance(pool, BlockPool):
        raise ConfigError(f"a {who} needs a BlockPool, got {pool!r}")
    return pool


class FragmentationDetector:
    """Reports the fragmentation of ``pool``; ``should_defragment`` compares the text's ``fragmentation_percent``
    (unusable free memory) or, on a uniform pool where that is always 0, the external fragmentation in percent,
    with ``threshold``."""

    def __init__(self, pool: BlockPool, threshold: float = 20) -> None:
        self.pool = _check_pool(pool, "FragmentationDetector")
        self.threshold = check_real(threshold, "threshold", lo=0, finite=False, unit=" of percent")

    def external_fragmentation(self) -> float:
        """``1 - largest free run / total free`` (0.0 when nothing or everything in one run is free)."""
        runs = self.pool.free_runs()
        return 0.0 if not runs.size else 1.0 - int(runs.max()) / int(runs.sum())

    def trigger_percent(self) -> float:
        """The number ``should_defragment`` compares with the threshold (see the class docstring)."""
        if self.pool.max_order:
            return float(unusable_free_percent(self.pool))
        return 100.0 * self.external_fragmentation()

    def detect_fragmentation(self) -> dict[str, Any]:
        """The text's keys ``fragmentation_percent`` (unusable free memory, %), ``should_defragment``,
        ``memory_info`` and ``free_blocks`` (``{block size in tokens: FREE blocks of that class}``), plus
        ``external_fragmentation`` (fraction), ``largest_free_run`` and ``free_run_histogram``
        (``{run length in base blocks: count}``), ``internal_waste`` (fraction), ``scatter`` and ``trigger_percent``."""
        pool = self.pool
        with pool.lock:
            runs = pool.free_runs()
            st = pool.arrays.status
            heads = _heads(pool)
            alloc = heads[st[heads] == ALLOCATED]
            slots = int((pool.block_size << pool.arrays.size_class[alloc].astype(np.int64)).sum())
            used = np.flatnonzero(st != FREE)
            lengths, counts = np.unique(runs, return_counts=True)
            trigger, frag = self.trigger_percent(), unusable_free_percent(pool)
            return {
                "fragmentation_percent": frag,
                "should_defragment": trigger > self.threshold,
                "memory_info": {**memory_usage(pool), "fragmentation": frag},
                "free_blocks": {size: pool.free_lists.count(o) for o, size in enumerate(pool.block_sizes)},
                "external_fragmentation": self.external_fragmentation(),
                "largest_free_run": int(runs.max()) if runs.size else 0,
                "free_run_histogram": dict(zip(lengths.tolist(), counts.tolist())),
                "internal_waste": 1.0 - int(pool.arrays.tokens[alloc].sum()) / slots if slots else 0.0,
                "scatter": (int(used[-1]) + 1) / used.size if used.size else 1.0,
                "trigger_percent": trigger,
            }


def _heads(pool: BlockPool) -> np.ndarray:
    """Ids of every block (the first base block of each), in address order."""
    units = np.arange(pool.num_blocks)
    if not pool.max_order:
        return units
    return units[(units & (np.left_shift(1, pool.arrays.size_class.astype(np.int64)) - 1)) == 0]


@dataclass(frozen=True, slots=True)
class DefragReport:
    """What one :meth:`DefragmentationStrategy.defragment` call did. Truthy when it changed the layout."""

    ran: bool
    merges: int
    moves: tuple[tuple[int, int], ...]
    bytes_moved: int
    fragmentation_before: dict[str, float]
    fragmentation_after: dict[str, float]
    seconds: float

    def __bool__(self) -> bool:
        return bool(self.merges or self.moves)


@dataclass(slots=True)
class Defragmented(ev.Event):
    """A defragmentation pass merged ``merges`` buddy pairs and moved ``moves`` blocks (``bytes_moved`` bytes)."""
    merges: int
    moves: int
    bytes_moved: int


@atomic()
class DefragmentationStrategy:
    """Merge free buddies, then compact ``pool`` (see the module docstring), then sort its free lists so the
    free region is handed out as runs of consecutive ids again.

    Args:
        minimum_fragmentation: percent; below it (by :meth:`FragmentationDetector.trigger_percent`) a call does
            nothing unless ``force=True``.
        max_moves: default cap on blocks moved per call (None: no cap).
    """

    def __init__(self, pool: BlockPool, minimum_fragmentation: float = 15, max_moves: int | None = None) -> None:
        self.pool = _check_pool(pool, "DefragmentationStrategy")
        self.minimum_fragmentation = check_real(minimum_fragmentation, "minimum_fragmentation", lo=0, finite=False,
                                                unit=" of percent")
        self.max_moves = None if max_moves is None else check_count(max_moves, "max_moves")  # None: no cap
        self.detector = FragmentationDetector(pool, threshold=minimum_fragmentation)

    def _measure(self) -> dict[str, float]:
        d = self.detector
        return {"fragmentation_percent": float(unusable_free_percent(self.pool)),
                "external_fragmentation": d.external_fragmentation()}

    def defragment(self, *, force: bool = False, max_moves: int | None = None) -> DefragReport:
        """One pass: merge, then move up to ``max_moves`` blocks (default ``self.max_moves``) down into holes."""
        pool = self.pool
        check_flag(force, "force")
        cap = self.max_moves if max_moves is None else check_count(max_moves, "max_moves")  # a negative cap would
        # slice from the end
        with pool.lock:
            t0 = time.perf_counter()
            before = self._measure()
            if not force and self.detector.trigger_percent() < self.minimum_fragmentation:
                return DefragReport(False, 0, (), 0, before, before, time.perf_counter() - t0)
            merges = pool.merge_free_buddies()
            src, dst = self._plan_compaction(cap)
            pool.migrate(src, dst, reason="compaction")
            if src:
                merges += pool.merge_free_buddies()  # the vacated sources may pair up with free buddies
            pool.sort_free_lists()  # the free region now hands out runs again
            moved = sum(pool.bytes_per_block << pool.fields.size_class[d] for d in dst)
            report = DefragReport(True, merges, tuple(zip(src, dst)), moved, before, self._measure(),
                                  time.perf_counter() - t0)
            if pool.events:
                pool.events.publish(Defragmented(pool.clock.now(), merges, len(src), moved))
            return report

    def _plan_compaction(self, cap: int | None) -> tuple[list[int], list[int]]:
        """Pairs (highest ALLOCATED block, lowest FREE block of its class below it), highest movers first.
        A larger FREE block below a mover is split down to its class; holes left by movers lie above every
        remaining mover, so one batched migration suffices."""
        pool = self.pool
        limit = np.iinfo(np.int64).max if cap is None else cap
        st = pool.arrays.status
        if not pool.max_order:  # uniform: pair the lowest holes with the highest movers while holes lie below
            holes, movers = np.flatnonzero(st == FREE), np.flatnonzero(st == ALLOCATED)[::-1]
            k = min(holes.size, movers.size, limit)
            k = int(np.count_nonzero(holes[:k] < movers[:k]))  # monotone: holes rise while movers fall
            return movers[:k].tolist(), holes[:k].tolist()
        heads = _heads(pool)
        movers = heads[st[heads] == ALLOCATED][::-1].tolist()
        # Per class, ascending; consumed from the front.
        free = [sorted(pool.free_ids(k)) for k in range(pool.max_order + 1)]
        src: list[int] = []
        dst: list[int] = []
        for m in movers:
            if len(src) >= limit:
                break
            k = pool.fields.size_class[m]
            below = [(free[o][0], o) for o in range(k, pool.max_order + 1) if free[o] and free[o][0] < m]
            if not below:
                continue
            b, o = min(below)
            free[o].pop(0)
            for _ in range(o - k):  # keep the low half, give the high half back as a hole of one class less
                bisect.insort(free[pool.fields.size_class[b] - 1], pool.split_block(b)[1])
            src.append(m)
            dst.append(b)
        return src, dst
