"""A KV connector: the blocks of a prompt's KV cache move from a prefill rank's pool to a decode rank's pool.

The API is split the way vLLM 0.34.0's ``KVConnectorBase_V1`` is split (chapters/FACTS.md, F57-F66), so a student can
go from here to a real connector. Each side has a *scheduler* half (bookkeeping, no bytes) and a *worker* half
(bytes). The names are vLLM's except ``start_save`` and ``poll_requests`` (marked *): kvlab's own, for the
handshake in which the sender hears what the receiver already has; vLLM has no such methods.

=============================  ==============================================  =================================
                               prefill rank (:class:`KVSender`)                decode rank (:class:`KVReceiver`)
=============================  ==============================================  =================================
scheduler                      ``request_finished``: hold the blocks until     ``get_num_new_matched_tokens``:
                               they are sent; ``build_connector_meta``: this   what the remote side will supply
                               step's requests to ship                         beyond the local prefix hit;
                                                                               ``update_state_after_alloc``: the
                                                                               blocks that will receive;
                                                                               ``build_connector_meta``
worker                         ``start_save``* (announce, hear what the peer   ``poll_requests``*,
                               already has), ``save_kv_layer``,                ``start_load_kv``,
                               ``wait_for_save``, ``get_finished``             ``wait_for_layer_load``,
                                                                               ``get_finished``
=============================  ==============================================  =================================

What moves, per step, layer and half (K, V), is the rows of every request of the step, in as few messages as
the two pools' layouts allow. A row is a whole block when both pools use the same block size, else a token (the
transfer then re-chunks: it reads the sender's slots and writes the receiver's, so block boundaries need not
agree). Rows lying in a few runs of consecutive ids (the free stack hands blocks out in runs) go straight from
the sender's pool into the receiver's, one message per run, with no copy on either side; a side whose rows are
scattered copies them through a staging buffer (the sender gathers a layer into one message, the receiver
copies a layer out once it has fully arrived).

Blocks the decode rank already caches (a shared prefix, found by its own prefix cache) are not sent: the
receiver tells the sender, per request, the first token it needs. Every block sent, received or skipped is
published as an event on the pool's bus (:class:`BlocksSent`, :class:`BlocksReceived`, :class:`BlocksSkipped`).

Faults: the two ranks compare their KV layouts when the connector is built (:class:`SpecMismatchError` for
other layers, KV heads, head size or dtype: before any block moves). If the peer exits or stays silent past
the link's timeout, the connector aborts the link (pending receives are cancelled, so no late message can land
in a block once it is reused), frees every sequence of the step (blocks go FREE or back to the prefix cache;
none stays half-written in a table) and raises :class:`PeerLostError` / :class:`TransferTimeoutError`.

Interrupts: each public method is atomic (:mod:`kvlab.core.interrupts`): a Ctrl-C during one is held until it
returns, so it lands after the current wait on the peer (bounded by the link's timeout) and the call's
bookkeeping. A driver stopped *between* calls, with receives or sends still posted into its pool, calls
:meth:`~_Connector.cancel`, as :func:`kvlab.distributed.decode_rank` and ``prefill_rank`` do.
"""
from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Iterable, Sequence as Seq
from itertools import accumulate
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.core.checks import TOKEN_MAX, is_text, show
from kvlab.core.errors import ConfigError
from kvlab.core.events import Event
from kvlab.core.interrupts import atomic
from kvlab.core.sequence import Sequence, SequenceManager
from kvlab.core.spec import KVSpec
from kvlab.distributed.errors import ProtocolError, SpecMismatchError, TransferError
from kvlab.distributed.launch import Link

# dtype <-> wire code; a dtype missing here cannot be transferred (refused by the handshake)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TAG_HELLO, TAG_ANNOUNCE, TAG_PLAN, TAG_SEGMENTS, TAG_LAYER = 1, 2, 3, 4, 16
MAX_RUNS = 8  # a layer whose rows form more runs of consecutive ids than this is gathered into one message
COPY_RUNS = 64  # up to this many runs, rows are copied run by run; beyond, by one indexed copy


