"""Binary frames: the pool's state packed for a browser (text §2.2.2 block states, §2.2.4 fragmentation).

A frame is what a widget draws: one byte of state per base block, one byte of refcount, one byte holding the size
class and a *flash* code (what happened to the block since the previous frame), then a few statistics and a short
JSON tail with the evictions and migrations of that interval. 65,536 blocks make ~196 KB, cheap enough to send 30
times a second over the kernel's websocket as one binary message.

**The wire format is written down once**, in the tables :data:`HEADER_FIELDS`, :data:`BODY` and :data:`DETAILS`
below (little endian): the header's :data:`HEADER` struct is derived from them, :func:`decode_frame` reads by them,
and :func:`layout_js` hands them to the browser as the constant ``KV_FRAME`` that ``kvDecode`` in
``widgets/common.js`` reads, so neither side keeps an offset of its own. A frame is the header, then the body
sections (``n`` values each, in order), then the details sections if ``flags & FLAG_DETAILS`` (pools of up to
:data:`DETAILS_LIMIT` blocks, for hover in replays), then the tail: UTF-8 JSON ``{"evictions": [...],
"evictions_total": k, "moves": [[src, dst], ...], "run": {"step": s, "steps": total or null}}``, each key left
out when it has nothing to say (a ChatView adds ``"chat"``).

A frame that shows block tables (a :class:`~kvlab.viz.BlockTableView`, a ChatView; written by
:class:`kvlab.viz.tables.BlockTables`) adds ``"tables": {"rows": [{"id": i, "label": "seq 3", "blocks": [b0, b1,
...], "hits": h, "copied": [p, ...], "more": m}, ...], "left_out": k}``: one row per live sequence, at most
:data:`~kvlab.viz.tables.MAX_ROWS` (``left_out`` counts the others). ``blocks[p]`` is the physical block of logical
block ``p`` (-1: swapped out to host memory), at most :data:`~kvlab.viz.tables.MAX_ROW_BLOCKS` of them (``more``
counts the rest); the first ``hits`` came from the prefix cache; ``copied`` lists the positions holding a copy
made on write. Who shares a block is the body's refcount.

``step`` in the header is the pool's clock (it ticks once per pool operation); ``run`` in the tail is the step of
the workload driving the pool, the count the cells print ("第 507 / 600 步"), present when a live run or
:func:`~kvlab.viz.record` built the frame. Each eviction carries ``at``, the workload step it happened in (or
null), next to ``step``, the pool clock; an infinite score (OPT's "never used again") is the string
``"Infinity"``/``"-Infinity"``, since JSON has no infinities.

The state byte distinguishes *cached* blocks (ALLOCATED with refcount 0: reusable, evictable) from referenced
ones, the distinction the text's ``evict_block`` needed and missed.

**Frames from events.** A :class:`FrameBuilder` reads every block's state, refcount and size class once, when it
attaches; from then on it keeps them up to date from the events the pool publishes, and collects from the same
events the flashes, evictions and moves of the interval, so a frame sent after many unsent steps still shows
every block that changed. Building a frame reads from the pool only what no event carries (see
:meth:`FrameBuilder.frame`).

**Encoded once.** :meth:`FrameBuilder.frame` returns a :class:`Frame`: the bytes to send together with the numbers
and arrays in them, so Python never decodes a frame it built. :func:`decode_frame` is for frames from elsewhere
(a recording, a file) and checks them.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import numpy as np

from kvlab.core import events as ev
from kvlab.core.block import ALLOCATED, FREE, STATE_NAMES as POOL_STATES
from kvlab.core.checks import show
from kvlab.core.errors import ConfigError
from kvlab.core.pool import BlockPool
from kvlab.memory.fragmentation import unusable_free_percent
from kvlab.viz.palette import bar_axis, shown_score

CACHED = len(POOL_STATES)  # a frame's fifth state: ALLOCATED with refcount 0
STATE_NAMES = (*POOL_STATES, "CACHED")
FLASH_NONE, FLASH_ALLOCATED, FLASH_FREED, FLASH_EVICTED, FLASH_MOVED_IN, FLASH_MOVED_OUT = range(6)
FLASH_NAMES = ("", "allocated", "freed", "evicted", "moved in", "moved out")
FLASH_BITS = 3  # the meta byte is size_class << FLASH_BITS | flash

# ---------------------------------------------------------------------------- the wire format, once
# Each entry: (name, struct code, what it holds). Python's Frame and the browser's decoded frame use these names.
HEADER_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("magic", "4s", 'b"KVF1"'),
    ("seq", "I", "the frame's number, unique in the process"),
    ("num_blocks", "I", "n, the base blocks"),
    ("block_size", "I", "tokens per base block"),
    ("step", "d", "the pool's clock"),
    ("blocks_held", "f", "share of base blocks not FREE (in use, cached or in flight)"),
    ("unusable_free", "f", "share of FREE memory the largest request cannot use"),
    ("internal_waste", "f", "share of the used blocks' token slots holding no token"),
    ("external_fragmentation", "f", "1 - largest run of FREE base blocks / FREE base blocks"),
    ("flags", "I", "FLAG_DETAILS when the details sections follow the body"),
    ("tail_len", "I", "bytes of the JSON tail"),
)
BODY: tuple[tuple[str, str, str], ...] = (  # after the header, n values each (one byte each)
    ("state", "B", "index into STATE_NAMES"),
    ("refcount", "B", "references, saturating at 255"),
    ("meta", "B", "size_class << FLASH_BITS | flash (index into FLASH_NAMES)"),
)
DETAILS: tuple[tuple[str, str, str], ...] = (  # after the body when flags & FLAG_DETAILS, n values each
    ("tokens", "H", "filled token slots"),
    ("owner", "i", "the owning sequence, -1 for none"),
    ("last_access", "d", "the pool clock of the block's last use"),
)
HEADER = struct.Struct("<" + "".join(code for _, code, _ in HEADER_FIELDS))
HEADER_OFFSETS = {name: struct.calcsize("<" + "".join(c for _, c, _ in HEADER_FIELDS[:i]))
                  for i, (name, _, _) in enumerate(HEADER_FIELDS)}
MAGIC = b"KVF1"
FLAG_DETAILS = 1
assert all(code == "B" for _, code, _ in BODY)  # the builder and kvDecode keep the body as bytes

DETAILS_LIMIT = 4096  # pools up to this size carry per-block tokens/owner/last access for hover in replays
MAX_EVICTIONS = 8  # per frame: the latest ones, as many as a view lists; ``evictions_total`` counts all
MAX_MOVES = 256
_SEQ = count()  # frame numbers are unique in the process, so no two frames are equal bytes (a synced trait
#                 set to equal bytes sends nothing, and the browser would count one frame less)
DATAVIEW = {  # struct code -> the DataView getter the browser reads it with
    "B": "Uint8", "H": "Uint16", "i": "Int32", "I": "Uint32", "f": "Float32", "d": "Float64"}


def layout_js() -> str:
    """The wire format as the JavaScript constant ``KV_FRAME`` that ``kvDecode`` (``widgets/common.js``) reads:
    each header field as ``[name, offset, DataView type]``, each section as ``[name, bytes per block, DataView
    type]``, and the names of the states and flashes. :func:`kvlab.viz.assets.script_source` puts it in every
    view's module."""
    data = {"magic": MAGIC.decode(), "headerSize": HEADER.size, "flagDetails": FLAG_DETAILS, "flashBits": FLASH_BITS,
            "header": [[name, HEADER_OFFSETS[name], DATAVIEW[code]] for name, code, _ in HEADER_FIELDS
                       if name != "magic"],
            "body": [[name, struct.calcsize(code), DATAVIEW[code]] for name, code, _ in BODY],
            "details": [[name, struct.calcsize(code), DATAVIEW[code]] for name, code, _ in DETAILS],
            "states": STATE_NAMES, "flashes": FLASH_NAMES}
    return f"const KV_FRAME = {json.dumps(data)};\n"


