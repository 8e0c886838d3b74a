"""A KV connector: the blocks of a prompt's KV cache move from a prefill rank's pool to a decode rank's pool.

The API is split the way real engines split it (vLLM's KV connector v1), so a student can go from here to a
real connector. Each side has a *scheduler* half (bookkeeping, no bytes) and a *worker* half (bytes):

=============================  ==============================================  =================================
                               prefill rank (:class:`KVSender`)                decode rank (:class:`KVReceiver`)
=============================  ==============================================  =================================
scheduler                      ``request_finished``: hold the blocks until     ``get_num_new_matched_tokens``:
                               they are sent; ``build_connector_meta``: this   what the remote side will supply
                               step's requests to ship                         beyond the local prefix hit;
                                                                               ``update_state_after_alloc``: the
                                                                               blocks that will receive;
                                                                               ``build_connector_meta``
worker                         ``start_save`` (announce, hear what the peer    ``poll_requests``,
                               already has), ``save_kv_layer``,                ``start_load_kv``,
                               ``wait_for_save``, ``get_finished``             ``wait_for_layer_load``,
                                                                               ``get_finished``
=============================  ==============================================  =================================

What moves, per step and per layer, is **one message**: the rows of every request of the step, gathered with
one ``index_select`` into a staging buffer on the sender and scattered with one ``index_copy_`` on the
receiver. A row is a whole block when both pools use the same block size, else a token (the transfer then
re-chunks: it reads the sender's slots and writes the receiver's, so block boundaries need not agree). The
receiver never lets the backend write into its pool directly: a late or torn message lands in staging memory,
and the pool only changes once a layer has fully arrived.

Blocks the decode rank already caches (a shared prefix, found by its own prefix cache) are not sent: the
receiver tells the sender, per request, the first token it needs. Every block sent, received or skipped is
published as an event on the pool's bus (:class:`BlocksSent`, :class:`BlocksReceived`, :class:`BlocksSkipped`).

Faults: the two ranks compare their KV layouts when the connector is built (:class:`SpecMismatchError` for
other layers, KV heads, head size or dtype: before any block moves). If the peer exits or stays silent past
the link's timeout, the connector frees every sequence of the step (blocks go FREE or back to the prefix
cache; none stays half-written in a table) and raises :class:`PeerLostError` / :class:`TransferTimeoutError`.
"""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..events import Event
from ..sequence import Sequence, SequenceManager
from ..spec import KVSpec
from .errors import SpecMismatchError, TransferError
from .launch import Link

# dtype <-> wire code; a dtype missing here cannot be transferred (refused by the handshake)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TAG_HELLO, TAG_ANNOUNCE, TAG_PLAN, TAG_LAYER = 1, 2, 3, 16  # layer l travels with tag TAG_LAYER + l


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
    code = DTYPES.index(spec.dtype) if spec.dtype in DTYPES else -1
    return torch.tensor([spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, code],
                        dtype=torch.int64)


def _describe(v: list[int]) -> str:
    dtype = DTYPES[v[4]] if 0 <= v[4] < len(DTYPES) else f"unsupported dtype code {v[4]}"
    return f"{v[0]} layers x {v[1]} kv heads x head_dim {v[2]}, {dtype}"


