"""The anywidget views: PoolView (§2.2.2 block states), EvictionView (§2.2.2 eviction), FragmentationView (§2.2.4)
and a Dashboard that runs a workload live (§2.2.3 allocation and release, §2.2.5 batch operations).

A view holds one synced binary trait, ``frame`` (see :mod:`kvlab.viz.frames`), set together with ``frames_sent``
under ``hold_sync()`` so each frame is exactly one message. The browser keeps every frame it receives, so its
player (step back, scrub) works on its own; it reports ``frames_received`` back. The view keeps every frame it
sent (or the recording loaded into it) and sends them as history when a browser asks (``ready``), so a view
drawn again, or late, holds the whole run.

A view driven by a :class:`LiveRun` follows it: its ``status`` trait is the run's state, and its one pause
button pauses the workload (a ``control`` message), not just the picture.

After each cell and when a run ends, a view that no browser has reported drawing (a notebook executed by
nbclient, as ``kvlab html`` does) redraws its displays if its frame changed, so the saved ``image/png`` is the
latest frame, not the first; a browser that draws a redrawn view gets the whole history and opens on its end.
"""
from __future__ import annotations

import base64
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import anywidget
import traitlets

from kvlab.core.checks import check_real, check_seed
from kvlab.core.errors import ConfigError
from kvlab.core.eviction import POLICIES
from kvlab.core.pool import BlockPool
from kvlab.viz.assets import css_source, esm_source
from kvlab.viz.frames import Frame, decode_frame, decode_recording, frame_of
from kvlab.viz.live import PRESETS, LiveRun, RandomWorkload, Recording, StepFn, check_steps
from kvlab.viz.saved import pack_frames
from kvlab.viz.static import (Picture, figure_png, gauge_values, plot_dashboard, plot_evictions, plot_fragmentation,
                              plot_pool)

HISTORY_CHUNK = 8 << 20  # bytes of frames per history message
HISTORY_BYTES = 256 << 20  # frames a view keeps to send as history (the oldest go first)
_DISPLAYED: weakref.WeakSet[FrameView] = weakref.WeakSet()  # views shown with a display id


def _refresh_after_cell(*_result: Any) -> None:
    """IPython's post_run_cell hook: bring the pictures of unwatched views and every view's saved run up to
    date."""
    for view in list(_DISPLAYED):
        view.refresh_if_unwatched()
        view.save_replay()
CONTROLS = ("run", "pause", "step", "stop")  # what the browser's buttons send
ENDED = ("done", "stopped", "failed")