@dataclass(frozen=True)
class Frame:
    """One frame: ``data``, its bytes (what is sent and recorded), and what they hold, the arrays as numpy views
    into ``data``. :meth:`FrameBuilder.frame` makes one from what it packed, :func:`decode_frame` from bytes."""

    data: bytes
    seq: int
    num_blocks: int
    block_size: int
    step: float
    blocks_held: float
    unusable_free: float
    internal_waste: float
    external_fragmentation: float
    state: np.ndarray
    refcount: np.ndarray
    meta: np.ndarray  # size_class << FLASH_BITS | flash
    tokens: np.ndarray | None
    owner: np.ndarray | None
    last_access: np.ndarray | None
    tail: dict[str, Any]

    def __bytes__(self) -> bytes:
        return self.data

    # Derived when read: two fresh 65,536-element arrays per live frame would cost more than making the frame.
    @property
    def size_class(self) -> np.ndarray:
        return self.meta >> FLASH_BITS

    @property
    def flash(self) -> np.ndarray:
        return self.meta & ((1 << FLASH_BITS) - 1)

    @property
    def evictions(self) -> list[dict[str, Any]]:
        return self.tail.get("evictions", [])

    @property
    def moves(self) -> list[list[int]]:
        return self.tail.get("moves", [])

    @property
    def when(self) -> str:
        """Where the frame stands, in the words the views use: "第 507 / 600 步 (step)" (the workload's steps),
        or "池的 67 次操作之后 (after pool operations)" for a frame built outside a run."""
        run = self.tail.get("run")
        if run:
            return f"第 {run['step']} / {run['steps']} 步 (step)" if run.get("steps") else f"第 {run['step']} 步 (step)"
        return f"池的 {self.step:g} 次操作之后 (after pool operations)"


