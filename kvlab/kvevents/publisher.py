"""kvlab's engine speaks vLLM's KV events: tools written for a vLLM server's event stream can follow a kvlab run.

The idea: the publisher only listens to the engine's event bus, as any view does. The prefix cache reports
``PrefixStored`` when it registers a full block and ``PrefixEvicted`` when one leaves; each becomes vLLM's
``BlockStored`` (blocks registered in one chain merge into one event, parent-linked, with their tokens) or
``BlockRemoved``; the engine's ``StepMetrics`` closes a step, and a step with events is sent as one
``KVEventBatch`` in vLLM 0.34.0's bytes (:func:`~kvlab.kvevents.wire.encode_batch`), as
``[topic, seq, payload]`` on a PUB socket. The first batch is ``AllBlocksCleared`` followed by the blocks already
cached: kvlab has no cache reset, so a consumer learns here that a new run starts and what it starts from.

The settings are vLLM's ``KVEventsConfig`` (vllm/config/kv_events.py in 0.34.0), same names and defaults:
``endpoint`` ("tcp://*:5557": the PUB socket binds when the endpoint holds ``*`` or ``::`` or is ``ipc://`` or
``inproc://``, else connects), ``replay_endpoint`` (None; a ROUTER that answers ``[b"", start seq]`` with the
buffered batches from that seq, then an end marker of seq -1), ``buffer_steps`` (10,000 batches kept for replay),
``hwm`` (100,000) and ``topic`` (""). Block hashes go out as vLLM sends them by default: the low 64 bits of the
hash as an int (kvlab's 16-byte blake2b digests). It works the same with or without a model: metadata mode and
real-model mode register the same blocks. A bare :class:`~kvlab.core.prefix.PrefixCache` can be published too;
then :meth:`KVEventPublisher.flush` closes each batch.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from kvlab.core.checks import check_count, check_positive
from kvlab.core.errors import ConfigError
from kvlab.core.events import Event, Listener
from kvlab.core.prefix import PrefixCache, PrefixEvicted, PrefixStored
from kvlab.kvevents.wire import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch,
                                 encode_batch, seq_bytes)
from kvlab.serve.metrics import StepMetrics

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)
MEDIUM_GPU = "GPU"  # vLLM's name for the device pool's medium


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket: bind a wildcard host or an ipc/inproc address, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def external_hash(digest: bytes) -> int:
    """A block hash as vLLM sends it by default: the hash's bytes read big-endian, low 64 bits kept."""
    return int.from_bytes(digest[-8:], "big")