def runs(rows: Seq[int]) -> list[tuple[int, int]]:
    """``rows`` as maximal runs ``(first, length)`` of consecutive ids, in order."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out


def copy_rows(dst: torch.Tensor, dst_runs: Seq[tuple[int, int]] | None, src: torch.Tensor,
              src_runs: Seq[tuple[int, int]] | None, index: torch.Tensor) -> None:
    """Copy rows between a 2-D pool half and a staging half: ``dst_runs`` (scatter into the pool) or
    ``src_runs`` (gather from it) say where the pool's rows lie. A few runs go as slice copies (memcpy); many go
    as one ``index_copy_`` / ``index_select`` (one Python call instead of one per run; per row it is slower:
    fp16 rows of 16-token blocks were copied at 1 GB/s by ``index_copy_``, at 40 GB/s by slices, here)."""
    pool_runs = dst_runs if dst_runs is not None else src_runs
    assert pool_runs is not None
    if len(pool_runs) <= COPY_RUNS:
        at = 0
        for a, n in pool_runs:
            if dst_runs is not None:
                dst[a:a + n].copy_(src[at:at + n])
            else:
                dst[at:at + n].copy_(src[a:a + n])
            at += n
    elif dst_runs is not None:
        dst.index_copy_(0, index, src)
    else:
        torch.index_select(src, 0, index, out=dst)


def cut(total: int, *run_lists: Seq[tuple[int, int]]) -> list[tuple[int, int]]:
    """``total`` flattened rows as pieces ``(offset, length)``, cut wherever a run of any list starts, so each
    piece lies inside one run of every list (one slice of each pool)."""
    points = {0, total}
    for rs in run_lists:
        at = 0
        for _, n in rs:
            points.add(at)
            at += n
    ordered = sorted(points)
    return [(a, b - a) for a, b in zip(ordered, ordered[1:]) if b > a]


# ---------------------------------------------------------------- what a peer may say (checked, never trusted)
MAX_SEGMENTS = 1 << 12  # messages a layer half may be cut into: segment_tag keeps 12 bits for the index


def _ints(value: Any, what: str, lo: int, hi: int) -> list[int]:
    """``value`` as a list of ints in ``lo..hi`` (JSON ints: never bools or floats), else :class:`ProtocolError`
    naming ``what``."""
    if not isinstance(value, list) or not all(type(v) is int and lo <= v <= hi for v in value):
        raise ProtocolError(f"{what} must be a list of ints in {lo}..{hi}, got {show(value)}")
    return value


def check_announce(value: Any) -> list[RemoteRequest]:
    """A sender's announce: ``[[request id, prompt token ids, first token, tenant], ...]``."""
    if not isinstance(value, list):
        raise ProtocolError(f"an announce is a list of requests, got {show(value)}")
    out = []
    for i, item in enumerate(value):
        if not (isinstance(item, list) and len(item) == 4):
            raise ProtocolError(f"announced request {i} is [id, prompt, first token, tenant], got {show(item)}")
        rid, prompt, first, tenant = item
        _ints([rid, first], f"announced request {i}'s id and first token", 0, TOKEN_MAX)
        prompt = _ints(prompt, f"announced request {i}'s prompt", 0, TOKEN_MAX)
        if not prompt or (tenant is not None and not is_text(tenant)):
            raise ProtocolError(f"announced request {i} needs a prompt and a str or null tenant, got "
                                f"{len(prompt)} tokens and tenant {show(tenant)}")
        out.append(RemoteRequest(rid, tuple(prompt), first, tenant))
    if len({r.request_id for r in out}) != len(out):
        raise ProtocolError(f"an announce names a request twice: {[r.request_id for r in out][:10]}")
    return out


