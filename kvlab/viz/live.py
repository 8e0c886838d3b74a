"""Live runs: step a workload on a pool and stream paced frames to views (text §2.2.2-§2.2.5 made visible).

Why an asyncio task and not a thread or a loop in the cell: a kernel handles widget clicks only between cells or
while its event loop runs; a loop inside a cell blocks it, and background threads are unreliable under
ipykernel 7. :meth:`LiveRun.start` schedules the run as a task on the kernel's own loop, which yields after
every step, so run / pause / step / speed clicks land between two steps and later cells still execute.

Why pacing: every frame is one websocket message; sending one per step would flood the browser and trip the
server's iopub rate limit, which silently drops messages. A :class:`Pacer` lets at most ``fps`` frames through
per second; a frame is built only when one is due, from the pool as it is then (so only the latest state is
sent), and the final state is always sent.
"""
from __future__ import annotations

import asyncio
import math
import random
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from kvlab.core.block import ALLOCATED, FREE, BlockStatus
from kvlab.core.checks import check_positive, check_real, check_seed
from kvlab.core.errors import ConfigError, OutOfBlocksError
from kvlab.core.interrupts import atomic, install
from kvlab.core.pool import BlockPool
from kvlab.viz.frames import Frame, FrameBuilder


def check_steps(value: Any, what: str) -> int | None:
    """``value`` as a number of steps >= 1, or None (no limit), else :class:`ConfigError` naming it."""
    return None if value is None else check_positive(value, what)


class FrameSink(Protocol):
    """Anything that shows frames: every view (``show_frame(frame)``, a :class:`~kvlab.viz.frames.Frame`: its
    bytes and what they hold). A sink that also has ``follow(run)`` is told which :class:`LiveRun` drives it, so
    its pause button can pause the workload."""

    def show_frame(self, frame: Frame) -> None: ...


class Recording:
    """Frames of a run in order, optionally keeping only the latest ``max_bytes`` worth."""

    def __init__(self, frames: Iterable[bytes] = (), *, max_bytes: int | None = None) -> None:
        self.frames: deque[bytes] = deque()
        self.max_bytes, self.nbytes, self.trimmed = max_bytes, 0, 0
        for f in frames:
            self.append(f)

    def append(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.nbytes += len(frame)
        while self.max_bytes is not None and self.nbytes > self.max_bytes and len(self.frames) > 1:
            self.nbytes -= len(self.frames.popleft())
            self.trimmed += 1

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, i: int) -> bytes:
        return self.frames[i]

    def __iter__(self):
        return iter(self.frames)


