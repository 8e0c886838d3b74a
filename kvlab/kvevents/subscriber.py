"""Follow a serving engine's KV event stream (vLLM's or SGLang's, or kvlab's own) as a task on the running asyncio
loop, so a notebook stays responsive while it listens.

The idea: a ZeroMQ SUB socket receives ``[topic, seq, payload]`` messages; ``seq`` says what was lost. Each batch
is delivered once, in seq order, as a :class:`Received` (to the ``on_batch`` callbacks and to ``async for``):

* a **gap** (seq jumps ahead) is filled from the server's replay service when ``replay_endpoint`` is given: a
  DEALER sends ``[b"", start seq as 8 bytes]`` to its ROUTER and reads batches until the end marker (seq -1).
  What replay cannot fill is counted and the next batch carries ``missed``, so a view can mark the hole. With a
  replay endpoint the subscriber first fetches what the server's buffer holds (``catch_up``), so joining a
  running server, even a quiet one, shows its cache's recent history;
* a **restart** (the live seq goes back to 0) starts a new stream: ``restarted`` tells a view to forget;
* **duplicates**, **out-of-order** seqs, **malformed** messages (not 3 frames, a seq not 8 bytes), **oversized**
  or unreadable payloads and unknown event types or fields are counted in :attr:`Subscriber.stats`, each with a
  warning, and never raise: the task survives anything but :meth:`~Subscriber.close`;
* **silence**: when nothing arrives for ``silence_s`` the warning (once per silence) explains who binds (below),
  and a connecting socket connects afresh.

Who binds: vLLM's and SGLang's publisher *binds* only when its endpoint holds ``*`` or ``::`` or is ``ipc://`` or
``inproc://``; otherwise it *connects*. So for a server started with ``tcp://*:5557`` give ``tcp://SERVER:5557``
here (this side connects); for one given ``tcp://THIS-HOST:5557``, listen here with ``tcp://*:5557`` (a wildcard
host makes this side bind). Memory is bounded: the last ``keep`` batches in :attr:`Subscriber.recent`, at most
``keep`` waiting for ``async for`` (older ones dropped and counted), notes capped.
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlab.core.checks import check_flag, check_positive, check_real
from kvlab.core.errors import ConfigError, KVEventError, NoEventsError
from kvlab.kvevents.wire import END_SEQ, MAX_PAYLOAD, KVEventBatch, decode_batch, seq_bytes, split_message, split_replay

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger(__name__)
_ENDPOINT = re.compile(r"(tcp://(?P<host>\[[0-9a-fA-F:.]*\]|[^:/\[\]]+):(?P<port>\d{1,5})|(ipc|inproc)://.+)\Z")
_WILDCARDS = ("*", "[::]", "0.0.0.0")
_POLL_MS = 100  # how often the task looks up from the socket (close, catch_up)


@dataclass(slots=True)
class Received:
    """One batch, delivered once and in seq order. ``missed``: batches lost just before it (a hole a view should
    mark); ``replayed``: it came from the replay service; ``restarted``: the publisher started again here (seq
    back to 0), so everything received before describes a cache that is gone."""
    seq: int
    batch: KVEventBatch
    topic: bytes = b""
    replayed: bool = False
    missed: int = 0
    restarted: bool = False


@dataclass(slots=True)
class Stats:
    """What the subscriber saw. ``notes`` counts what the decoder skipped (unknown event types and fields)."""
    messages: int = 0  # live messages received
    batches: int = 0  # batches delivered
    events: int = 0  # events in them
    replayed: int = 0  # batches delivered from the replay service
    gaps: int = 0  # holes in the seqs, and the batches lost in them (after replay)
    missed: int = 0
    duplicates: int = 0  # a seq already delivered
    out_of_order: int = 0  # a live seq behind the last one (not a restart)
    restarts: int = 0
    malformed: int = 0  # messages of the wrong shape, payloads that are no batch
    oversized: int = 0  # payloads over the cap
    dropped: int = 0  # batches ``async for`` did not take in time (the oldest go)
    replay_failures: int = 0  # replays that did not end within replay_timeout_s
    silences: int = 0  # times nothing arrived for silence_s
    reconnects: int = 0
    errors: int = 0  # socket errors and callbacks that raised
    joined_at: int | None = None  # the first seq seen
    notes: Counter[str] = field(default_factory=Counter)


class Subscriber:
    """Listens to ``endpoint`` (see the module docstring for which side binds) for ``topic`` (a prefix, as ZeroMQ
    matches it; "" takes every topic). Start it on the running loop with :meth:`start`, or ``async with``."""

    def __init__(self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None, keep: int = 1024,
                 max_payload: int = MAX_PAYLOAD, silence_s: float = 10.0, replay_timeout_s: float = 2.0,
                 catch_up: bool = True, on_batch: Callable[[Received], Any] | None = None,
                 on_warning: Callable[[str], Any] | None = None) -> None:
        self.endpoint, self.binds = _check_endpoint(endpoint, "endpoint")
        if replay_endpoint is not None:
            replay_endpoint, replay_binds = _check_endpoint(replay_endpoint, "replay_endpoint")
            if replay_binds:
                raise ConfigError(f"replay_endpoint {replay_endpoint!r}: the server's replay service binds, so "
                                  f"name its host, e.g. tcp://SERVER:5558, not a wildcard")
        if not isinstance(topic, str):
            raise ConfigError(f"topic must be a str (the publisher's topic, '' for every one), got {topic!r:.80}")
        for fn in (on_batch, on_warning):
            if fn is not None and not callable(fn):
                raise ConfigError(f"on_batch and on_warning must be callable or None, got {fn!r:.80}")
        self.topic, self.replay_endpoint = topic, replay_endpoint
        self.keep = check_positive(keep, "keep")
        self.max_payload = check_positive(max_payload, "max_payload")
        self.silence_s = check_real(silence_s, "silence_s", 0, lo_open=True)
        self.replay_timeout_s = check_real(replay_timeout_s, "replay_timeout_s", 0, lo_open=True)
        self.callbacks: list[Callable[[Received], Any]] = [on_batch] if on_batch is not None else []
        self._on_warning = on_warning
        self.stats = Stats()
        self.recent: deque[Received] = deque(maxlen=self.keep)
        self.warnings: deque[str] = deque(maxlen=100)
        self._queue: deque[Received] | None = None  # made by the first ``async for``
        self._ready = asyncio.Event()
        self._last = -1  # the last seq delivered (or lost) in this stream
        self._live: int | None = None  # the last seq of the live stream
        self._behind: int | None = None  # the last live seq that came behind it
        self._lost = 0  # batches lost since the last delivery
        self._restarted = False  # the publisher restarted since the last delivery
        # a replay service holds the server's last batches: fetch them first (a quiet server sends nothing live)
        self._catch_up = check_flag(catch_up, "catch_up") and replay_endpoint is not None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------------ life
    def start(self) -> asyncio.Task[None]:
        """Run on the running loop (a notebook cell's); returns the task. :class:`ConfigError` with no running
        loop, or once started."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError("a Subscriber runs as a task on a running asyncio loop: start it in a notebook cell, "
                              "or inside asyncio.run (async with Subscriber(...) as sub: ...)") from None
        if self._task is not None:
            raise ConfigError("this Subscriber is already started; make a new one to listen again")
        self._task = loop.create_task(self._run(), name=f"kvlab-kvevents {self.endpoint}")
        return self._task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def close(self) -> None:
        """Stop listening (its sockets close as the task ends, on the loop). Closing twice is harmless."""
        if self._task is not None:
            self._task.cancel()
        self._ready.set()

    async def aclose(self) -> None:
        """Stop listening and wait until the sockets are closed."""
        self.close()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self) -> Subscriber:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def catch_up(self) -> None:
        """Ask the replay service for every batch after the last one delivered (all it holds, before the first);
        :class:`ConfigError` without a replay endpoint."""
        if self.replay_endpoint is None:
            raise ConfigError("catch_up needs the server's replay endpoint (replay_endpoint=...)")
        self._catch_up = True

    def subscribe(self, fn: Callable[[Received], Any]) -> Callable[[], None]:
        """Call ``fn`` with each batch delivered (a callback that raises is counted in ``stats.errors`` and
        warned about); returns a function that unsubscribes it."""
        if not callable(fn):
            raise ConfigError(f"a callback must be callable (it is called with each batch), got {fn!r:.80}")
        self.callbacks.append(fn)
        return lambda: self.callbacks.remove(fn) if fn in self.callbacks else None

    def __aiter__(self) -> AsyncIterator[Received]:
        """The batches delivered from now on (at most ``keep`` waiting: older ones are dropped and counted);
        ends when the subscriber is closed."""
        if self._queue is None:  # made now, not at the first step: batches wait for the first read
            self._queue = deque(maxlen=self.keep)
        return self._iterate(self._queue)

    async def _iterate(self, queue: deque[Received]) -> AsyncIterator[Received]:
        while True:
            while queue:
                yield queue.popleft()
            if not self.running and self._task is not None:
                return
            self._ready.clear()
            await self._ready.wait()

    def wait_silence_error(self) -> NoEventsError:
        """The error (not raised) that says nothing arrived for ``silence_s``, and who must bind."""
        return NoEventsError(silence_advice(self.endpoint, self.binds, self.silence_s))

    # ------------------------------------------------------------------------------------------ the task
    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        loop = asyncio.get_running_loop()
        sub: zmq.asyncio.Socket | None = None
        try:
            while True:
                try:
                    sub = sub or self._open(ctx)
                    quiet_since, told = loop.time(), False
                    while True:
                        if self._catch_up:
                            self._catch_up, before = False, self.stats.batches
                            await self._replay(ctx, self._last + 1, None)
                            if self.stats.batches > before:
                                quiet_since = loop.time()
                        if await sub.poll(_POLL_MS):
                            await self._take(ctx, await sub.recv_multipart())
                            quiet_since, told = loop.time(), False
                        elif loop.time() - quiet_since >= self.silence_s:
                            self.stats.silences += 1
                            if not told:  # once per silence: it may last all night
                                self._warn(str(self.wait_silence_error()))
                                told = True
                            if not self.binds:  # connect afresh (the name may point elsewhere now)
                                sub.close(linger=0)
                                sub = self._open(ctx)
                                self.stats.reconnects += 1
                            quiet_since = loop.time()
                except Exception as e:  # a port taken, an address gone, a bug: say so, try again later
                    self.stats.errors += 1
                    self._warn(f"{self.endpoint}: {e}; 稍后重试 (trying again in {self.silence_s:g} s)")
                    if sub is not None:
                        sub.close(linger=0)
                        sub = None
                    await asyncio.sleep(self.silence_s)
        finally:
            ctx.destroy(linger=0)
            self._ready.set()

    def _open(self, ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        import zmq

        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        if "[" in self.endpoint:
            sub.ipv6 = True
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        if self.binds:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        return sub

    async def _take(self, ctx: zmq.asyncio.Context, frames: list[bytes]) -> None:
        """One live message: classify its seq, fill a gap before it, deliver it."""
        self.stats.messages += 1
        framed = self._framed(split_message, frames, "格式错误的消息 (malformed message)")
        if framed is None:
            return
        topic, seq, payload = framed
        live = self._live
        if live is not None and seq <= live:
            if seq == live:
                self.stats.duplicates += 1
                self._warn(f"重复的 seq (duplicate seq) {seq}, skipped")
                return
            if seq != 0 and (self._behind is None or seq != self._behind + 1):
                self._behind = seq
                self.stats.out_of_order += 1
                self._warn(f"乱序的 seq (out-of-order seq) {seq} after {live}, skipped")
                return
            self.stats.restarts += 1  # back to 0, or a second seq in a row behind: a new stream
            self._warn(f"发布端重启 (publisher restarted): seq {seq} after {live}; earlier events describe a "
                       f"cache that is gone")
            self._last, self._lost, self._restarted = -1, 0, True
        elif live is None:
            self.stats.joined_at = seq
        self._live, self._behind = seq, None
        if seq <= self._last:  # already delivered by a replay
            self.stats.duplicates += 1
            return
        if seq > self._last + 1 and self.replay_endpoint is not None:
            await self._replay(ctx, self._last + 1, seq)
        if seq > self._last + 1:
            self._lose(seq - self._last - 1, seq)
        self._deliver(seq, payload, topic, replayed=False)

    def _framed(self, split: Callable[[list[bytes]], tuple[bytes, int, bytes]], frames: list[bytes],
                what: str) -> tuple[bytes, int, bytes] | None:
        """``split(frames)``: (topic, seq, payload), or None after counting and saying why it is malformed."""
        try:
            return split(frames)
        except KVEventError as e:
            self.stats.malformed += 1
            self._warn(f"{what}, skipped: {e}")
            return None

    def _lose(self, n: int, before: int) -> None:
        self._lost += n
        self.stats.missed += n
        self.stats.gaps += 1
        why = ("joined a running stream" if not self.stats.batches else "batches lost in transit") + (
            "; the replay service did not have them" if self.replay_endpoint is not None else
            "; give the server's replay endpoint to fetch them")
        self._warn(f"缺失 {n} 批 (missed {n} batches) before seq {before}: {why}")

    async def _replay(self, ctx: zmq.asyncio.Context, start: int, stop: int | None) -> None:
        """Deliver the buffered batches ``start <= seq < stop`` (None: all) the replay service sends."""
        import zmq

        assert self.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        try:
            if "[" in self.replay_endpoint:
                dealer.ipv6 = True
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", seq_bytes(start)])
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    self.stats.replay_failures += 1
                    self._warn(f"重放无应答 (the replay service at {self.replay_endpoint} sent nothing for "
                               f"{self.replay_timeout_s:g} s)")
                    return
                framed = self._framed(split_replay, await dealer.recv_multipart(),
                                      "格式错误的重放 (malformed replay reply)")
                if framed is None:
                    continue
                topic, seq, payload = framed
                if seq == END_SEQ:
                    return
                if seq > self._last and (stop is None or seq < stop):
                    if seq > self._last + 1:
                        self._lose(seq - self._last - 1, seq)
                    self._deliver(seq, payload, topic, replayed=True)
        finally:
            dealer.close(linger=0)

    def _deliver(self, seq: int, payload: bytes, topic: bytes, *, replayed: bool) -> None:
        self._last = seq
        notes = self.stats.notes
        known = len(notes)
        try:
            batch = decode_batch(payload, max_bytes=self.max_payload, notes=notes)
        except KVEventError as e:
            if len(payload) > self.max_payload:
                self.stats.oversized += 1
            else:
                self.stats.malformed += 1
            self._lost += 1
            self._warn(f"seq {seq}: {e}; skipped")
            return
        if len(notes) > known:  # something new skipped: said once, counted in stats.notes from now on
            self._warn(f"seq {seq}: 跳过 (skipped) {', '.join(list(notes)[known:])}; counted in stats.notes")
        got = Received(seq, batch, topic, replayed, self._lost, self._restarted)
        self._lost, self._restarted = 0, False
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.replayed += replayed
        self.recent.append(got)
        if self._queue is not None:
            if len(self._queue) == self._queue.maxlen:
                self.stats.dropped += 1
            self._queue.append(got)
            self._ready.set()
        for fn in list(self.callbacks):
            try:
                fn(got)
            except Exception as e:  # a view's bug must not stop the stream
                self.stats.errors += 1
                self._warn(f"callback {fn!r:.60} raised {e!r:.200}")

    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        if self._on_warning is None:
            log.warning("kvlab kvevents: %s", text)
            return
        try:
            self._on_warning(text)
        except Exception:  # the warning hook's own bug: log it and go on
            log.exception("kvlab kvevents: on_warning raised on %r", text)


def _check_endpoint(endpoint: object, what: str) -> tuple[str, bool]:
    """``endpoint`` and whether this side binds (a wildcard host); :class:`ConfigError` for what ZeroMQ would
    refuse only later."""
    if not isinstance(endpoint, str) or not (m := _ENDPOINT.match(endpoint)):
        raise ConfigError(f"{what} must be a ZeroMQ endpoint like tcp://HOST:5557, tcp://*:5557 (listen) or "
                          f"ipc:///tmp/kv.sock, got {endpoint!r:.100}")
    if m["port"] is not None and not 0 < int(m["port"]) < 65536:
        raise ConfigError(f"{what} {endpoint!r}: the port must be 1..65535")
    return endpoint, m["host"] in _WILDCARDS


def silence_advice(endpoint: str, binds: bool, seconds: float) -> str:
    """Why nothing may have arrived from ``endpoint`` in ``seconds``: who binds, who connects, what to check."""
    rule = ("vLLM/SGLang 的发布端仅当端点含 * 或 :: 或为 ipc:// inproc:// 时 bind, 否则 connect "
            "(the server's publisher binds only when its endpoint has * or :: or is ipc:// or inproc://; "
            "otherwise it connects)")
    port = endpoint.rpartition(":")[2]
    if binds:
        side = (f"this side listens on {endpoint}: the server must connect here, i.e. its kv-events endpoint names "
                f"this machine (tcp://THIS-HOST:{port}); if it has tcp://*:{port}, it binds too: connect instead "
                f"with tcp://SERVER:{port}")
    else:
        side = (f"this side connects to {endpoint}: the server must bind it (its kv-events endpoint "
                f"tcp://*:PORT); if its endpoint names a host, it connects too: listen instead with tcp://*:PORT")
    return (f"{seconds:g} 秒内未收到 KV 事件 (no KV events from {endpoint} in {seconds:g} s). {rule}; {side}. Also "
            f"check enable_kv_cache_events, the topic, and that the server has run a request.")


__all__ = ["Received", "Stats", "Subscriber", "silence_advice"]
