"""Binary frames: the pool's state packed for a browser (text §2.2.2 block states, §2.2.4 fragmentation).

A frame is what a widget draws: one byte of state per base block, one byte of refcount, one byte holding the size
class and a *flash* code (what happened to the block since the previous frame), then a few statistics and a short
JSON tail with the evictions and migrations of that interval. 65,536 blocks make ~196 KB, cheap enough to send 30
times a second over the kernel's websocket as one binary message.

Layout (little endian)::

    header  magic "KVF1", seq u32, num_blocks u32, block_size u32, step f64,
            utilisation f32, external f32, internal_waste f32, scatter f32, flags u32, tail_len u32
    body    state u8[n] | refcount u8[n] (saturating at 255) | meta u8[n] = size_class << 3 | flash
    details (flags & 1, small pools only) tokens u16[n] | owner i32[n] | last_access f64[n]
    tail    UTF-8 JSON {"evictions": [...], "evictions_total": k, "moves": [[src, dst], ...],
                        "run": {"step": s, "steps": total or null}}

``step`` in the header is the pool's clock (it ticks once per pool operation); ``run`` in the tail is the step of
the workload driving the pool, the count the cells print ("step 507 of 600"), present when a live run or
:func:`~kvlab.viz.record` built the frame. Each eviction carries ``at``, the workload step it happened in (or
null), next to ``step``, the pool clock; an infinite score (OPT's "never used again") is the string
``"Infinity"``/``"-Infinity"``, since JSON has no infinities.

The state byte distinguishes *cached* blocks (ALLOCATED with refcount 0: reusable, evictable) from referenced
ones, the distinction the text's ``evict_block`` needed and missed. Flashes are collected from the pool's event
stream between two frames, so a frame sent after many unsent steps still shows every block that changed.
"""
from __future__ import annotations

import json
import math
import struct
from itertools import count
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlab.core import events as ev
from kvlab.core.block import ALLOCATED, STATE_NAMES as POOL_STATES
from kvlab.core.errors import ConfigError
from kvlab.memory.fragmentation import unusable_free_percent
from kvlab.core.pool import BlockPool

CACHED = len(POOL_STATES)  # a frame's fifth state: ALLOCATED with refcount 0
STATE_NAMES = (*POOL_STATES, "CACHED")
FLASH_NONE, FLASH_ALLOCATED, FLASH_FREED, FLASH_EVICTED, FLASH_MOVED_IN, FLASH_MOVED_OUT = range(6)
FLASH_NAMES = ("", "allocated", "freed", "evicted", "moved in", "moved out")

HEADER = struct.Struct("<4sIIIdffffII")
MAGIC = b"KVF1"
FLAG_DETAILS = 1
DETAILS_LIMIT = 4096  # pools up to this size carry per-block tokens/owner/last access for hover in replays
MAX_EVICTIONS = 8  # per frame: the latest ones, as many as a view lists; ``evictions_total`` counts all
MAX_MOVES = 256
_SEQ = count()  # frame numbers are unique in the process, so no two frames are equal bytes (a synced trait
#                 set to equal bytes sends nothing, and the browser would count one frame less)


@dataclass(frozen=True)
class Frame:
    """A decoded frame (numpy views into the bytes; see the module docstring for the layout)."""

    seq: int
    num_blocks: int
    block_size: int
    step: float
    utilisation: float
    external: float
    internal_waste: float
    scatter: float
    state: np.ndarray
    refcount: np.ndarray
    meta: np.ndarray  # size_class << 3 | flash
    tokens: np.ndarray | None
    owner: np.ndarray | None
    last_access: np.ndarray | None
    tail: dict[str, Any]

    # Derived when read, not when decoded: a view decodes every frame it sends (for its series and evictions),
    # and two fresh 65,536-element arrays per live frame would cost more than the rest of decoding.
    @property
    def size_class(self) -> np.ndarray:
        return self.meta >> 3

    @property
    def flash(self) -> np.ndarray:
        return self.meta & 7

    @property
    def evictions(self) -> list[dict[str, Any]]:
        return self.tail.get("evictions", [])

    @property
    def moves(self) -> list[list[int]]:
        return self.tail.get("moves", [])

    @property
    def when(self) -> str:
        """Where the frame stands, in the words the views use: "step 507 of 600" (the workload's steps), or
        "the pool after 67 operations" for a frame built outside a run."""
        run = self.tail.get("run")
        if run:
            return f"step {run['step']} of {run['steps']}" if run.get("steps") else f"step {run['step']}"
        return f"the pool after {self.step:g} operations"