class _Connector:
    """What both sides share: the link, the pool, the handshake, row addressing and staging memory."""

    role = ""

    def __init__(self, link: Link, manager: SequenceManager, peer: int) -> None:
        if not isinstance(manager, SequenceManager):
            raise ConfigError(f"a connector needs a SequenceManager, got {manager!r}")
        if not isinstance(peer, int) or not 0 <= peer < link.world_size or peer == link.rank:
            raise ConfigError(f"peer must be another rank of the group (0..{link.world_size - 1}), got {peer!r}")
        self.link, self.manager, self.peer = link, manager, peer
        self.pool = manager.pool
        self.storage = self.pool.storage_of()
        spec = self.storage.spec
        mine = spec_vector(spec)
        theirs = torch.zeros_like(mine)
        work = link.isend(mine, peer, TAG_HELLO)
        link.recv(theirs, peer, TAG_HELLO)
        link.wait(work, "the spec handshake")
        a, b = mine.tolist(), theirs.tolist()
        if mine[4] < 0:
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

    def _view(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` of the pool as ``[2, rows, ...]``: blocks, or token slots when re-chunking."""
        return self.storage.slots[:, layer] if self.rechunk else self.storage.kv[:, layer]

    def _staging(self, rows: int) -> list[torch.Tensor]:
        """One buffer per layer of ``rows`` rows, carved from one reused arena (fresh CPU memory costs more
        than the copy into it)."""
        like = self._view(0)
        per = 2 * rows * like[0, 0].numel()
        n = per * self.storage.spec.num_layers
        if self._arena.numel() < n:
            self._arena = torch.empty(max(n, 2 * self._arena.numel()), dtype=like.dtype, device=like.device)
        return [self._arena[i * per:(i + 1) * per].view(2, rows, *like.shape[2:])
                for i in range(self.storage.spec.num_layers)]

    def _publish(self, event: Event) -> None:
        if self.pool.events:
            self.pool.events.publish(event)

    def _fail(self, seqs: Seq[Sequence], error: TransferError) -> TransferError:
        """Give back every sequence of the failed step (a live one only), so the pool holds nothing of it."""
        for s in seqs:
            if s.alive:
                self.manager.free(s)
        return error


class KVSender(_Connector):
    """The prefill rank's connector: ships the KV blocks of finished prefills to ``peer``."""

    role = "sender"

    def __init__(self, link: Link, manager: SequenceManager, peer: int) -> None:
        super().__init__(link, manager, peer)
        self._finished: list[SaveSpec] = []
        self._step: list[SaveSpec] = []
        self._rows_per_layer: list[list[int]] = []
        self._sends: list[Any] = []
        self._buffers: list[torch.Tensor] = []
        self._index = torch.empty(0, dtype=torch.long)
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
        self._finished.append(SaveSpec(request, seq))
        return True

    def build_connector_meta(self) -> list[SaveSpec]:
        """The requests this step ships (all finished since the last step)."""
        meta, self._finished = self._finished, []
        return meta

    # ---------------------------------------------------------------- worker side
    def start_save(self, meta: list[SaveSpec]) -> None:
        """Announce the step's requests to the peer (an empty step tells it the sender is done) and hear, per
        request, the first token it needs (what its own prefix cache does not already hold)."""
        self._t0 = time.perf_counter()
        self._step = meta
        try:
            self.link.send_json([[m.request.request_id, list(m.request.prompt), m.request.first_token,
                                  m.request.tenant] for m in meta], self.peer, TAG_ANNOUNCE)
            if not meta:
                return
            starts = self.link.recv_json(self.peer, TAG_PLAN)
        except TransferError as e:
            raise self._fail([m.seq for m in meta], e) from e
        if len(starts) != len(meta) or any(not 0 <= s < len(m.request.prompt) for s, m in zip(starts, meta)):
            raise self._fail([m.seq for m in meta], TransferError(
                f"rank {self.link.rank}: the receiver asked for start tokens {starts} for prompts of "
                f"{[len(m.request.prompt) for m in meta]} tokens"))
        for m, s in zip(meta, starts):
            m.start = int(s)
        self._rows_per_layer = [self._rows(m.seq, m.start, len(m.request.prompt)) for m in meta]
        self._buffers = self._staging(sum(map(len, self._rows_per_layer)))
        self._index = torch.tensor([r for rows in self._rows_per_layer for r in rows], dtype=torch.long,
                                   device=self.storage.kv.device)
        self._sends = []

    def save_kv_layer(self, layer: int) -> None:
        """Gather this step's rows of ``layer`` into its staging buffer (one ``index_select``) and start
        sending it (one message). Call once per layer, after the layer's K/V are written."""
        if not self._step:
            return
        buf = self._buffers[layer]
        torch.index_select(self._view(layer), 1, self._index, out=buf)
        try:
            self._sends.append(self.link.isend(buf, self.peer, TAG_LAYER + layer))
        except TransferError as e:
            raise self._fail([m.seq for m in self._step], e) from e
        if self.pool.events:
            per_row = buf.numel() * buf.element_size() // max(1, buf.shape[1])
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
            for layer, work in enumerate(self._sends):
                self.link.wait(work, f"sending layer {layer} of requests "
                                     f"{[m.request.request_id for m in self._step]}")
        except TransferError as e:
            raise self._fail([m.seq for m in self._step], e) from e
        r, B = self.report, self.pool.block_size
        for m in self._step:
            n = len(m.request.prompt)
            r.blocks_sent += -(-n // B) - m.start // B
            r.tokens_moved += n - m.start
        r.requests += len(self._step)
        r.bytes += sum(b.numel() * b.element_size() for b in self._buffers)
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


class KVReceiver(_Connector):
    """The decode rank's connector: loads the KV blocks the prefill rank ``peer`` ships into this pool."""

    role = "receiver"

    def __init__(self, link: Link, manager: SequenceManager, peer: int) -> None:
        super().__init__(link, manager, peer)
        self._pending: list[LoadSpec] = []
        self._step: list[LoadSpec] = []
        self._recvs: list[Any] = []
        self._buffers: list[torch.Tensor] = []
        self._index: list[int] = []
        self._rows_per_req: list[list[int]] = []
        self._loaded: set[int] = set()
        self._layers_done = 0

    # ---------------------------------------------------------------- worker side: requests arrive
    def poll_requests(self) -> list[RemoteRequest] | None:
        """The next step's requests from the sender; None when the sender is done."""
        got = self.link.recv_json(self.peer, TAG_ANNOUNCE)
        if not got:
            return None
        return [RemoteRequest(int(i), tuple(int(t) for t in p), int(f), tenant) for i, p, f, tenant in got]

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
        self._pending.append(LoadSpec(request, seq, start))
        if start:
            ids = tuple(seq.block_table[:start // self.pool.block_size])
            self._publish(BlocksSkipped(self.pool.clock.now(), request.request_id, ids, start))

    def build_connector_meta(self) -> list[LoadSpec]:
        """The loads of this step (every request allocated since the last step)."""
        meta, self._pending = self._pending, []
        return meta

    # ---------------------------------------------------------------- worker side: bytes
    def start_load_kv(self, meta: list[LoadSpec]) -> None:
        """Tell the sender where each request's needed tokens start, then post one receive per layer into
        staging memory (all layers at once, so they arrive back to back)."""
        self._t0 = time.perf_counter()
        self._step, self._layers_done = meta, 0
        rows = [self._rows(m.seq, m.start, len(m.request.prompt)) for m in meta]
        self._index = [r for rr in rows for r in rr]
        self._rows_per_req = rows
        self._buffers = self._staging(len(self._index))
        try:
            self.link.send_json([m.start for m in meta], self.peer, TAG_PLAN)
            self._recvs = [self.link.irecv(b, self.peer, TAG_LAYER + layer) for layer, b in enumerate(self._buffers)]
        except TransferError as e:
            raise self._fail([m.seq for m in meta], e) from e

    def wait_for_layer_load(self, layer: int) -> None:
        """Wait for ``layer`` (bounded by the link's timeout), then write it into the pool with one
        ``index_copy_``. On a fault every sequence of the step is freed and the typed error raised."""
        if not self._step:
            return
        if layer != self._layers_done:
            raise ConfigError(f"layers load in order: expected layer {self._layers_done}, got {layer}")
        try:
            self.link.wait(self._recvs[layer], f"receiving layer {layer} of requests "
                                               f"{[m.request.request_id for m in self._step]}")
        except TransferError as e:
            raise self._fail([m.seq for m in self._step], e) from e
        buf = self._buffers[layer]
        idx = torch.tensor(self._index, dtype=torch.long, device=buf.device)
        self._view(layer).index_copy_(1, idx, buf)
        self._layers_done += 1
        if self.pool.events:
            B = self.pool.block_size
            per_row = buf.numel() * buf.element_size() // max(1, buf.shape[1])
            for m, rows in zip(self._step, self._rows_per_req):
                ids = tuple(m.seq.block_table[m.start // B:])
                self._publish(BlocksReceived(self.pool.clock.now(), m.request.request_id, layer, ids,
                                             per_row * len(rows)))
        if self._layers_done == len(self._buffers):
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
        r.bytes += sum(b.numel() * b.element_size() for b in self._buffers)
        r.messages += len(self._buffers)
        r.seconds += time.perf_counter() - self._t0
        self._step = []

    def get_finished(self) -> set[int]:
        """Request ids whose prompt KV has fully arrived since the last call: they may decode now."""
        done, self._loaded = self._loaded, set()
        return done