def check_plan(value: Any, lengths: Seq[int], rows: int | None = None) -> tuple[list[int], list[int] | None]:
    """A receiver's plan for prompts of ``lengths`` tokens: ``{"starts": first token it needs of each,
    "runs": lengths of its runs of consecutive rows, or null}``. ``rows``: the rows the starts make (checked
    against the runs once known)."""
    if not isinstance(value, dict) or set(value) != {"starts", "runs"}:
        raise ProtocolError(f"a plan is {{starts, runs}}, got {show(value)}")
    starts = _ints(value["starts"], "the plan's starts", 0, max(lengths, default=1) - 1)
    if len(starts) != len(lengths) or any(s >= n for s, n in zip(starts, lengths)):
        raise ProtocolError(f"the receiver asked for start tokens {show(starts)} for prompts of {list(lengths)[:10]} "
                            f"tokens")
    theirs = value["runs"]
    if theirs is not None:
        theirs = _ints(theirs, "the plan's runs", 1, rows if rows is not None else TOKEN_MAX)
        if len(theirs) > MAX_SEGMENTS or (rows is not None and sum(theirs) != rows):
            raise ProtocolError(f"the receiver's runs {show(theirs)} do not cover the {rows} rows")
    return starts, theirs


def check_segments(value: Any, flat: Seq[int], direct: bool) -> list[tuple[int, int]]:
    """The sender's cut of this rank's ``flat`` rows into messages, as pieces ``(offset, length)``: every row
    exactly once, in order, at most :data:`MAX_SEGMENTS` pieces, and, when the rows receive in place
    (``direct``), each piece inside one run of consecutive rows (one slice of the pool: a piece across two
    runs would write blocks this rank never gave it)."""
    n = len(flat)
    lengths = _ints(value, "the sender's segments", 1, max(n, 1))
    if sum(lengths) != n or len(lengths) > MAX_SEGMENTS:
        raise ProtocolError(f"the sender cuts {n} rows into segments {show(lengths)}, which do not cover them once")
    pieces, at = [], 0
    for k in lengths:
        pieces.append((at, k))
        at += k
    if direct:
        ends = list(accumulate(k for _, k in runs(flat)))  # where each run of consecutive rows ends, ascending
        for a, k in pieces:
            if ends[bisect_right(ends, a)] < a + k:  # the run holding row a ends before the piece does
                raise ProtocolError(f"the sender's segment of rows {a}..{a + k - 1} spans two runs of this rank's "
                                    f"blocks (rows {flat[a]}.. and a later run): it would land in blocks not given "
                                    f"to it")
    return pieces


def segment_tag(layer: int, half: int, segment: int) -> int:
    """The tag of segment ``segment`` of K (``half`` 0) or V (1) of ``layer``: every message has its own."""
    return TAG_LAYER + ((layer * 2 + half) << 12) + segment


@dataclass(slots=True)
class BlocksSent(Event):
    """The sender shipped ``block_ids`` (its own ids) of request ``request_id`` for ``layer``: ``nbytes`` bytes."""
    request_id: int
    layer: int
    block_ids: tuple[int, ...]
    nbytes: int


@dataclass(slots=True)
class BlocksReceived(Event):
    """The receiver wrote ``layer`` of request ``request_id`` into ``block_ids`` (its own ids)."""
    request_id: int
    layer: int
    block_ids: tuple[int, ...]
    nbytes: int


@dataclass(slots=True)
class BlocksSkipped(Event):
    """The receiver already caches ``block_ids`` (``tokens`` prompt tokens) of request ``request_id``: not sent."""
    request_id: int
    block_ids: tuple[int, ...]
    tokens: int