def frame_states(status: np.ndarray, refs: np.ndarray) -> np.ndarray:
    """State codes per base block: the pool's status with cached blocks (ALLOCATED, refcount 0) as CACHED."""
    state = status.copy()
    state[(status == ALLOCATED) & (refs == 0)] = CACHED
    return state


def _score(s: float) -> float | str:
    return s if math.isfinite(s) else ("Infinity" if s > 0 else "-Infinity")


class FrameBuilder:
    """Builds frames of one pool. While open it listens to the pool's events to collect flashes, evictions and
    moves; each :meth:`build` consumes what was collected since the previous one. Call :meth:`close` (or use it
    as a context manager) to unsubscribe: a listening pool builds an event object for every mutation.

    Whoever drives the workload sets :attr:`step` (the step being taken, then the last one taken) and
    :attr:`steps` (how many the workload will take, None if unknown); frames then say "step 507 of 600"."""

    def __init__(self, pool: BlockPool, *, details_limit: int = DETAILS_LIMIT) -> None:
        self.pool = pool
        self.details = pool.num_blocks <= details_limit
        n = pool.num_blocks
        self._flash = np.zeros(n, np.uint8)
        self._ids = np.arange(n, dtype=np.int64)
        # The body of every frame is written into these buffers, then copied once into the frame's bytes: no
        # temporary arrays and few passes over memory, since inside a running workload the pool's arrays are out
        # of the CPU cache and each pass over 65,536 blocks costs several times what it does warm.
        self._body = np.empty(3 * n, np.uint8)
        self._state, self._refs8, self._meta = self._body[:n], self._body[n:2 * n], self._body[2 * n:]
        self._cached, self._allocated = np.empty(n, np.uint8), np.empty(n, np.uint8)
        # Every block holds at most block_size tokens per base block it spans: an int32 sum is exact (and skips
        # a cast per element) unless the pool is huge.
        self._tokens_sum = np.int32 if n * pool.block_size < 2**31 else np.int64
        self._evictions: list[dict[str, Any]] = []
        self._evictions_total = 0
        self._moves: list[list[int]] = []
        self.step: int | None = None
        self.steps: int | None = None
        self._unsubscribe = pool.events.subscribe(self._on_event)

    def __enter__(self) -> "FrameBuilder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._unsubscribe()

    def _mark(self, ids: tuple[int, ...], code: int) -> None:
        if self.pool.max_order:  # a block of class k covers 2**k base blocks
            for b in ids:
                self._flash[b:b + self.pool.span(b)] = code
        else:
            self._flash[list(ids)] = code

    def _on_event(self, e: ev.Event) -> None:
        if isinstance(e, ev.Allocated):
            self._mark(e.block_ids, FLASH_ALLOCATED)
        elif isinstance(e, ev.Freed) or (isinstance(e, ev.StatusChanged) and e.new == "FREE"):
            self._mark(e.block_ids, FLASH_FREED)
        elif isinstance(e, ev.Evicted):
            self._mark((e.block_id,), FLASH_EVICTED)
            self._evictions_total += 1
            self._evictions.append({"step": e.step, "at": self.step, "victim": e.block_id, "policy": e.policy,
                                    "reason": e.reason, "candidates": [[b, _score(s)] for b, s in e.candidates]})
            del self._evictions[:-MAX_EVICTIONS]
        elif isinstance(e, ev.Migrated):
            self._mark(e.src, FLASH_MOVED_OUT)
            self._mark(e.dst, FLASH_MOVED_IN)
            self._moves.extend([s, d] for s, d in zip(e.src, e.dst))
            del self._moves[:-MAX_MOVES]

    def build(self) -> bytes:
        """One frame of the pool as it is now, with the flashes collected since the previous frame."""
        p, n = self.pool, self.pool.num_blocks
        state, refs8, meta, cached = self._state, self._refs8, self._meta, self._cached
        with p.lock:  # the same atomic read as pool.snapshot(), without copying the arrays we do not send
            status, refs, order = p.arrays.status, p.arrays.refcount, p.arrays.size_class
            head = None
            if p.max_order:  # per-block fields live at a block's first base block: spread them over its span
                head = self._ids & ~((1 << order.astype(np.int64)) - 1)
                refs = refs[head]
            np.minimum(refs, 255, out=refs8, casting="unsafe")
            # frame_states in place, in uint8 arithmetic: a cached block (ALLOCATED, no reference) gets CACHED
            np.equal(refs8, 0, out=cached, casting="unsafe")
            np.bitwise_and(cached, np.equal(status, ALLOCATED, out=self._allocated, casting="unsafe"), out=cached)
            np.multiply(cached, CACHED - ALLOCATED, out=cached)
            np.add(status, cached, out=state)
            np.left_shift(order, 3, out=meta)
            np.bitwise_or(meta, self._flash, out=meta)
            runs = p.free_runs()
            free = int(runs.sum())  # the runs cover every FREE base block
            tokens = int(p.arrays.tokens.sum(dtype=self._tokens_sum))
            step = float(p.clock.now())
            external = unusable_free_percent(p) / 100
            details = b""
            if self.details:
                details = b"".join((a if head is None else a[head]).astype(t).tobytes() for a, t in (
                    (p.arrays.tokens, "<u2"), (p.arrays.owner, "<i4"), (p.arrays.last_access, "<f8")))
            return self._finish(n, free, runs, tokens, step, external, details)  # flashes reset under the lock

    def _finish(self, n: int, free: int, runs: np.ndarray, tokens: int, step: float, external: float,
                details: bytes) -> bytes:
        """Header, body and tail as one bytes object (the body's one copy); consumes what was collected."""
        n_used = n - free
        scatter = 1 - int(runs.max()) / free if free else 0.0
        waste = 1 - tokens / (n_used * self.pool.block_size) if n_used else 0.0
        tail: dict[str, Any] = {}
        if self.step is not None:
            tail["run"] = {"step": self.step, "steps": self.steps}
        if self._evictions or self._evictions_total:
            tail["evictions"], tail["evictions_total"] = self._evictions, self._evictions_total
        if self._moves:
            tail["moves"] = self._moves
        tail_bytes = json.dumps(tail, separators=(",", ":")).encode() if tail else b""
        head = HEADER.pack(MAGIC, next(_SEQ) & 0xFFFFFFFF, n, self.pool.block_size, step, n_used / n, external,
                           waste, scatter, FLAG_DETAILS if self.details else 0, len(tail_bytes))
        self._flash.fill(0)
        self._evictions, self._moves = [], []
        return b"".join((head, self._body.data, details, tail_bytes))