class FrameView(anywidget.AnyWidget):
    """Base of the views: shows frames of one pool (``pool``) or of a recording."""

    view = "pool"
    _esm = esm_source("pool")
    _css = css_source()
    frame = traitlets.Bytes(b"").tag(sync=True)
    frames_sent = traitlets.Int(0).tag(sync=True)
    # Written by the browser after every frame; not echoed back (ipywidgets would send one more message per frame)
    frames_received = traitlets.Int(0).tag(sync=True, echo_update=False)
    status = traitlets.Unicode("").tag(sync=True)  # the state of the LiveRun driving the view; "" for none
    # The frames so far, packed (kvlab.viz.saved): saved with the notebook, replayed where no kernel answers
    replay = traitlets.Bytes(b"").tag(sync=True)

    def __init__(self, pool: BlockPool | None = None, *, recording: Recording | Iterable[bytes] | None = None,
                 **kwargs: Any) -> None:
        if pool is not None and not isinstance(pool, BlockPool):
            raise ConfigError(f"a {type(self).__name__} shows a BlockPool, not {pool!r:.80}")
        super().__init__(**kwargs)
        self.pool = pool
        self.run: LiveRun | None = None
        self.history = Recording(max_bytes=HISTORY_BYTES)  # every frame sent (views share the bytes objects)
        self.series: deque[tuple[float, ...]] = deque(maxlen=300)
        self.evictions: deque[dict[str, Any]] = deque(maxlen=8)
        self.displays: list[Any] = []  # IPython display handles of this view (see refresh_if_unwatched)
        self.shown: Frame | None = None  # the latest frame sent: what figure() draws
        self._pictured = b""  # the frame the displays were last drawn from
        self._packed: bytes | None = None  # the last frame of the history when ``replay`` was packed
        self.on_msg(self._on_msg)
        if recording is not None:
            self.load(recording)
        elif pool is not None:
            self.update()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "view" in cls.__dict__:  # a view class, not the subclass traitlets makes when traits are added
            cls._esm = esm_source(cls.view)
        super().__init_subclass__(**kwargs)

    def show_frame(self, frame: Frame | bytes) -> None:
        """Send one frame: one message carrying ``frame`` and ``frames_sent``. A :class:`Frame` (from a builder)
        is sent as it is; bytes (a frame from elsewhere, e.g. a recording) are decoded and checked first."""
        f = frame if isinstance(frame, Frame) else decode_frame(frame)
        self.series.append(gauge_values(f))
        self.evictions.extend(f.evictions)
        self.history.append(f.data)
        self.shown = f
        with self.hold_sync():
            self.frame = f.data
            self.frames_sent += 1

    def update(self) -> None:
        """Send the pool's current state (no flashes: use a :class:`LiveRun` to see changes as they happen)."""
        if self.pool is None:
            raise ConfigError(f"this {type(self).__name__} shows a recording and has no pool to update from")
        self.show_frame(frame_of(self.pool))

    def load(self, recording: Recording | Iterable[bytes]) -> None:
        """Show a recording: the browser gets all frames (opening on the last, the slider reaching back to the
        first)."""
        frames = decode_recording(recording)  # all of them first: a bad one changes nothing
        rec = Recording((f.data for f in frames), max_bytes=HISTORY_BYTES)
        frames = frames[len(frames) - len(rec):]  # what the history keeps
        self.history, self.shown = rec, frames[-1]
        for f in frames:
            self.series.append(gauge_values(f))
            self.evictions.extend(f.evictions)
        with self.hold_sync():
            self.frame = rec[len(rec) - 1]
            self.frames_sent = len(rec)
        self._send_history()
        self.save_replay()

    def live(self, step_fn: StepFn, **kwargs: Any) -> LiveRun:
        """A :class:`LiveRun` of ``step_fn`` on this view's pool, streaming to this view (which follows it)."""
        if self.pool is None:
            raise ConfigError(f"this {type(self).__name__} has no pool to run on")
        return LiveRun(self.pool, step_fn, [self], **kwargs)

    # ------------------------------------------------------------------ the run it follows
    def follow(self, run: LiveRun) -> None:
        """Be driven by ``run`` (a :class:`LiveRun` calls this): ``status`` tracks its state and the view's
        pause button pauses it."""
        self.run = run
        run.on_state.append(self._run_state)
        self.status = run.state

    def _run_state(self, state: str) -> None:
        self.status = state
        if state in ENDED:
            self.refresh_if_unwatched()
            self.save_replay()

    def start(self) -> None:
        """Run (or resume) the workload as a task on the running event loop."""
        run = self.run
        if run is None or run.finished:
            return
        if run.state == "paused" and run.task is not None:
            run.resume()
        elif run.state != "running":
            run.start()

    def pause(self) -> None:
        """Pause the workload (its current state is sent)."""
        if self.run is not None:
            self.run.pause()

    def step(self) -> None:
        """One step (pausing a running workload first), its frame always sent."""
        if self.run is not None and not self.run.finished:
            self.run.pause()
            self.run.step()

    def stop(self) -> None:
        """End the run (its final state is sent)."""
        if self.run is not None:
            self.run.stop()

    # ------------------------------------------------------------------ browser messages
    def _send_history(self) -> None:
        chunk: list[bytes] = []
        size, first = 0, True
        for data in list(self.history) + [b""]:
            if chunk and (not data or size + len(data) > HISTORY_CHUNK):
                self.send({"type": "history", "reset": first, "index": len(self.history) - 1}, buffers=chunk)
                chunk, size, first = [], 0, False
            if data:
                chunk.append(bytes(data))
                size += len(data)

    def _on_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        kind = content.get("type")
        if kind == "ready":
            self._send_history()
        elif kind == "inspect":
            self._inspect(content.get("block"))
        elif kind == "control" and content.get("action") in CONTROLS:
            action = content["action"]  # anything else is not ours to act on
            (self.start if action == "run" else getattr(self, action))()

    def _inspect(self, block: Any) -> None:
        """Answer a hover on a large pool (frames carry no details) with the block's live fields."""
        p = self.pool
        if p is None or not isinstance(block, int) or not 0 <= block < p.num_blocks:
            return  # a stale hover (the pool was rebuilt) or a recording: nothing live to report
        self.send({"type": "inspect", "block": block, "tokens": p.fields.tokens[block], "owner": p.fields.owner[block],
                   "last_access": p.fields.last_access[block], "hits": p.fields.hits[block]})

    def save_replay(self) -> None:
        """Pack the frames sent so far into ``replay`` (if any came since the last packing): the run a saved
        notebook or a static page replays. Called after each cell, when a run ends and on :meth:`load`."""
        last = self.history[len(self.history) - 1] if len(self.history) else None
        if last is not None and last is not self._packed:
            self.replay = pack_frames(list(self.history))
            self._packed = last

    # ------------------------------------------------------------------ static fallback
    def figure(self) -> Picture:
        """The view as a matplotlib figure of its latest frame."""
        return plot_pool(self.latest())

    def latest(self) -> Frame:
        """The latest frame sent, else :class:`ConfigError`."""
        if self.shown is None:
            raise ConfigError(f"this {type(self).__name__} has no frame yet")
        return self.shown

    def _repr_mimebundle_(self, **kwargs: Any):
        bundle: Any = super()._repr_mimebundle_(**kwargs)  # ipywidgets: (data, metadata)
        data, meta = bundle
        if self.shown is not None:
            data["image/png"] = base64.b64encode(figure_png(self.figure())).decode()
        return data, meta

    def _ipython_display_(self) -> None:
        """Display with a display id, so the picture can be brought up to date later (after each cell and when
        a run ends; see :meth:`refresh_if_unwatched`)."""
        from IPython import get_ipython
        from IPython.display import display
        data, meta = self._repr_mimebundle_()
        handle = display(data, metadata=meta, raw=True, display_id=True)
        if handle is None:
            return
        self.displays.append(handle)
        self._pictured = self.frame
        _DISPLAYED.add(self)
        shell = get_ipython()
        if shell is not None and _refresh_after_cell not in shell.events.callbacks["post_run_cell"]:
            shell.events.register("post_run_cell", _refresh_after_cell)

    def refresh_displays(self) -> None:
        """Redraw every display of this view from its latest frame (widget and ``image/png``)."""
        if not self.displays:
            return
        data, meta = self._repr_mimebundle_()
        for handle in self.displays:
            handle.update(data, metadata=meta, raw=True)
        self._pictured = self.frame

    def refresh_if_unwatched(self) -> None:
        """Redraw the displays if the frame changed since they were drawn and no browser has reported drawing
        the view: a notebook executed by nbclient (as ``kvlab html`` does) or a cell that kept the kernel busy
        then saves the latest picture, not the first. A view a browser draws is left alone: redrawing it would
        send its whole history again."""
        if self.displays and not self.frames_received and self.frame is not self._pictured:
            self.refresh_displays()