class KVEventPublisher(Listener):
    """Publishes ``source``'s prefix-cache events (an :class:`~kvlab.Engine` with a paged memory and prefix
    caching, or a :class:`~kvlab.PrefixCache`) in vLLM's wire format until :meth:`close` (or a ``with`` block
    ends). :attr:`buffer` holds the last ``buffer_steps`` batches sent, ``(seq, batch)``."""

    def __init__(self, source: Any, *, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, topic: str = "", data_parallel_rank: int = 0,
                 medium: str = MEDIUM_GPU) -> None:
        import zmq

        cache = source if isinstance(source, PrefixCache) else getattr(getattr(source, "memory", None), "cache",
                                                                       None)
        if not isinstance(cache, PrefixCache):
            raise ConfigError(f"KV events come from a prefix cache: give an Engine built with memory='paged' and "
                              f"prefix_caching=True, or a PrefixCache; got {source!r:.80}")
        for name, value in (("endpoint", endpoint), ("topic", topic), ("medium", medium)):
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a str, got {value!r:.80}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise ConfigError(f"replay_endpoint must be a str or None, got {replay_endpoint!r:.80}")
        self.cache, self.endpoint, self.replay_endpoint = cache, endpoint, replay_endpoint
        self.buffer_steps = check_positive(buffer_steps, "buffer_steps")
        self.hwm = check_count(hwm, "hwm")
        self.topic, self.medium = topic, medium
        self.data_parallel_rank = check_count(data_parallel_rank, "data_parallel_rank")
        self.buffer: deque[tuple[int, KVEventBatch]] = deque(maxlen=self.buffer_steps)
        self.seq = 0  # the next batch's
        self.events_sent = 0
        self._pending: list[KVEvent] = []
        self._lock = threading.Lock()  # the buffer, between the engine's thread and the replay thread
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        try:
            self._pub.linger = 1000  # ms to get the last batches out at close
            self._pub.sndhwm = self.hwm
            (self._pub.bind if publisher_binds(endpoint) else self._pub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.linger = 0
                self._replay.sndhwm = 2 * (self.buffer_steps + 1)  # a full replay and its end marker
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ConfigError(f"cannot open KV event endpoint {endpoint!r} (replay {replay_endpoint!r}): {e}") \
                from None
        bus = cache.pool.events
        super().__init__(bus)
        self._pending = [AllBlocksCleared(), *self._snapshot()]
        self.flush()
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replay, args=(self._replay,), daemon=True,
                                            name="kvlab-kvevents-replay")
            self._thread.start()

    def _snapshot(self) -> list[BlockStored]:
        """The blocks cached now, each after its parent (one BlockStored per block)."""
        live = (self.cache.entry(b) for b in self.cache.entries())  # entries() keeps stale ones too
        entries = sorted((e for e in live if e is not None), key=lambda e: e[0])
        known: set[bytes] = set()
        out: list[BlockStored] = []
        while entries:
            ready = [e for e in entries if e[1] is None or e[1] in known]
            if not ready:  # cannot happen while the cache keeps its chains whole; send the rest as they are
                ready = entries
            for digest, parent, tokens in ready:
                out.append(self._stored(digest, parent, list(tokens)))
                known.add(digest)
            entries = [e for e in entries if e[0] not in known]
        return out

    def _stored(self, digest: bytes, parent: bytes | None, tokens: list[int]) -> BlockStored:
        return BlockStored([external_hash(digest)], None if parent is None else external_hash(parent), tokens,
                           self.cache.block_size, None, self.medium, None, group_idx=0)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, PrefixStored):
            entry = self.cache.entry(event.block_id)  # what the event does not carry: its parent and tokens
            if entry is None:  # cannot happen: the cache publishes once the block is registered
                return
            digest, parent, tokens = entry
            h, up = external_hash(digest), None if parent is None else external_hash(parent)
            last = self._pending[-1] if self._pending else None
            ids = list(tokens)
            if isinstance(last, BlockStored) and up is not None and last.block_hashes[-1] == up:
                last.block_hashes.append(h)
                last.token_ids.extend(ids)
            else:
                self._pending.append(BlockStored([h], up, ids, self.cache.block_size, None, self.medium, None,
                                                 group_idx=0))
        elif isinstance(event, PrefixEvicted):
            self._pending.append(BlockRemoved([external_hash(bytes.fromhex(event.digest))], self.medium, 0))
        elif isinstance(event, StepMetrics):
            self.flush()

    def flush(self) -> int | None:
        """Send the events gathered since the last batch as one batch; returns its seq (None: nothing to send)."""
        if not self._pending:
            return None
        batch = KVEventBatch(time.time(), self._pending, self.data_parallel_rank)
        self._pending = []
        seq = self.seq
        self._pub.send_multipart([self.topic.encode(), seq_bytes(seq), encode_batch(batch)])
        with self._lock:
            self.buffer.append((seq, batch))
        self.seq += 1
        self.events_sent += len(batch.events)
        return seq

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        """The replay service (its own thread; the ROUTER is used nowhere else): ``[id, b"", start]`` in,
        ``[id, b"", topic, seq, payload]`` for each buffered batch from ``start`` out, then
        ``[id, b"", b"", seq -1, b""]``."""
        topic = self.topic.encode()
        while not self._stop.is_set():
            try:
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    log.warning("kvlab kvevents: a replay request is [id, b'', 8-byte seq], got %d frames",
                                len(frames))
                    continue
                start = int.from_bytes(frames[2], "big")
                with self._lock:
                    batches = [(s, b) for s, b in self.buffer if s >= start]
                for s, b in batches:
                    router.send_multipart([frames[0], b"", topic, seq_bytes(s), encode_batch(b)])
                router.send_multipart([frames[0], b"", b"", seq_bytes(END_SEQ), b""])
            except Exception:  # a request gone bad must not end the service
                if self._stop.is_set():
                    return
                log.exception("kvlab kvevents: replay request failed")

    def close(self) -> None:
        """Send what is pending, stop listening, stop the replay service, close the sockets. Twice is harmless."""
        if not self.listening:
            return
        super().close()
        self.flush()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()


__all__ = ["KVEventPublisher", "MEDIUM_GPU", "external_hash", "publisher_binds"]