@dataclass
class TransferReport:
    """What a connector moved so far. ``blocks_*`` count this rank's own blocks; ``seconds`` is the time from
    the start of each step's transfer to its last wait; ``rechunked`` is True when the block sizes differ."""
    role: str
    requests: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    blocks_skipped: int = 0
    tokens_moved: int = 0
    tokens_skipped: int = 0
    bytes: int = 0
    messages: int = 0
    seconds: float = 0.0
    rechunked: bool = False

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, "gb_per_s": self.gb_per_s}

    def __str__(self) -> str:
        moved = (f"{self.blocks_sent} blocks sent" if self.role == "sender" else
                 f"{self.blocks_received} blocks received, {self.blocks_skipped} skipped "
                 f"({self.tokens_skipped} tokens already cached)")
        return (f"{self.role}: {self.requests} requests, {moved}, {self.tokens_moved} tokens, {self.bytes:,} bytes "
                f"in {self.messages} messages, {self.seconds * 1e3:.1f} ms, {self.gb_per_s:.2f} GB/s"
                + (" (re-chunked between block sizes)" if self.rechunked else ""))


@dataclass(frozen=True)
class RemoteRequest:
    """A prompt the prefill rank computed: its tokens, the first generated token, the tenant (prefix salt)."""
    request_id: int
    prompt: tuple[int, ...]
    first_token: int
    tenant: str | None = None


@dataclass
class LoadSpec:
    """One request of a receiver's step: the sequence that receives and the first prompt token it needs."""
    request: RemoteRequest
    seq: Sequence
    start: int  # first prompt token to receive (the local prefix hit ends here)


@dataclass
class SaveSpec:
    """One request of a sender's step: the sequence holding its KV and the first token the receiver needs."""
    request: RemoteRequest
    seq: Sequence
    start: int = 0  # set by the receiver's answer


def spec_vector(spec: KVSpec) -> torch.Tensor:
    """The handshake: ``[layers, kv heads, head_dim, block_size, dtype code]`` as int64."""
    if not isinstance(spec, KVSpec):
        raise ConfigError(f"spec_vector needs a KVSpec, got {spec!r}")
    code = DTYPES.index(spec.dtype) if spec.dtype in DTYPES else -1
    return torch.tensor([spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, code],
                        dtype=torch.int64)


def _describe(v: list[int]) -> str:
    dtype = DTYPES[v[4]] if 0 <= v[4] < len(DTYPES) else f"unsupported dtype code {v[4]}"
    return f"{v[0]} layers x {v[1]} kv heads x head_dim {v[2]}, {dtype}"