class PoolView(FrameView):
    """One cell per block: state colours (cached distinct), refcounts, size classes, flashes, hover details."""

    view = "pool"


class EvictionView(FrameView):
    """Each eviction: the candidates the policy ranked, with scores, and the victim it chose."""

    view = "eviction"

    def figure(self) -> Picture:
        return plot_evictions(list(self.evictions))


class FragmentationView(FrameView):
    """Memory map with free runs, gauges (blocks held, unusable free memory, internal waste, external
    fragmentation: the names of the chapters' GLOSSARY.md) and their time series; migrations drawn as moving
    arrows."""

    view = "fragmentation"

    def figure(self) -> Picture:
        return plot_fragmentation(self.latest(), list(self.series))


BLOCK_SIZES = (8, 16, 32, 64, 128, 256, 512)  # the block-size menu's choices
DASHBOARD_PRESETS: dict[str, dict[str, Any]] = {
    # per chapter topic: the panels shown, the setup controls offered, and the workload / policy to start with
    "block_size": {"panels": ["pool", "fragmentation"], "controls": ["block_size", "workload"],
                   "workload": "steady", "policy": "lru"},
    "eviction": {"panels": ["pool", "eviction"], "controls": ["policy", "workload"], "workload": "sharing",
                 "policy": "lru"},
    "fragmentation": {"panels": ["pool", "fragmentation"], "controls": ["workload"], "workload": "defrag",
                      "policy": "lru"},
    "engine": {"panels": ["pool", "fragmentation", "eviction"], "controls": ["policy", "block_size", "workload"],
               "workload": "bursty", "policy": "lru"},
}