def _frame(data: bytes, header: dict[str, Any], tail: dict[str, Any]) -> Frame:
    """The :class:`Frame` of ``data``, whose header holds ``header``: each section a view where the layout puts
    it."""
    n, at = header["num_blocks"], HEADER.size
    arrays: dict[str, Any] = {name: None for name, _, _ in DETAILS}  # details stay None when absent
    for name, code, _ in BODY + (DETAILS if header["flags"] & FLAG_DETAILS else ()):
        arrays[name] = np.frombuffer(data, "<" + code, n, at)
        at += n * struct.calcsize(code)
    numbers = {k: v for k, v in header.items() if k not in ("magic", "flags", "tail_len")}
    return Frame(data=data, tail=tail, **numbers, **arrays)


def frame_states(status: np.ndarray, refs: np.ndarray) -> np.ndarray:
    """State codes per base block: the pool's status with cached blocks (ALLOCATED, refcount 0) as CACHED."""
    state = status.copy()
    state[(status == ALLOCATED) & (refs == 0)] = CACHED
    return state


def free_runs(state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the maximal runs of FREE base blocks of ``state`` (pool status or frame state) start, and their
    lengths, in address order."""
    free = np.zeros(len(state) + 2, bool)  # FREE flags between two non-free sentinels
    np.equal(state, FREE, out=free[1:-1])
    edges = np.flatnonzero(free[1:] != free[:-1])  # where runs start and end (10x faster than np.diff)
    return edges[::2], edges[1::2] - edges[::2]


def _score(s: float) -> float | str:
    return s if math.isfinite(s) else ("Infinity" if s > 0 else "-Infinity")


def _f32(x: float) -> float:
    """``x`` as the header carries it (a float32), so a built frame holds what a decoded one would."""
    return float(np.float32(x))


class FrameBuilder(ev.Listener):
    """Builds the frames of one pool from its events. It reads every block's state, refcount and size class once,
    when it attaches, then follows the pool's events; each :meth:`frame` consumes the flashes, evictions and moves
    collected since the previous one. Call :meth:`close` (or use it as a context manager) to unsubscribe: a
    listening pool builds an event object for every mutation; a frame made afterwards reads the pool afresh.

    Whoever drives the workload sets :attr:`step` (the step being taken, then the last one taken) and
    :attr:`steps` (how many the workload will take, None if unknown); frames then say "第 507 / 600 步 (step)".
    Each function in :attr:`tail_sources` is called for every frame, and the entries of the dict it returns join
    the tail (a BlockTableView adds its block tables to the frames of the run it follows this way)."""

    def __init__(self, pool: BlockPool, *, details_limit: int = DETAILS_LIMIT) -> None:
        self.pool = pool
        n = pool.num_blocks
        self.details = n <= details_limit
        # The body (state | refcount | meta, as BODY orders it) lives in one buffer that each frame copies once;
        # size classes and flashes are kept apart and packed into meta when a frame is made.
        self._body = np.zeros(len(BODY) * n, np.uint8)
        self._state, self._refs, self._meta = self._body[:n], self._body[n:2 * n], self._body[2 * n:]
        self._order = np.zeros(n, np.uint8)
        self._flash = np.zeros(n, np.uint8)
        # Every block holds at most block_size tokens per base block it spans: an int32 sum is exact (and skips
        # a cast per element) unless the pool is huge.
        self._tokens_sum = np.int32 if n * pool.block_size < 2**31 else np.int64
        self._evictions: list[dict[str, Any]] = []
        self._evictions_total = 0
        self._moves: list[list[int]] = []
        self.step: int | None = None
        self.steps: int | None = None
        self.resyncs = 0  # reads of the whole pool: 1 (attaching) unless events fell short (see frame)
        self.tail_sources: list[Callable[[], dict[str, Any]]] = []
        with pool.lock:  # subscribed and read in one hold of the lock: no event falls between the two
            super().__init__(pool.events)
            self.resync()

    def resync(self) -> None:
        """Read every block's state, refcount and size class from the pool (under its lock): when attaching, and
        when the events may have missed a change (see :meth:`frame`)."""
        a = self.pool.arrays
        self.resyncs += 1
        with self.pool.lock:
            self._order[:] = a.size_class
            refs = a.refcount[self._heads()] if self.pool.max_order else a.refcount
            np.minimum(refs, 255, out=self._refs, casting="unsafe")
            self._state[:] = frame_states(a.status, self._refs)

    def _heads(self) -> np.ndarray:
        """Each base block's block (its first base block): where the pool keeps the per-block fields."""
        return np.arange(self.pool.num_blocks) & ~((1 << self._order.astype(np.int64)) - 1)

    # ------------------------------------------------------------------ following the events
    def _spans(self, ids: Sequence[int]) -> list[int]:
        """Base blocks each block of ``ids`` spans (a block of size class k spans 2**k)."""
        return [1 << int(self._order[b]) for b in ids]

    def _blocks(self, ids: Sequence[int]) -> np.ndarray:
        """The base blocks of the blocks ``ids``, as an index array (made once per event: numpy would convert a
        list again for every array it indexes)."""
        if not self.pool.max_order:
            return np.array(ids, np.intp)
        return np.array([u for b, span in zip(ids, self._spans(ids)) for u in range(b, b + span)], np.intp)

    def _set(self, ids: Sequence[int], state: int, refs: int, flash: int = FLASH_NONE) -> None:
        ix = self._blocks(ids)
        self._state[ix], self._refs[ix] = state, refs
        if flash:
            self._flash[ix] = flash  # the latest event of the interval wins

    def _on_event(self, e: ev.Event) -> None:
        """Follow one event (the pool calls this under its lock, right after the change the event reports)."""
        if isinstance(e, ev.Allocated):  # one reference; ALLOCATED, or PENDING for a reservation
            self._set(e.block_ids, POOL_STATES.index(e.status), 1, FLASH_ALLOCATED)
        elif isinstance(e, ev.Freed):
            self._set(e.block_ids, FREE, 0, FLASH_FREED)
        elif isinstance(e, ev.Cached):  # no reference left, the data kept: evictable
            self._set(e.block_ids, CACHED, 0)
        elif isinstance(e, ev.RefChanged):  # the new counts, each >= 1: held, so ALLOCATED
            ix, spans = self._blocks(e.block_ids), self._spans(e.block_ids) if self.pool.max_order else 1
            self._state[ix] = ALLOCATED
            self._refs[ix] = np.repeat(np.minimum(e.counts, 255), spans)
        elif isinstance(e, ev.StatusChanged):
            self._status_changed(e)
        elif isinstance(e, ev.Evicted):
            self._set((e.block_id,), FREE, 0, FLASH_EVICTED)
            self._evictions_total += 1
            candidates = [[b, _score(s)] for b, s in e.candidates]
            self._evictions.append({"step": e.step, "at": self.step, "victim": e.block_id, "policy": e.policy,
                                    "reason": e.reason, "candidates": candidates,
                                    "axis": bar_axis([shown_score(e.policy, float(s)) for _, s in e.candidates])})
            del self._evictions[:-MAX_EVICTIONS]
        elif isinstance(e, ev.Split):  # a FREE block of class k became two of class k - 1
            self._order[e.block_id:e.block_id + (1 << e.size_class)] = e.size_class - 1
        elif isinstance(e, ev.Merged):  # two FREE buddies became one block of class k
            self._order[e.block_id:e.block_id + (1 << e.size_class)] = e.size_class
        elif isinstance(e, ev.Migrated):
            self._migrated(e)

    def _status_changed(self, e: ev.StatusChanged) -> None:
        """Commit (PENDING -> ALLOCATED), swap-out (ALLOCATED -> EVICTING) and its end (EVICTING -> FREE)."""
        new = POOL_STATES.index(e.new)
        if new == FREE:
            self._set(e.block_ids, FREE, 0, FLASH_FREED)
            return
        ix = self._blocks(e.block_ids)
        self._state[ix] = new
        if new == ALLOCATED:  # a block no one holds is cached
            self._state[ix] = np.where(self._refs[ix] == 0, CACHED, ALLOCATED)

    def _migrated(self, e: ev.Migrated) -> None:
        """``src[i]``'s state and refcount moved to ``dst[i]`` (a FREE block of the same size class); the sources
        are FREE."""
        src, dst = self._blocks(e.src), self._blocks(e.dst)
        self._state[dst], self._refs[dst] = self._state[src], self._refs[src]
        self._set(e.src, FREE, 0, FLASH_MOVED_OUT)
        self._flash[dst] = FLASH_MOVED_IN
        self._moves.extend([s, d] for s, d in zip(e.src, e.dst))
        del self._moves[:-MAX_MOVES]

    def _following(self, free: int) -> bool:
        """Whether the bytes still follow the pool. Not after :meth:`close`, nor once the bus dropped the
        subscriber (it raised), nor after a pool call that a hook stopped half-way: the pool publishes no event
        for what such a call had changed. That last case is seen here when it changed the FREE count (an
        eviction or a release whose evict hook raised); :class:`~kvlab.viz.LiveRun` resyncs after a failed
        step as well."""
        p = self.pool
        return self.listening and self._on_event in p.events and free == p.num_free_blocks

    # ------------------------------------------------------------------ making frames
    def frame(self, **extra: Any) -> Frame:
        """One frame of the pool as it is now, with the flashes, evictions and moves collected since the previous
        frame; ``extra`` entries join its JSON tail.

        State, refcount and size class come from the events. What no event carries is read from the pool, under
        its lock: the sum of the tokens (internal waste: ``set_token_counts`` publishes nothing) and the unusable
        free memory (``unusable_free``: 0 without a scan on a one-size pool), two aggregates; the clock; and, for a
        small pool, every block's tokens, owner and last access (``set_owner`` and ``touch`` publish nothing)."""
        p, n = self.pool, self.pool.num_blocks
        with p.lock:
            _, runs = free_runs(self._state)
            if not self._following(int(runs.sum())):
                self.resync()
                _, runs = free_runs(self._state)
            tokens = int(p.arrays.tokens.sum(dtype=self._tokens_sum))
            unusable = unusable_free_percent(p) / 100
            details = self._details() if self.details else b""
            free = int(runs.sum())
            used = n - free
            tail = self._tail(extra)
            tail_bytes = json.dumps(tail, separators=(",", ":")).encode() if tail else b""
            header = {"magic": MAGIC, "seq": next(_SEQ) & 0xFFFFFFFF, "num_blocks": n, "block_size": p.block_size,
                      "step": float(p.clock.now()), "blocks_held": _f32(used / n), "unusable_free": _f32(unusable),
                      "internal_waste": _f32(1 - tokens / (used * p.block_size) if used else 0.0),
                      "external_fragmentation": _f32(1 - int(runs.max()) / free if free else 0.0),
                      "flags": FLAG_DETAILS if self.details else 0, "tail_len": len(tail_bytes)}
            np.left_shift(self._order, FLASH_BITS, out=self._meta)
            np.bitwise_or(self._meta, self._flash, out=self._meta)
            self._flash.fill(0)
            data = b"".join((HEADER.pack(*(header[name] for name, _, _ in HEADER_FIELDS)), self._body.data, details,
                             tail_bytes))  # the body's one copy, made while no event can change it
        return _frame(data, header, tail)

    def build(self) -> bytes:
        """The bytes of :meth:`frame` (what a recording keeps)."""
        return self.frame().data

    def _details(self) -> bytes:
        """Every base block's tokens, owner and last access (its block's), as DETAILS lays them out."""
        a, heads = self.pool.arrays, self._heads()
        return b"".join(getattr(a, name)[heads].astype("<" + code).tobytes() for name, code, _ in DETAILS)

    def _tail(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The JSON tail; consumes the evictions and moves collected."""
        tail: dict[str, Any] = {}
        if self.step is not None:
            tail["run"] = {"step": self.step, "steps": self.steps}
        if self._evictions or self._evictions_total:
            tail["evictions"], tail["evictions_total"] = self._evictions, self._evictions_total
        if self._moves:
            tail["moves"] = self._moves
        self._evictions, self._moves = [], []
        for source in self.tail_sources:
            tail.update(source())
        return {**tail, **extra}


def frame_of(pool: BlockPool, **extra: Any) -> Frame:
    """A single frame of ``pool`` as it is now, with no flashes (a first paint, a static figure)."""
    with FrameBuilder(pool) as b:
        return b.frame(**extra)


def build_frame(pool: BlockPool) -> bytes:
    """The bytes of :func:`frame_of` ``(pool)``."""
    return frame_of(pool).data


def decode_recording(recording: Any) -> list[Frame]:
    """Every frame of ``recording`` (a :class:`~kvlab.viz.live.Recording`, or any iterable of bytes) decoded and
    checked, in order; :class:`ConfigError` naming the first that is not a frame (or a recording that is not
    one, or holds none), before a caller changes anything."""
    if isinstance(recording, (str, bytes, bytearray, memoryview)) or not hasattr(recording, "__iter__"):
        raise ConfigError(f"a recording is an iterable of frames (bytes), not {show(recording)}")
    frames = []
    for i, data in enumerate(recording):
        try:
            frames.append(decode_frame(data))
        except ConfigError as e:
            raise ConfigError(f"frame {i} of the recording is not valid: {e}") from None
    if not frames:
        raise ConfigError("the recording holds no frame")
    return frames


def decode_frame(data: bytes | bytearray | memoryview) -> Frame:
    """A frame from elsewhere (a recording, a file) parsed and checked; raises :class:`ConfigError` naming what is
    wrong if ``data`` is not one. (A frame built here is a :class:`Frame` already: there is nothing to decode.)"""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ConfigError(f"not a kvlab frame: {show(data)} is no bytes")
    data = bytes(data)
    if len(data) < HEADER.size or data[:4] != MAGIC:
        raise ConfigError(f"not a kvlab frame: {len(data)} bytes starting {data[:4]!r}, expected {MAGIC!r}")
    header = dict(zip((name for name, _, _ in HEADER_FIELDS), HEADER.unpack_from(data)))
    n, tail_len = header["num_blocks"], header["tail_len"]
    sections = BODY + (DETAILS if header["flags"] & FLAG_DETAILS else ())
    want = HEADER.size + n * sum(struct.calcsize(code) for _, code, _ in sections) + tail_len
    if len(data) != want:
        raise ConfigError(f"frame {header['seq']} of {n} blocks should be {want} bytes, got {len(data)}")
    try:
        tail = json.loads(data[want - tail_len:]) if tail_len else {}
    except ValueError as e:  # not UTF-8, or not JSON
        raise ConfigError(f"frame {header['seq']}: its tail is not JSON ({show(str(e), 200)})") from None
    except RecursionError:  # valid JSON, but nested deeper than the parser goes: no frame writes that
        raise ConfigError(f"frame {header['seq']}: its tail is JSON nested too deeply") from None
    if not isinstance(tail, dict):
        raise ConfigError(f"frame {header['seq']}: its tail is {type(tail).__name__}, not a JSON object")
    return _frame(data, header, tail)