class _Connector:
    """What both sides share: the link, the pool, the handshake, row addressing and staging memory."""

    role = ""
    _step: Seq[SaveSpec | LoadSpec]  # the step in flight
    _waiting: Seq[SaveSpec | LoadSpec]  # what the next step will take (build_connector_meta)

    def __init__(self, link: Link, manager: SequenceManager, peer: int) -> None:
        if not isinstance(manager, SequenceManager):
            raise ConfigError(f"a connector needs a SequenceManager, got {manager!r}")
        if not isinstance(peer, int) or not 0 <= peer < link.world_size or peer == link.rank:
            raise ConfigError(f"peer must be another rank of the group (0..{link.world_size - 1}), got {peer!r}")
        self.link, self.manager, self.peer = link, manager, peer
        self.pool = manager.pool
        self.storage = self.pool.storage_of()
        spec = self.storage.spec
        mine = link.control(spec_vector(spec))
        theirs = torch.zeros_like(mine)
        work = link.isend(mine, peer, TAG_HELLO)
        link.recv(theirs, peer, TAG_HELLO)
        link.wait(work, "the spec handshake")
        a, b = mine.cpu().tolist(), theirs.cpu().tolist()
        if a[4] < 0:
            raise SpecMismatchError(f"rank {link.rank}: dtype {spec.dtype} cannot be transferred (one of {DTYPES})")
        if a[:3] + a[4:] != b[:3] + b[4:]:
            names = [n for n, x, y in zip(("layers", "kv heads", "head_dim", "", "dtype"), a, b) if x != y and n]
            raise SpecMismatchError(f"rank {link.rank} holds {_describe(a)}, rank {peer} holds {_describe(b)}: "
                                    f"{', '.join(names)} differ, so no block can move between them")
        self.peer_block_size = b[3]
        self.rechunk = b[3] != spec.block_size
        self.report = TransferReport(self.role, rechunked=self.rechunk)
        self._arena = torch.empty(0, dtype=spec.dtype, device=self.storage.kv.device)
        self._t0 = 0.0

    # rows: a whole block per row when block sizes agree, else one token per row
    def _rows(self, seq: Sequence, start: int, stop: int) -> list[int]:
        if self.rechunk:
            return self.manager.slot_mapping([seq], [start], [stop]).tolist()
        B = self.pool.block_size
        return seq.block_table[start // B:-(-stop // B)]

    def _halves(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` as contiguous ``[rows, row elements]`` views: blocks, or token slots when
        re-chunking. Row-wise copies of a contiguous 2-D view run at memcpy speed; the same ``index_select``
        over the strided ``[2, rows, ...]`` view ran 30x slower here."""
        kv = self.storage.slots if self.rechunk else self.storage.kv
        k, v = kv[0, layer], kv[1, layer]
        return k.view(k.shape[0], -1), v.view(v.shape[0], -1)

    def _staging(self, rows: int) -> list[torch.Tensor]:
        """One ``[2, rows, row elements]`` buffer per layer, carved from one reused arena (fresh CPU memory
        costs more than the copy into it)."""
        width = self._halves(0)[0].shape[1]
        per = 2 * rows * width
        n = per * self.storage.spec.num_layers
        if self._arena.numel() < n:
            self._arena = torch.empty(max(n, 2 * self._arena.numel()), dtype=self._arena.dtype,
                                      device=self._arena.device)
        return [self._arena[i * per:(i + 1) * per].view(2, rows, width) for i in range(self.storage.spec.num_layers)]

    def _publish(self, event: Event) -> None:
        if self.pool.events:
            self.pool.events.publish(event)

    def _row_bytes(self) -> int:
        """Bytes of one row (K and V) of one layer."""
        return 2 * self._halves(0)[0][0].numel() * self.storage.kv.element_size()

    def _held(self) -> list[Sequence]:
        """The sequences this connector holds for a step: in flight, or waiting for the next one."""
        return [m.seq for m in (*self._step, *self._waiting)]

    def cancel(self, seqs: Iterable[Sequence] = ()) -> None:
        """Abandon the transfer: abort the link (no message in flight may land in a block that is about to be
        freed), then give back every sequence the connector holds for a step and ``seqs`` (the live ones), so the
        pool holds nothing of them. Every later call on the link fails."""
        self.link.abort()
        for s in [*self._held(), *seqs]:
            if s.alive:
                self.manager.free(s)

    def _fail(self, error: TransferError) -> TransferError:
        """:meth:`cancel` after a fault of the step; returns the error to raise."""
        self.cancel()
        return error


@atomic()
class KVSender(_Connector):
    """The prefill rank's connector: ships the KV blocks of finished prefills to ``peer``."""

    role = "sender"

    def __init__(self, link: Link, manager: SequenceManager, peer: int) -> None:
        super().__init__(link, manager, peer)
        self._waiting: list[SaveSpec] = []
        self._step: list[SaveSpec] = []
        self._rows_per_layer: list[list[int]] = []
        self._sends: list[Any] = []
        self._buffers: list[torch.Tensor] = []
        self._index = torch.empty(0, dtype=torch.long)
        self._flat: list[int] = []
        self._pieces: list[tuple[int, int]] = []
        self._all_runs: list[tuple[int, int]] = []
        self._nbytes = 0
        self._done: set[int] = set()

    # ---------------------------------------------------------------- scheduler side
    def request_finished(self, request: RemoteRequest, seq: Sequence) -> bool:
        """Prefill of ``request`` (in ``seq``) is done. Returns True: its blocks stay held until
        :meth:`get_finished` names the request (the caller frees the sequence then)."""
        if not isinstance(request, RemoteRequest) or not isinstance(seq, Sequence) or not seq.alive:
            raise ConfigError(f"request_finished needs a RemoteRequest and its live Sequence, got {request!r}, "
                              f"{seq!r}")
        if seq.num_tokens != len(request.prompt):
            raise ConfigError(f"request {request.request_id}: the sequence holds {seq.num_tokens} tokens, the "
                              f"prompt has {len(request.prompt)}")
        self._waiting.append(SaveSpec(request, seq))
        return True

    def build_connector_meta(self) -> list[SaveSpec]:
        """The requests this step ships (all finished since the last step)."""
        meta, self._waiting = self._waiting, []
        return meta

    # ---------------------------------------------------------------- worker side
    def start_save(self, meta: list[SaveSpec]) -> None:
        """Announce the step's requests to the peer (an empty step tells it the sender is done) and hear, per
        request, the first token it needs (what its own prefix cache does not already hold)."""
        self._t0 = time.perf_counter()
        self._step = meta
        lengths = [len(m.request.prompt) for m in meta]
        try:
            self.link.send_json([[m.request.request_id, list(m.request.prompt), m.request.first_token,
                                  m.request.tenant] for m in meta], self.peer, TAG_ANNOUNCE)
            if not meta:
                return
            starts, theirs = check_plan(self.link.recv_json(self.peer, TAG_PLAN), lengths)
            rows = [self._rows(m.seq, s, n) for m, s, n in zip(meta, starts, lengths)]
            flat = [r for rr in rows for r in rr]
            check_plan({"starts": starts, "runs": theirs}, lengths, len(flat))  # the runs against the rows
        except TransferError as e:
            raise self._fail(e) from e
        for m, s in zip(meta, starts):
            m.start = s
        self._rows_per_layer, self._flat = rows, flat
        # Rows that lie in a few runs of consecutive ids (the free stack hands blocks out in runs) are sent
        # straight from the pool; scattered ones are gathered into staging first. Messages are cut wherever a
        # run starts on either side, so each lands in one slice of the receiver's pool.
        self._all_runs = runs(flat)
        gather = len(self._all_runs) > MAX_RUNS
        mine = [] if gather else [self._all_runs]
        self._pieces = cut(len(flat), *mine, *([] if theirs is None else [[(0, n) for n in theirs]]))
        if gather:
            self._buffers = self._staging(len(flat))
            self._index = torch.tensor(flat, dtype=torch.long, device=self.storage.kv.device)
        else:
            self._buffers = []
        self._nbytes = len(flat) * self._row_bytes() * self.storage.spec.num_layers
        self._sends = []
        try:
            self.link.send_json([n for _, n in self._pieces], self.peer, TAG_SEGMENTS)
        except TransferError as e:
            raise self._fail(e) from e

    def save_kv_layer(self, layer: int) -> None:
        """Start sending this step's rows of ``layer``: K and V of each run straight from the pool, or, when
        the rows are scattered, gathered into a staging buffer (one ``index_select`` per half) and sent as one
        message per half. Call once per layer, after the layer's K/V are written."""
        if not self._step:
            return
        halves = self._halves(layer)
        if self._buffers:
            buf = self._buffers[layer]
            for half, out in zip(halves, buf):
                copy_rows(out, None, half, self._all_runs, self._index)
            parts = [[buf[j, a:a + n] for a, n in self._pieces] for j in (0, 1)]
        else:
            flat = self._flat
            parts = [[h[flat[a]:flat[a] + n] for a, n in self._pieces] for h in halves]
        try:
            for j, segments in enumerate(parts):
                for i, t in enumerate(segments):
                    self._sends.append(self.link.isend(t, self.peer, segment_tag(layer, j, i)))
        except TransferError as e:
            raise self._fail(e) from e
        if self.pool.events:
            per_row = self._row_bytes()
            for m, rows in zip(self._step, self._rows_per_layer):
                B = self.pool.block_size
                ids = tuple(m.seq.block_table[m.start // B:-(-len(m.request.prompt) // B)])
                self._publish(BlocksSent(self.pool.clock.now(), m.request.request_id, layer, ids,
                                         per_row * len(rows)))

    def wait_for_save(self) -> None:
        """Wait until every layer of the step has left (bounded by the link's timeout)."""
        if not self._step:
            return
        try:
            for work in self._sends:
                self.link.wait(work, f"sending the KV of requests {[m.request.request_id for m in self._step]}")
        except TransferError as e:
            raise self._fail(e) from e
        r, B = self.report, self.pool.block_size
        for m in self._step:
            n = len(m.request.prompt)
            r.blocks_sent += -(-n // B) - m.start // B
            r.tokens_moved += n - m.start
        r.requests += len(self._step)
        r.bytes += self._nbytes
        r.messages += len(self._sends)
        r.seconds += time.perf_counter() - self._t0
        self._done.update(m.request.request_id for m in self._step)
        self._step, self._sends = [], []

    def get_finished(self) -> set[int]:
        """Request ids whose blocks have all been sent since the last call: their sequences may be freed."""
        done, self._done = self._done, set()
        return done

    def finish(self) -> None:
        """Tell the receiver no more requests will come."""
        self.start_save([])


@atomic()
class KVReceiver(_Connector):
    """The decode rank's connector: loads the KV blocks the prefill rank ``peer`` ships into this pool."""

    role = "receiver"

    def __init__(self, link: Link, manager: SequenceManager, peer: int) -> None:
        super().__init__(link, manager, peer)
        self._waiting: list[LoadSpec] = []
        self._step: list[LoadSpec] = []
        self._recvs: list[list[Any]] = []
        self._buffers: list[torch.Tensor] = []
        self._index = torch.empty(0, dtype=torch.long)
        self._runs: list[tuple[int, int]] = []
        self._nbytes = 0
        self._rows_per_req: list[list[int]] = []
        self._loaded: set[int] = set()
        self._layers_done = 0

    # ---------------------------------------------------------------- worker side: requests arrive
    def poll_requests(self) -> list[RemoteRequest] | None:
        """The next step's requests from the sender; None when the sender is done."""
        got = self.link.recv_json(self.peer, TAG_ANNOUNCE)
        requests = check_announce(got)
        return requests or None

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: RemoteRequest) -> int:
        """Prompt tokens the sender will supply: all but the blocks this rank's prefix cache already holds."""
        cache, B = self.manager.prefix_cache, self.pool.block_size
        hit = len(cache.peek(list(request.prompt), request.tenant, (len(request.prompt) - 1) // B)) \
            if cache is not None else 0
        return len(request.prompt) - hit * B

    def update_state_after_alloc(self, request: RemoteRequest, seq: Sequence) -> None:
        """The scheduler gave ``request`` the live sequence ``seq`` (its prefix hit, then blocks for the rest of
        the prompt): those blocks will receive. Publishes :class:`BlocksSkipped` for the hit."""
        if not isinstance(seq, Sequence) or not seq.alive or seq.num_tokens != len(request.prompt):
            raise ConfigError(f"request {request.request_id}: update_state_after_alloc needs a live sequence holding "
                              f"the whole prompt ({len(request.prompt)} tokens), got {seq!r}")
        start = seq.num_cached_tokens
        self._waiting.append(LoadSpec(request, seq, start))
        if start:
            ids = tuple(seq.block_table[:start // self.pool.block_size])
            self._publish(BlocksSkipped(self.pool.clock.now(), request.request_id, ids, start))

    def build_connector_meta(self) -> list[LoadSpec]:
        """The loads of this step (every request allocated since the last step)."""
        meta, self._waiting = self._waiting, []
        return meta

    # ---------------------------------------------------------------- worker side: bytes
    def start_load_kv(self, meta: list[LoadSpec]) -> None:
        """Tell the sender where each request's needed tokens start (and how this rank's blocks lie), hear how it
        cuts each layer into messages, and post every receive at once, so the layers arrive back to back.

        Blocks in a few runs receive in place (each message lands in one slice of the pool; on a fault the
        link is aborted before any block is freed, so no late message can land in a reused block); scattered
        ones receive into staging memory and are copied into the pool as each layer completes."""
        self._t0 = time.perf_counter()
        self._step, self._layers_done = meta, 0
        rows = [self._rows(m.seq, m.start, len(m.request.prompt)) for m in meta]
        flat = [r for rr in rows for r in rr]
        self._index = torch.tensor(flat, dtype=torch.long, device=self.storage.kv.device)
        self._runs = runs(flat)
        self._rows_per_req = rows
        direct = len(self._runs) <= MAX_RUNS
        self._buffers = [] if direct else self._staging(len(flat))
        self._nbytes = len(flat) * self._row_bytes() * self.storage.spec.num_layers
        try:
            self.link.send_json({"starts": [m.start for m in meta],
                                 "runs": [n for _, n in self._runs] if direct else None}, self.peer, TAG_PLAN)
            pieces = check_segments(self.link.recv_json(self.peer, TAG_SEGMENTS), flat, direct)
            self._recvs = []
            for layer in range(self.storage.spec.num_layers):
                halves = self._halves(layer)
                targets = [[halves[j][flat[a]:flat[a] + n] for a, n in pieces] if direct else
                           [self._buffers[layer][j, a:a + n] for a, n in pieces] for j in (0, 1)]
                self._recvs.append([self.link.irecv(t, self.peer, segment_tag(layer, j, i))
                                    for j in (0, 1) for i, t in enumerate(targets[j])])
        except TransferError as e:
            raise self._fail(e) from e

    def wait_for_layer_load(self, layer: int) -> None:
        """Wait for ``layer`` (bounded by the link's timeout), then write it into the pool with one
        ``index_copy_``. On a fault every sequence of the step is freed and the typed error raised."""
        if not self._step:
            return
        if layer != self._layers_done:
            raise ConfigError(f"layers load in order: expected layer {self._layers_done}, got {layer}")
        try:
            for work in self._recvs[layer]:
                self.link.wait(work, f"receiving layer {layer} of requests "
                                     f"{[m.request.request_id for m in self._step]}")
        except TransferError as e:
            raise self._fail(e) from e
        if self._buffers:
            for half, data in zip(self._halves(layer), self._buffers[layer]):
                copy_rows(half, self._runs, data, None, self._index)
        self._layers_done += 1
        if self.pool.events:
            B = self.pool.block_size
            per_row = self._row_bytes()
            for m, rows in zip(self._step, self._rows_per_req):
                ids = tuple(m.seq.block_table[m.start // B:])
                self._publish(BlocksReceived(self.pool.clock.now(), m.request.request_id, layer, ids,
                                             per_row * len(rows)))
        if self._layers_done == self.storage.spec.num_layers:
            self._finish_step()

    def _finish_step(self) -> None:
        r, B = self.report, self.pool.block_size
        for m in self._step:
            r.blocks_received += m.seq.num_blocks - m.start // B
            r.blocks_skipped += m.start // B
            r.tokens_moved += len(m.request.prompt) - m.start
            r.tokens_skipped += m.start
            self._loaded.add(m.request.request_id)
        r.requests += len(self._step)
        r.bytes += self._nbytes
        r.messages += sum(map(len, self._recvs))
        r.seconds += time.perf_counter() - self._t0
        self._step = []

    def get_finished(self) -> set[int]:
        """Request ids whose prompt KV has fully arrived since the last call: they may decode now."""
        done, self._loaded = self._loaded, set()
        return done