def build_frame(pool: BlockPool) -> bytes:
    """A single frame of ``pool`` with no flashes (for a first paint or a static figure)."""
    with FrameBuilder(pool) as b:
        return b.build()


def decode_frame(data: bytes | bytearray | memoryview) -> Frame:
    """Parse a frame; raises :class:`ConfigError` naming what is wrong if ``data`` is not one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ConfigError(f"not a kvlab frame: {data!r:.80} is no bytes")
    buf = memoryview(data).cast("B")
    if len(buf) < HEADER.size or bytes(buf[:4]) != MAGIC:
        raise ConfigError(f"not a kvlab frame: {len(buf)} bytes starting {bytes(buf[:4])!r}, expected {MAGIC!r}")
    magic, seq, n, bs, step, util, ext, waste, scatter, flags, tail_len = HEADER.unpack_from(buf)
    details = flags & FLAG_DETAILS
    want = HEADER.size + 3 * n + (14 * n if details else 0) + tail_len
    if len(buf) != want:
        raise ConfigError(f"frame {seq} of {n} blocks should be {want} bytes, got {len(buf)}")
    o = HEADER.size
    arr = np.frombuffer(buf, np.uint8)
    state, refs, meta = arr[o:o + n], arr[o + n:o + 2 * n], arr[o + 2 * n:o + 3 * n]
    o += 3 * n
    tokens = owner = last = None
    if details:
        tokens = np.frombuffer(buf, "<u2", n, o)
        owner = np.frombuffer(buf, "<i4", n, o + 2 * n)
        last = np.frombuffer(buf, "<f8", n, o + 6 * n)
        o += 14 * n
    tail = json.loads(bytes(buf[o:o + tail_len])) if tail_len else {}
    return Frame(seq, n, bs, step, util, ext, waste, scatter, state, refs, meta, tokens, owner, last, tail)