class Pacer:
    """Lets frames through ``fps`` times a second on a fixed cadence (``clock`` is injectable): the first frame
    marked starts the cadence, and frame k is due at ``start + k / fps``. A frame sent late (a slow step, a busy
    machine) does not push later ones back: the next is due at the first tick after it, so a stall skips only
    the ticks it covered and the run keeps its rate. A frame sent before it was due (a forced one: a pause, a
    step, the end of a run) leaves the cadence as it was."""

    def __init__(self, fps: float = 30.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.interval, self.clock = 1.0 / check_real(fps, "fps", lo=0, lo_open=True), clock
        self.start: float | None = None
        self.ticks = 0  # the next frame is due at start + ticks * interval

    @property
    def next(self) -> float:
        """When the next frame is due (-inf before the first)."""
        return -math.inf if self.start is None else self.start + self.ticks * self.interval

    def due(self) -> bool:
        return self.clock() >= self.next

    def mark(self) -> None:
        """A frame is being sent now."""
        now = self.clock()
        if self.start is None:
            self.start, self.ticks = now, 1
        elif now >= self.next:  # max: never due again in the tick just served, whatever the rounding
            self.ticks = max(self.ticks + 1, math.floor((now - self.start) / self.interval) + 1)


StepFn = Callable[[], bool]


@atomic("_end _interrupted")  # the final frame and the closing are never cut short
class LiveRun:
    """Run ``step_fn`` (one step of a workload on ``pool``; returns False when the workload is done) and stream
    paced frames to ``views``. Every sent frame is kept in ``recording`` (up to ``record_bytes``).

    Frames say which step of the workload they show and of how many: ``total_steps``, else ``max_steps``, else
    the ``steps`` of a :class:`RandomWorkload`. Functions in ``on_state`` are called with each new state.

    Invariants: at most ``fps`` frames a second (on the :class:`Pacer`'s cadence), each built from the pool at
    send time; the state after the last step is always sent (also on stop, pause, interrupt and failure); once
    :meth:`stop` returns or the task ends, no task of this run is left on the loop. An interrupted :meth:`run` or
    :meth:`step` (Ctrl-C, "interrupt kernel") pauses the run, and it can go on.
    """

    def __init__(self, pool: BlockPool, step_fn: StepFn, views: Iterable[FrameSink] = (), *, fps: float = 30.0,
                 steps_per_second: float | None = None, max_steps: int | None = None,
                 total_steps: int | None = None, record_bytes: int | None = 256 << 20,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(pool, BlockPool) or not callable(step_fn):
            raise ConfigError(f"a LiveRun steps a callable on a BlockPool, got {pool!r:.80} and {step_fn!r:.80}")
        self.pool, self.step_fn, self.views = pool, step_fn, list(views)
        self.pacer = Pacer(fps, clock)
        self.steps_per_second = (None if steps_per_second is None
                                 else check_real(steps_per_second, "steps_per_second", lo=0, lo_open=True))
        self.max_steps = check_steps(max_steps, "max_steps")
        check_steps(total_steps, "total_steps")
        self.builder = FrameBuilder(pool)
        if total_steps is None:
            total_steps = max_steps if max_steps is not None else (
                step_fn.steps if isinstance(step_fn, RandomWorkload) else None)
        self.builder.step, self.builder.steps = 0, total_steps
        self.recording = Recording(max_bytes=record_bytes)
        self.steps = self.frames_sent = 0
        self.on_state: list[Callable[[str], None]] = []
        self._state = "idle"  # idle | running | paused | stopping | done | stopped | failed
        self.error: BaseException | None = None
        self.task: asyncio.Task | None = None
        self._resume = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the task's loop, and the thread that runs it
        self._loop_thread = 0
        self._resume.set()
        for v in self.views:
            follow = getattr(v, "follow", None)
            if callable(follow):
                follow(self)

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        if value != self._state:
            self._state = value
            for fn in self.on_state:
                fn(value)

    # ------------------------------------------------------------------ frames
    def send(self, force: bool = False) -> bool:
        """Send the pool's current frame to every view if one is due (or ``force``); True if sent."""
        if not (force or self.pacer.due()):
            return False
        self.pacer.mark()  # marked when it begins, however long sending it takes; a forced frame keeps the cadence
        frame = self.builder.frame()  # encoded once; every view gets the same Frame, none decodes it
        for v in self.views:
            v.show_frame(frame)
        self.recording.append(frame.data)
        self.frames_sent += 1
        return True

    # ------------------------------------------------------------------ stepping
    @property
    def finished(self) -> bool:
        return self.state in ("done", "stopped", "failed")

    def _one(self) -> bool:
        """One step; False when the workload (or ``max_steps``) is done."""
        self.builder.step = self.steps + 1  # events of this step belong to it
        more = bool(self.step_fn())
        self.steps += 1
        return more and (self.max_steps is None or self.steps < self.max_steps)

    def _end(self, state: str) -> None:
        if self.error is not None:  # a pool call stopped half-way publishes no event for what it had changed
            self.builder.resync()
        self.send(force=True)
        self.builder.close()
        self.state = state  # last: whoever hears of the end finds the final frame already sent

    def _interrupted(self) -> None:
        """An interrupted cell (Ctrl-C) pauses the run: the views get the pool exactly as the interrupt left it
        (re-read: a step cut short may have changed it without an event), and ``run()``, ``step()`` or
        ``start()`` goes on from there."""
        self.builder.resync()
        self.state = "paused"
        self.send(force=True)

    def step(self) -> bool:
        """Exactly one step now, its frame always sent (the Step button). False once the run is over (from
        another thread than the task's: the step is handed to its loop, and this says whether the run was on)."""
        if self.finished:
            return False
        if self._elsewhere(self.step):
            return True
        state = "paused" if self.state == "idle" else self.state
        return self._steps(1, state, state, paced=False) > 0 and not self.finished

    def run(self, max_steps: int | None = None) -> int:
        """Step in the calling code until done (or ``max_steps`` more steps), sending paced frames; returns the
        number of steps taken. Use in scripts and tests; in a notebook this blocks the kernel (no clicks)."""
        if self.finished:
            return 0
        return self._steps(max_steps, "running", "paused", paced=True)

    def _steps(self, max_steps: int | None, during: str, after: str, paced: bool) -> int:
        """Up to ``max_steps`` steps in state ``during``, then ``after`` (or done), the state sent (and, if
        ``paced``, frames as they are due after each step); an interrupt pauses the run."""
        n, more = 0, True
        try:
            self.state = during
            while more and (max_steps is None or n < max_steps):
                more = self._one()
                n += 1
                if paced:
                    self.send()
            if more:
                self.state = after
                self.send(force=True)
            else:
                self._end("done")
        except KeyboardInterrupt:
            if not self.finished:
                self._interrupted()
            raise
        except BaseException as e:
            self.error = e
            self._end("failed" if isinstance(e, Exception) else "stopped")
            raise
        return n

    # ------------------------------------------------------------------ the asyncio task
    def start(self) -> asyncio.Task:
        """Run as a task on the running event loop (in a notebook, the kernel's). Returns the task."""
        if self.finished:
            raise ConfigError(f"this run is {self.state}; make a new LiveRun")
        if self.task is not None and not self.task.done():
            return self.task
        self.state = "running"
        self._resume.set()
        self._loop, self._loop_thread = asyncio.get_event_loop(), threading.get_ident()
        self.task = self._loop.create_task(self._run_task())
        return self.task

    async def _run_task(self) -> None:
        try:
            while True:
                _between_cells.hear(self)
                if self.state == "paused":
                    await self._resume.wait()
                    continue
                more = self._one()
                self.send()
                if not more:
                    self._end("done")
                    return
                # Yield to the loop after every step so clicks and cells run between steps.
                await asyncio.sleep(1.0 / self.steps_per_second if self.steps_per_second else 0)
        except asyncio.CancelledError:
            self._end("stopped")
            raise
        except Exception as e:
            self.error = e
            self._end("failed")
            raise
        finally:
            _between_cells.forget(self)

    def _elsewhere(self, fn: Callable[[], Any]) -> bool:
        """Hand ``fn`` to the task's loop if this is another thread, and say so. ipywidgets may deliver a click on
        a kernel subshell's thread while a cell awaits the run; asyncio's objects belong to their loop's thread
        (an ``Event`` set from another one never wakes its waiter: the run stayed paused for good)."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread or loop.is_closed():
            return False
        loop.call_soon_threadsafe(fn)
        return True

    def pause(self) -> None:
        """Stop stepping (the task waits); the current state is sent so the view is exact."""
        if self._elsewhere(self.pause):
            return
        if self.state == "running":
            self._resume.clear()
            self.send(force=True)
            self.state = "paused"  # last: whoever hears of the pause finds its frame already sent

    def pause_soon(self) -> None:
        """Pause between two steps, from the loop's queue: safe where the run may be mid-step (a signal
        handler runs between any two bytecodes of the loop's thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.pause)

    def resume(self) -> None:
        if self._elsewhere(self.resume):
            return
        if self.state == "paused":
            self.state = "running"
            self._resume.set()

    def stop(self) -> None:
        """End the run: cancel its task (if any) and send the final frame. Idempotent."""
        if self._elsewhere(self.stop):
            return
        if self.task is not None and not self.task.done():
            self.task.cancel()
            self.state = "stopping"
            self._resume.set()
        elif not self.finished:
            self._end("stopped")

    def __await__(self):
        """``await run`` waits for the task; if the awaiting cell is interrupted, the task is cancelled too."""
        if self.task is None:
            self.start()
        return self._wait().__await__()

    async def _wait(self) -> None:
        task = self.task if self.task is not None else self.start()
        loop = asyncio.get_running_loop()
        interrupt = loop.create_future()
        # While the cell waits, the kernel's thread sits in the loop's select (a paused run takes no step): a
        # KeyboardInterrupt raised there never reaches the cell. The loop's own SIGINT handler wakes the wait.
        def on_sigint() -> None:
            if not interrupt.done():
                interrupt.set_result(None)

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
            handled = True
        except (RuntimeError, NotImplementedError, ValueError):  # not the main thread, or no signals here
            handled = False
        try:
            await asyncio.wait([task, interrupt], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # interrupted: the run stops with the wait
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise KeyboardInterrupt
            await task  # its outcome: None, its error, or CancelledError if it was stopped
        except asyncio.CancelledError:
            if not task.done():  # the awaiter was cancelled, not the task: stop it as well
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            interrupt.cancel()
            if handled:
                loop.remove_signal_handler(signal.SIGINT)
                install()  # kvlab's handler again (removing the loop's leaves Python's)


class _BetweenCells:
    """Kernel > Interrupt while no cell runs pauses the runs going on in the background (``start()``, not
    awaited), as an interrupted ``run()`` does. ipykernel ignores SIGINT between cells (``SIG_IGN``; for each
    cell it puts Python's handler in and the previous one back after), so a background run would never hear the
    interrupt. While such runs exist, this handler takes the place of the ignore, and ipykernel still swaps it out
    for every cell, so interrupting a cell works as before. Anywhere else (a script: SIGINT raises there) nothing
    changes."""

    def __init__(self) -> None:
        self.runs: list[LiveRun] = []

    def hear(self, run: LiveRun) -> None:
        """Called by a run's task before each step, on the loop's thread."""
        if run not in self.runs:
            self.runs.append(run)
        if (threading.current_thread() is threading.main_thread() and "ipykernel" in sys.modules
                and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
            signal.signal(signal.SIGINT, self._on_sigint)

    def forget(self, run: LiveRun) -> None:
        """The run's task ended: once none is left, SIGINT is ignored between cells again."""
        if run in self.runs:
            self.runs.remove(run)
        if (not self.runs and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) == self._on_sigint):
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_sigint(self, _signum: int, _frame: Any) -> None:
        for run in self.runs:
            run.pause_soon()


_between_cells = _BetweenCells()


def record(pool: BlockPool, step_fn: StepFn, steps: int, every: int = 1) -> Recording:
    """Run ``steps`` steps (fewer if ``step_fn`` finishes) building a frame every ``every`` steps and after the
    last: a recording to replay or export, made without a kernel or pacing."""
    if check_steps(steps, "steps") is None or check_steps(every, "every") is None:
        raise ConfigError(f"record needs a number of steps and a frame interval, got steps={steps!r}, "
                          f"every={every!r}")
    rec = Recording()
    with FrameBuilder(pool) as b:
        b.step, b.steps = 0, steps
        rec.append(b.build())
        for i in range(1, steps + 1):
            b.step = i
            more = step_fn()
            if i % every == 0 or not more or i == steps:
                rec.append(b.build())
            if not more:
                break
    return rec


# ---------------------------------------------------------------------------- a built-in workload
# Requests are as long in tokens whatever the block size (lengths are drawn in units of TOKEN_UNIT tokens, not of
# blocks): a bigger block then holds the same requests with more empty slots, which is 2.2.1's point.
TOKEN_UNIT = 16
PRESETS: dict[str, dict[str, float]] = {
    # op weights; "tokens" is the longest sequence in units of TOKEN_UNIT tokens
    "steady": {"admit": 3, "grow": 4, "finish": 3, "share": 1, "unshare": 1, "evict": 0.3, "swap": 0.3,
               "reserve": 0.5, "compact": 0, "tokens": 6},
    "bursty": {"admit": 5, "grow": 1, "finish": 2.5, "share": 0.3, "unshare": 0.3, "evict": 0.5, "swap": 0.2,
               "reserve": 1, "compact": 0, "tokens": 24},
    "sharing": {"admit": 2, "grow": 2, "finish": 2, "share": 4, "unshare": 3, "evict": 0.5, "swap": 0.2,
                "reserve": 0.2, "compact": 0, "tokens": 8},
    "defrag": {"admit": 3, "grow": 2, "finish": 3.2, "share": 0.5, "unshare": 0.5, "evict": 0.2, "swap": 0.1,
               "reserve": 0.2, "compact": 0.6, "tokens": 8},
}


@atomic("__call__ close")  # an interrupt lands between steps: the workload's lists always match the pool
class RandomWorkload:
    """A seeded random workload over a pool, one operation per call: admit a sequence (blocks for its tokens,
    half of them marked reusable), grow one, finish one (its reusable blocks become cached), share and unshare
    blocks (incref / free), evict, swap a cached block out (ALLOCATED -> EVICTING -> FREE), reserve and commit
    (PENDING), and for the ``defrag`` preset compact (move the highest blocks into the lowest holes).

    It holds exactly the references it took, so the pool's invariants hold after every step. Call it as the
    ``step_fn`` of a :class:`LiveRun`; it returns False after ``steps`` calls (never, if ``steps`` is None).
    """

    def __init__(self, pool: BlockPool, *, preset: str = "steady", seed: int = 0, steps: int | None = None) -> None:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(f"unknown workload preset {preset!r}; choose one of {sorted(PRESETS)}")
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a RandomWorkload runs on a BlockPool, got {pool!r:.80}")
        seed = check_seed(seed)
        self.pool, self.preset, self.steps, self.done = pool, preset, check_steps(steps, "steps"), 0
        self.rng = random.Random(seed)
        w = PRESETS[preset]
        self.max_tokens = int(w["tokens"]) * TOKEN_UNIT
        self.ops = [op for op in w if op != "tokens" and w[op]]
        self.weights = [w[op] for op in self.ops]
        self.seqs: dict[int, list[int]] = {}  # owner -> blocks it references (one reference each)
        self.tokens: dict[int, int] = {}  # owner -> tokens
        self.shared: list[int] = []  # extra references we hold
        self.pending: list[tuple[int, list[int]]] = []
        self.evicting: list[int] = []
        self.next_owner = 0
        pool.relocation_hooks.append(self._relocate)

    def close(self) -> None:
        if self._relocate in self.pool.relocation_hooks:
            self.pool.relocation_hooks.remove(self._relocate)

    def _relocate(self, src: np.ndarray, dst: np.ndarray) -> None:
        moved = dict(zip(src.tolist(), dst.tolist()))
        for blocks in self.seqs.values():
            blocks[:] = [moved.get(b, b) for b in blocks]
        self.shared = [moved.get(b, b) for b in self.shared]

    def __call__(self) -> bool:
        # Finish swaps and commit reservations first: those states are short-lived, as in a real engine.
        if self.evicting and self.rng.random() < 0.5:
            self.pool.finish_eviction([self.evicting.pop(0)])
        elif self.pending and self.rng.random() < 0.5:
            owner, blocks = self.pending.pop(0)
            self.pool.commit(blocks)
            self._own(owner, blocks, len(blocks) * self.pool.block_size)
        elif self.pool.num_free_blocks < self.pool.num_blocks // 5 and self.rng.random() < 0.5:
            self._finish()  # a crude admission control keeps the pool from sitting full
        else:
            getattr(self, "_" + self.rng.choices(self.ops, self.weights)[0])()
        self.done += 1
        return self.steps is None or self.done < self.steps

    # ------------------------------------------------------------------ operations
    def _class_for(self, tokens: int) -> int:
        k = max(0, math.ceil(math.log2(max(tokens, 1) / self.pool.block_size)))
        return min(k, self.pool.max_order)

    def _own(self, owner: int, blocks: list[int], tokens: int) -> None:
        self.seqs[owner], self.tokens[owner] = blocks, tokens
        left = tokens
        for b in blocks:
            cap = self.pool.block_size << self.pool.fields.size_class[b]
            self.pool.set_token_count(b, min(cap, left))
            left = max(0, left - cap)
        self.pool.set_owner(blocks, owner)

    def _alloc_for(self, tokens: int, owner: int, **kw: Any) -> list[int] | None:
        k = self._class_for(tokens)
        n = math.ceil(tokens / (self.pool.block_size << k))
        try:
            return self.pool.allocate(n, size_class=k, owner=owner, **kw)
        except OutOfBlocksError:
            return None

    def _admit(self) -> None:
        tokens = self.rng.randint(1, self.max_tokens)
        owner = self.next_owner
        blocks = self._alloc_for(tokens, owner)
        if blocks is None:
            return self._finish()
        self.next_owner += 1
        self._own(owner, blocks, tokens)
        if self.rng.random() < 0.5:
            self.pool.mark_reusable(blocks)

    def _grow(self) -> None:
        if not self.seqs:
            return self._admit()
        owner = self.rng.choice(list(self.seqs))
        blocks, tokens = self.seqs[owner], self.tokens[owner] + self.rng.randint(1, TOKEN_UNIT)
        cap = sum(self.pool.block_size << self.pool.fields.size_class[b] for b in blocks)
        if tokens > cap:
            extra = self._alloc_for(tokens - cap, owner)
            if extra is None:
                return self._finish()
            blocks = blocks + extra
        self._own(owner, blocks, tokens)

    def _finish(self) -> None:
        if self.seqs:
            owner = self.rng.choice(list(self.seqs))
            self.pool.free(self.seqs.pop(owner))
            del self.tokens[owner]

    def _share(self) -> None:
        cached = [b for b, _ in self.pool.policy.rank(4)]
        pool = [b for bl in self.seqs.values() for b in bl] + cached
        if pool:
            b = self.rng.choice(pool)
            self.pool.incref([b])
            self.shared.append(b)

    def _unshare(self) -> None:
        if self.shared:
            self.pool.free([self.shared.pop(self.rng.randrange(len(self.shared)))])

    def _evict(self) -> None:
        self.pool.evict("the workload trims the cache")

    def _swap(self) -> None:
        cand = self.pool.policy.rank(1)
        if cand:
            self.pool.begin_eviction([cand[0][0]])
            self.evicting.append(cand[0][0])

    def _reserve(self) -> None:
        owner = self.next_owner
        blocks = self._alloc_for(self.rng.randint(1, self.max_tokens), owner, status=BlockStatus.PENDING)
        if blocks is not None:
            self.next_owner += 1
            self.pending.append((owner, blocks))

    def _compact(self) -> None:
        """Move up to 8 of the highest ALLOCATED blocks into the lowest FREE holes of the same class."""
        p = self.pool
        src = np.flatnonzero((p.arrays.status == ALLOCATED) & (p.arrays.size_class == 0))[::-1][:8]
        dst = np.flatnonzero((p.arrays.status == FREE) & (p.arrays.size_class == 0))[:8]
        m = min(src.size, dst.size)
        down = src[:m] > dst[:m]  # a prefix: only moves towards lower addresses compact the pool
        if down.any():
            p.migrate(src[:m][down], dst[:m][down], reason="compaction")