class Dashboard(FrameView):
    """Views over one live run with one player (run / pause, step, stop, speed) and setup controls.

    ``preset`` picks the panels and controls for a chapter topic:

    * ``"block_size"`` (§2.2.1): pool and fragmentation panels (internal waste), block size and workload menus;
    * ``"eviction"`` (§2.2.2): pool and eviction panels, policy and workload menus, the ``sharing`` workload;
    * ``"fragmentation"`` (§2.2.4): pool and fragmentation panels, the ``defrag`` workload (with compaction);
    * ``"engine"`` (§2.2.5-§2.2.6, the default): all three panels and every menu, the ``bursty`` workload.

    ``policy`` and ``workload`` given explicitly override the preset's. The dashboard owns its pool (or starts
    from ``pool``) and a :class:`RandomWorkload`; changing the policy, block size or workload stops the run and
    builds a fresh pool with the same token capacity. Every control runs on the kernel's event loop, between two
    steps of the run.
    """

    view = "dashboard"
    speed = traitlets.Float(200.0).tag(sync=True)  # steps per second
    policy = traitlets.Unicode("lru").tag(sync=True)
    block_size = traitlets.Int(16).tag(sync=True)
    workload = traitlets.Unicode("steady").tag(sync=True)
    options = traitlets.Dict().tag(sync=True)
    preset = traitlets.Unicode("engine").tag(sync=True)
    panels = traitlets.List(traitlets.Unicode()).tag(sync=True)
    controls = traitlets.List(traitlets.Unicode()).tag(sync=True)

    def __init__(self, pool: BlockPool | None = None, *, preset: str = "engine", num_blocks: int = 1024,
                 block_size: int = 16, policy: str | None = None, workload: str | None = None, seed: int = 0,
                 steps: int | None = None, speed: float = 200.0, fps: float = 30.0, **kwargs: Any) -> None:
        if not isinstance(preset, str) or preset not in DASHBOARD_PRESETS:
            raise ConfigError(f"unknown dashboard preset {preset!r}; choose one of {sorted(DASHBOARD_PRESETS)}")
        # the setup is checked before anything is built, so a refusal leaves nothing behind
        check_real(fps, "fps", lo=0, lo_open=True)
        check_real(speed, "speed (steps a second)", lo=0, lo_open=True)
        check_steps(steps, "steps")
        check_seed(seed)
        setup = DASHBOARD_PRESETS[preset]
        policy = setup["policy"] if policy is None else policy
        workload = setup["workload"] if workload is None else workload
        if workload not in PRESETS:
            raise ConfigError(f"unknown workload {workload!r}; choose one of {sorted(PRESETS)}")
        if pool is None:
            if policy not in POLICIES:
                raise ConfigError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}")
            pool = BlockPool(num_blocks, block_sizes=[block_size], eviction_policy=policy, with_storage=False,
                             seed=seed)
        self.capacity_tokens = pool.num_blocks * pool.block_size
        self.seed, self.steps, self.fps = seed, steps, fps
        self.run: LiveRun | None = None
        self.workload_fn: RandomWorkload | None = None
        # 8 to 512 tokens (2.2.1's range), each leaving the pool at least 8 blocks of the same token capacity
        sizes = sorted({b for b in BLOCK_SIZES if self.capacity_tokens // b >= 8} | {pool.block_size})
        super().__init__(pool, policy=pool.policy.name, block_size=pool.block_size, workload=workload, speed=speed,
                         options={"policy": sorted(POLICIES), "block_size": sizes, "workload": list(PRESETS)},
                         preset=preset, panels=list(setup["panels"]), controls=list(setup["controls"]), **kwargs)
        self.status = "idle"
        self.observe(self._rebuild, names=["policy", "block_size", "workload"])
        self.observe(self._set_speed, names=["speed"])

    # ------------------------------------------------------------------ controls
    @property
    def own_pool(self) -> BlockPool:
        """The pool the dashboard runs on (it always has one)."""
        if self.pool is None:
            raise ConfigError("this Dashboard has lost its pool")
        return self.pool

    def _new_run(self) -> LiveRun:
        pool = self.own_pool
        self.workload_fn = RandomWorkload(pool, preset=self.workload, seed=self.seed, steps=self.steps)
        return LiveRun(pool, self.workload_fn, [self], fps=self.fps, steps_per_second=self.speed)

    def _current(self) -> LiveRun:
        return self.run if self.run is not None and not self.run.finished else self._new_run()

    def _run_state(self, state: str) -> None:
        super()._run_state(state)
        if state in ENDED:
            self.status = "idle"  # the dashboard can always run again, on a fresh workload

    def start(self) -> None:
        """Run (or resume) the workload as a task on the running event loop; after a run ended, a new one."""
        self._current()
        super().start()

    def step(self) -> None:
        """One step (pausing a running workload first), its frame always sent."""
        self._current()
        super().step()

    def _set_speed(self, change: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.steps_per_second = change["new"]

    @traitlets.validate("policy", "workload", "block_size", "speed")
    def _valid(self, proposal: dict[str, Any]) -> Any:
        """Reject a bad setting before it is stored, so the dashboard is left as it was."""
        name, value = proposal["trait"].name, proposal["value"]
        if name == "speed":
            return check_real(value, "speed (steps a second)", lo=0, lo_open=True)
        if name == "policy" and value not in POLICIES:
            raise ConfigError(f"unknown eviction policy {value!r}; choose one of {sorted(POLICIES)}")
        if name == "workload" and value not in PRESETS:
            raise ConfigError(f"unknown workload {value!r}; choose one of {sorted(PRESETS)}")
        if name == "block_size" and not 1 <= value <= self.capacity_tokens:
            raise ConfigError(f"block size {value} must be between 1 and the {self.capacity_tokens} tokens "
                              f"of the pool")
        return value

    def _rebuild(self, change: dict[str, Any]) -> None:
        """Policy, block size or workload changed: stop the run and start over on a fresh pool."""
        self.stop()
        if self.workload_fn is not None:
            self.workload_fn.close()
        p = self.own_pool
        self.pool = BlockPool(self.capacity_tokens // self.block_size,
                              spec=replace(p.spec, block_size=self.block_size), eviction_policy=self.policy,
                              with_storage=p.storage is not None, seed=self.seed)
        self.run = self.workload_fn = None
        self.series.clear()
        self.evictions.clear()
        self.update()
        self.status = "idle"

    def figure(self) -> Picture:
        return plot_dashboard(self.latest(), list(self.series), list(self.evictions), panels=self.panels)
