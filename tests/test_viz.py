"""The Python side of the live views: frames against the pool (reference: the pool's own arrays and methods),
flashes from events, pacing, live runs on asyncio, the random workload's invariants, views' messages, static
figures, HTML export, packaging and lazy imports. The browser side is tested in tests/browser/."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import random
import re
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import BlockPool, ConfigError, DoubleFreeError
from kvlab.core.block import ALLOCATED, EVICTING, FREE
from kvlab.core.interrupts import _on_sigint, install
from kvlab.viz import (PRESETS, FrameBuilder, LiveRun, Pacer, RandomWorkload, Recording, build_frame, decode_frame,
                       export_html, plot_dashboard, plot_evictions, plot_fragmentation, plot_pool, record)
from kvlab.viz import frames as fr
from kvlab.viz import palette
from kvlab.viz.palette import STATE_RGB
from kvlab.viz.static import Picture, figure_png, map_colors, pool_colors
from kvlab.textbook.pool import TextbookPool

REPO = Path(__file__).resolve().parent.parent


def reference_frame(p: BlockPool) -> dict[str, np.ndarray]:
    """What a frame must hold, from the pool's snapshot (head fields spread over each block's span)."""
    s = p.snapshot()
    head = np.arange(p.num_blocks) & ~((1 << s["size_class"].astype(np.int64)) - 1)
    refs = s["refcount"][head]
    state = s["status"].copy()
    state[(state == 2) & (refs == 0)] = fr.CACHED
    return {"state": state, "refcount": np.minimum(refs, 255), "size_class": s["size_class"],
            "tokens": s["tokens"][head], "owner": s["owner"][head], "last_access": s["last_access"][head]}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), preset=st.sampled_from(sorted(PRESETS)), multi=st.booleans(),
       steps=st.integers(1, 300))
def test_frames_match_the_pool(seed, preset, multi, steps):
    p = BlockPool(128, block_sizes=[16, 32, 64] if multi else None, with_storage=False, seed=seed)
    w = RandomWorkload(p, preset=preset, seed=seed, steps=steps)
    while w():
        pass
    p.check_invariants()
    f = decode_frame(build_frame(p))
    ref = reference_frame(p)
    for key, want in ref.items():
        assert np.array_equal(getattr(f, key), want), key
    assert f.num_blocks == 128 and f.block_size == p.block_size and f.step == p.clock.now()
    assert f.blocks_held == pytest.approx(np.count_nonzero(p.arrays.status) / 128)
    assert f.unusable_free == pytest.approx(TextbookPool(p).calculate_fragmentation() / 100)
    runs = p.free_runs()
    assert f.external_fragmentation == pytest.approx(1 - runs.max() / runs.sum() if runs.size else 0.0)
    used = p.arrays.status != 0
    waste = 1 - p.arrays.tokens.sum() / (used.sum() * p.block_size) if used.any() else 0.0
    assert f.internal_waste == pytest.approx(waste, abs=1e-6)
    assert not f.flash.any()


def test_flashes_evictions_and_moves_come_from_events_and_are_consumed():
    p = BlockPool(8, with_storage=False)
    with FrameBuilder(p) as b:
        ids = p.allocate(8)
        p.mark_reusable(ids[:4])
        p.free(ids[:4][::-1])  # cached, LRU order 3, 2, 1, 0
        f = decode_frame(b.build())
        assert f.flash.tolist() == [fr.FLASH_ALLOCATED] * 8  # cached blocks stay allocated: no free flash
        p.allocate(1)  # evicts block 3, the least recently released, and reuses it
        p.free([5])
        p.migrate([7], [5])
        f = decode_frame(b.build())
        assert f.flash[3] == fr.FLASH_ALLOCATED  # evicted then allocated again: the latest event wins
        assert f.flash[5] == fr.FLASH_MOVED_IN and f.flash[7] == fr.FLASH_MOVED_OUT
        (e,) = f.evictions
        assert e["victim"] == 3 and e["policy"] == "lru" and e["candidates"][0][0] == 3
        assert [c[0] for c in e["candidates"]] == [3, 2, 1, 0]
        assert f.tail["evictions_total"] == 1 and f.moves == [[7, 5]]
        p.evict()
        f = decode_frame(b.build())
        assert f.flash.tolist().count(fr.FLASH_EVICTED) == 1 and f.evictions[0]["victim"] == 2
        assert f.moves == [] and decode_frame(b.build()).evictions == []
    assert not p.events.subscribers  # closing the builder unsubscribes: the pool stops building events


def test_refcounts_saturate_and_large_pools_carry_no_details():
    p = BlockPool(fr.DETAILS_LIMIT + 1, with_storage=False)
    p.allocate(1)
    p.incref([0] * 300)
    data = build_frame(p)
    assert len(data) == fr.HEADER.size + 3 * p.num_blocks
    f = decode_frame(data)
    assert f.refcount[0] == 255 and f.tokens is None
    small = decode_frame(build_frame(BlockPool(16, with_storage=False)))
    assert small.tokens is not None and small.owner.tolist() == [-1] * 16


def test_frames_are_independent_bytes_and_token_sums_exact():
    """The builder writes every frame into the same buffers: a frame already sent must not change with the next,
    and the token total behind internal waste must not overflow (2**31 tokens here)."""
    p = BlockPool(16, block_sizes=[2**27], with_storage=False)
    with FrameBuilder(p) as b:
        p.free(p.allocate(16)[:4])
        first = b.build()
        kept = bytes(first)
        for i in p.allocate(4) + list(range(4, 16)):
            p.set_token_count(i, 2**27)  # every block full
        second = b.build()
    assert first == kept and decode_frame(first).state.tolist() == [FREE] * 4 + [ALLOCATED] * 12
    f = decode_frame(second)
    assert f.state.tolist() == [ALLOCATED] * 16 and f.internal_waste == 0.0

def test_decode_rejects_what_is_not_a_frame():
    data = build_frame(BlockPool(16, with_storage=False))
    with pytest.raises(ConfigError, match="not a kvlab frame"):
        decode_frame(b"XXXX" + data[4:])
    with pytest.raises(ConfigError, match="should be"):
        decode_frame(data[:-1])


def test_pacer_lets_one_frame_per_interval():
    t = [0.0]
    pacer = Pacer(10, clock=lambda: t[0])
    assert pacer.due()
    pacer.mark()
    t[0] = 0.05
    assert not pacer.due()
    t[0] = 0.1
    assert pacer.due()
    with pytest.raises(ConfigError, match="fps"):
        Pacer(0)


def test_a_forced_frame_or_a_stall_does_not_move_the_cadence():
    t = [0.0]
    pacer = Pacer(10, clock=lambda: t[0])
    pacer.mark()  # the cadence starts: ticks at 0.1, 0.2, ...
    t[0] = 0.13
    assert pacer.due()
    pacer.mark()  # a late frame: the next is still due at 0.2
    t[0] = 0.15
    assert not pacer.due()
    pacer.mark()  # a forced frame (a pause, a step): the next is still due at 0.2
    t[0] = 0.19
    assert not pacer.due()
    t[0] = 0.21
    assert pacer.due()
    pacer.mark()
    t[0] = 0.55  # a stall over three ticks: they are skipped, the next is due at 0.6
    assert pacer.due()
    pacer.mark()
    t[0] = 0.59
    assert not pacer.due()
    t[0] = 0.61
    assert pacer.due()


class Sink:
    """Keeps the bytes of every frame it is shown (a LiveRun shows Frames: bytes and what they hold)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def show_frame(self, frame: fr.Frame) -> None:
        self.frames.append(frame.data)


def test_live_run_sends_paced_latest_frames_and_always_the_final_one():
    t = [0.0]
    p = BlockPool(64, with_storage=False)
    w = RandomWorkload(p, seed=5, steps=1000)

    def step() -> bool:
        t[0] += 0.001  # each step takes 1 ms of the fake clock: 1,000 steps = 1 s
        return w()

    sink = Sink()
    run = LiveRun(p, step, [sink], fps=30, clock=lambda: t[0])
    assert run.run() == 1000 and run.state == "done"
    assert 30 <= len(sink.frames) <= 32  # 30 paced frames in one second, plus the final one
    assert run.frames_sent == len(sink.frames) == len(run.recording)
    seqs = [decode_frame(f).seq for f in sink.frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one build per frame sent
    final = decode_frame(sink.frames[-1])
    assert np.array_equal(final.state, reference_frame(p)["state"]) and final.step == p.clock.now()
    assert not p.events.subscribers and run.run() == 0


class ClockSink(Sink):
    """A sink that notes the clock's time of every frame it is shown."""

    def __init__(self, clock) -> None:
        super().__init__()
        self.clock, self.times = clock, []

    def show_frame(self, frame: fr.Frame) -> None:
        super().show_frame(frame)
        self.times.append(self.clock())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), stalls=st.booleans())
def test_live_run_keeps_its_cadence_on_a_jittered_clock(seed, stalls):
    """10 s of steps 0.5-30 ms apart at 10 fps: a frame at the first step of each tenth of a second, so 100
    paced frames plus the final one; with stalls of 0.35-0.5 s, the ticks a stall covers are skipped and every
    later frame stays on the cadence (the first step of each tick it reaches)."""
    rng = random.Random(seed)
    times = [0.0]
    while True:
        gap = rng.uniform(0.35, 0.5) if stalls and rng.random() < 0.02 else rng.uniform(0.0005, 0.03)
        if times[-1] + gap >= 10:
            break
        times.append(times[-1] + gap)
    t = [0.0]
    p = BlockPool(64, with_storage=False)
    w = RandomWorkload(p, seed=seed % 1000)
    steps = iter(range(1, len(times) + 1))

    def step() -> bool:
        i = next(steps)
        t[0] = times[i - 1]  # the step ends at this time of the fake clock
        w()
        return i < len(times)

    sink = ClockSink(lambda: t[0])
    run = LiveRun(p, step, [sink], fps=10, clock=lambda: t[0])
    run.run()
    ticks = [int(x // 0.1) for x in times]
    first_of_tick = [x for k, x in enumerate(times) if k == 0 or ticks[k] != ticks[k - 1]]
    assert sink.times[:-1] == first_of_tick and sink.times[-1] == times[-1]  # the final frame, always sent
    if not stalls:
        assert len(first_of_tick) == 100


def test_live_run_on_asyncio_finishes_pauses_and_stops_without_leftover_tasks():
    async def main() -> None:
        p = BlockPool(64, with_storage=False)
        sink = Sink()
        done = LiveRun(p, RandomWorkload(p, seed=1, steps=50), [sink])
        await done
        assert done.state == "done" and done.steps == 50 and done.task.done()
        assert decode_frame(sink.frames[-1]).step == p.clock.now()

        endless = LiveRun(p, RandomWorkload(p, seed=2), [sink])
        endless.start()
        await asyncio.sleep(0.02)
        endless.pause()
        frozen = endless.steps
        await asyncio.sleep(0.02)
        assert endless.steps == frozen and endless.state == "paused"  # the loop ran, the run did not
        endless.resume()
        await asyncio.sleep(0.02)
        assert endless.steps > frozen
        endless.stop()
        await asyncio.gather(endless.task, return_exceptions=True)
        assert endless.task.done() and endless.state == "stopped"
        assert decode_frame(sink.frames[-1]).step == p.clock.now()  # the final state was sent

        interrupted = LiveRun(p, RandomWorkload(p, seed=3), [sink])
        waiter = asyncio.ensure_future(_await(interrupted))
        await asyncio.sleep(0.02)
        waiter.cancel()  # what an interrupted cell does to the coroutine awaiting the run
        await asyncio.gather(waiter, return_exceptions=True)
        assert interrupted.task.done() and interrupted.state == "stopped"
        assert not p.events.subscribers
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(main())


async def _await(run: LiveRun) -> None:
    await run


@pytest.mark.parametrize("click", ["resume", "stop"])
def test_a_click_from_another_thread_reaches_a_paused_run(click):
    """The reported freeze: ipywidgets may deliver a button click on a kernel subshell's thread while a cell awaits
    the run and the kernel's thread sits in the event loop's select. Paused, then resumed or stopped from that
    thread, the run must go on or end: an asyncio Event set from another thread never woke the paused task."""
    p = BlockPool(64, with_storage=False)

    async def main() -> tuple[str, int]:
        run = LiveRun(p, RandomWorkload(p, seed=1, steps=40), [], steps_per_second=500)
        run.start()
        await asyncio.sleep(0.01)
        threading.Timer(0.0, run.pause).start()
        await asyncio.sleep(0.1)
        assert run.state == "paused" and run.steps < 40
        threading.Timer(0.05, getattr(run, click)).start()  # comes while the loop waits, with no timer due
        await asyncio.wait_for(asyncio.gather(run.task, return_exceptions=True), 5)
        return run.state, run.steps

    try:
        state, steps = asyncio.run(main())
    except asyncio.TimeoutError:  # TimeoutError from 3.11 on
        pytest.fail(f"a {click} from another thread never reached the paused run")
    assert (state, steps) == (("stopped", steps) if click == "stop" else ("done", 40))
    assert not p.events.subscribers


def test_interrupting_a_cell_that_awaits_a_paused_run_ends_the_wait_and_the_run():
    """The reported freeze, second half: Kernel > Interrupt sends SIGINT while the kernel's thread waits in the
    event loop's select (a paused run takes no step). The cell awaiting the run must end with KeyboardInterrupt
    (IPython shows it, as for any cell) with the run stopped, the loop still running and kvlab's SIGINT handler
    back."""
    p = BlockPool(64, with_storage=False)

    async def cell(run: LiveRun) -> str:
        try:
            await run
        except KeyboardInterrupt:  # IPython's run_code catches it and shows it
            return "interrupted"
        return "finished"

    async def main() -> tuple[str, str]:
        run = LiveRun(p, RandomWorkload(p, seed=2), [])
        waiter = asyncio.ensure_future(cell(run))
        await asyncio.sleep(0.02)
        run.pause()
        threading.Timer(0.05, signal.raise_signal, (signal.SIGINT,)).start()  # as the kernel's manager sends it
        got = await asyncio.wait_for(waiter, 10)
        await asyncio.sleep(0)  # the loop goes on
        return got, run.state

    assert install()
    try:
        got = asyncio.run(main())
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped the event loop instead of ending the awaiting cell")
    assert got == ("interrupted", "stopped")
    assert signal.getsignal(signal.SIGINT) is _on_sigint
    assert not p.events.subscribers


def test_a_failing_step_ends_the_run_and_keeps_the_error():
    p = BlockPool(16, with_storage=False)
    calls = [0]

    def step() -> bool:
        calls[0] += 1
        if calls[0] == 3:
            p.free([0])
            p.free([0])  # a double free on the third step
        else:
            p.allocate(1)
        return True

    sink = Sink()
    run = LiveRun(p, step, [sink])
    with pytest.raises(DoubleFreeError, match="block 0"):
        run.run()
    assert run.state == "failed" and run.error is not None and len(sink.frames) >= 1
    assert not p.events.subscribers and run.step() is False


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_random_workload_keeps_invariants_and_replays(preset, multi):
    def run(seed: int) -> Recording:
        p = BlockPool(96, block_sizes=[16, 32, 64] if multi else None, with_storage=False, seed=seed)
        w = RandomWorkload(p, preset=preset, seed=seed, steps=400)

        def checked() -> bool:
            more = w()
            p.check_invariants()
            return more

        return record(p, checked, 400, every=40)

    a, b = run(7), run(7)
    unnumbered = lambda rec: [f[:4] + f[8:] for f in rec]  # noqa: E731  (frame numbers are process-unique)
    assert len(a) == 11 and unnumbered(a) == unnumbered(b)  # same seed, same frames, byte for byte
    states = np.concatenate([decode_frame(f).state for f in a])
    assert {0, 2}.issubset(set(states.tolist()))


def test_workload_and_record_reject_bad_arguments():
    p = BlockPool(16, with_storage=False)
    with pytest.raises(ConfigError, match="preset 'nope'"):
        RandomWorkload(p, preset="nope")
    with pytest.raises(ConfigError, match="steps"):
        record(p, lambda: True, 0)


def test_recording_keeps_the_latest_bytes():
    rec = Recording(max_bytes=10)
    for i in range(5):
        rec.append(bytes([i]) * 4)
    assert [f[0] for f in rec] == [3, 4] and rec.trimmed == 3 and rec.nbytes == 8


# ---------------------------------------------------------------------------- views (no browser)
def sent_messages(widget) -> list[tuple[dict, list]]:
    calls: list[tuple[dict, list]] = []
    widget._send = lambda msg, buffers=None: calls.append((msg, buffers or []))
    return calls


def test_one_message_per_frame_with_the_counter():
    from kvlab.viz import PoolView
    p = BlockPool(64, with_storage=False)
    v = PoolView(p)
    assert "kvPoolPanel" in v._esm and "export default" in v._esm and ".kv-root" in v._css
    assert v.frames_sent == 1 and decode_frame(v.frame).num_blocks == 64
    calls = sent_messages(v)
    p.allocate(3)
    v.update()
    (msg, buffers), = calls
    assert msg["state"]["frames_sent"] == 2 and msg["buffer_paths"] == [["frame"]]
    assert [bytes(b) for b in buffers] == [v.frame]


def test_views_answer_ready_with_history_and_hover_with_live_fields():
    from kvlab.viz import EvictionView, PoolView
    p = BlockPool(64, with_storage=False)
    rec = record(p, RandomWorkload(p, seed=4, steps=60), 60, every=6)
    v = EvictionView(recording=rec)
    calls = []
    v.send = lambda content, buffers=None: calls.append((content, buffers))
    v._on_msg(v, {"type": "ready"}, [])
    assert [c["type"] for c, _ in calls] == ["history"] and calls[0][0]["reset"]
    assert [bytes(b) for b in calls[0][1]] == list(rec) and v.frame == rec[len(rec) - 1]
    pv = PoolView(p)
    calls.clear()
    pv.send = lambda content, buffers=None: calls.append((content, buffers))
    p.set_owner([0], 9)
    pv._on_msg(pv, {"type": "inspect", "block": 0}, [])
    pv._on_msg(pv, {"type": "inspect", "block": 10_000}, [])  # out of range: ignored
    assert len(calls) == 1 and calls[0][0]["owner"] == 9 and calls[0][0]["block"] == 0
    with pytest.raises(ConfigError, match="no frame"):
        PoolView(recording=Recording())


def test_dashboard_controls_selectors_and_bad_settings():
    from kvlab.viz import Dashboard
    d = Dashboard(num_blocks=256, block_size=16, seed=1)
    sent = d.frames_sent
    for _ in range(3):
        d._on_msg(d, {"type": "control", "action": "step"}, [])
    assert d.run.steps == 3 and d.frames_sent == sent + 3 and d.status == "paused"
    d._on_msg(d, {"type": "control", "action": "explode"}, [])  # ignored
    old = d.pool
    with pytest.raises(ConfigError, match="unknown eviction policy 'mru'"):
        d.policy = "mru"
    with pytest.raises(ConfigError, match="block size 0"):
        d.block_size = 0
    assert d.pool is old and d.policy == "lru" and d.block_size == 16
    d.block_size = 32
    assert d.pool.num_blocks == 128 and d.pool.block_size == 32 and d.run is None
    d.policy = "fifo"
    assert d.pool.policy.name == "fifo"
    d.workload = "bursty"
    d.step()
    assert d.workload_fn.preset == "bursty"
    d.pool.check_invariants()

    async def live() -> None:
        d.start()
        await asyncio.sleep(0.05)
        assert d.status == "running" and d.run.steps > 1
        d.pause()
        assert d.status == "paused"
        d.start()  # resume
        d.stop()
        await asyncio.gather(d.run.task, return_exceptions=True)
        assert d.run.task.done() and d.run.state == "stopped" and d.status == "idle"  # it can run afresh

    asyncio.run(live())
    assert not old.events.subscribers


def test_dashboard_presets_pick_panels_controls_and_workload():
    from kvlab.viz import Dashboard
    from kvlab.viz.views import DASHBOARD_PRESETS
    assert sorted(DASHBOARD_PRESETS) == ["block_size", "engine", "eviction", "fragmentation"]
    seen = {}
    for name, setup in DASHBOARD_PRESETS.items():
        d = Dashboard(preset=name, num_blocks=64)
        assert (d.preset, d.panels, d.controls, d.workload) == (name, setup["panels"], setup["controls"],
                                                              setup["workload"])
        assert set(d.controls) <= {"policy", "block_size", "workload"} and d.status == "idle"
        data, _ = d._repr_mimebundle_()
        seen[name] = base64.b64decode(data["image/png"])
        assert seen[name][:4] == b"\x89PNG"
    assert DASHBOARD_PRESETS["eviction"]["panels"] == ["pool", "eviction"]
    assert Dashboard(preset="eviction", workload="steady", policy="fifo").pool.policy.name == "fifo"
    with pytest.raises(ConfigError, match="unknown dashboard preset 'pie'"):
        Dashboard(preset="pie")
    with pytest.raises(ConfigError, match="unknown eviction policy 'mru'"):
        Dashboard(policy="mru")
    with pytest.raises(ConfigError, match="panels must name"):
        plot_dashboard(BlockPool(16, with_storage=False), panels=["pie"])


class Handle:
    """An IPython display handle: records the bundles it is updated with."""

    def __init__(self) -> None:
        self.updates: list[dict] = []

    def update(self, data, metadata=None, raw=False) -> None:
        assert raw
        self.updates.append(data)


def test_a_view_follows_its_run_and_its_pause_pauses_the_workload():
    from kvlab.viz import PoolView
    p = BlockPool(64, with_storage=False)
    view = PoolView(p)
    first = view.frame
    assert view.status == ""  # no run: the browser's play button replays pictures locally
    run = view.live(RandomWorkload(p, seed=3, steps=40), steps_per_second=400)
    assert view.run is run and view.status == "idle"
    view.displays.append(handle := Handle())
    view._on_msg(view, {"type": "control", "action": "step"}, [])
    assert run.steps == 1 and view.status == "paused" and decode_frame(view.frame).tail["run"] == \
        {"step": 1, "steps": 40}
    view._on_msg(view, {"type": "control", "action": "explode"}, [])  # not one of ours: ignored
    assert run.steps == 1 and not handle.updates

    async def main() -> None:
        view._on_msg(view, {"type": "control", "action": "run"}, [])
        await asyncio.sleep(0.01)
        assert view.status == "running"
        view._on_msg(view, {"type": "control", "action": "pause"}, [])
        frozen = run.steps
        await asyncio.sleep(0.01)
        assert view.status == "paused" and run.steps == frozen  # the workload paused, not just the picture
        assert decode_frame(view.frame).tail["run"]["step"] == frozen  # and the view shows where it stopped
        view._on_msg(view, {"type": "control", "action": "run"}, [])
        await run

    asyncio.run(main())
    assert run.state == view.status == "done" and run.steps == 40
    assert list(view.history) == [first] + list(run.recording)  # drawn again, the view holds every frame it sent
    assert len(view.history) == view.frames_sent
    (bundle,) = handle.updates  # the displays were redrawn once, from the final frame
    assert base64.b64decode(bundle["image/png"]) == figure_png(view.figure())
    last = decode_frame(view.frame)
    assert last.when == "第 40 / 40 步 (step)" and last.step == p.clock.now()
    watched = PoolView(p)
    watched.frames_received = 1  # a browser said it draws the view: its display is left as it is
    watched.displays.append(other := Handle())
    watched.live(RandomWorkload(p, seed=4, steps=5)).run()
    assert watched.status == "done" and not other.updates


def test_frames_count_workload_steps_and_evictions_say_when():
    p = BlockPool(16, with_storage=False)
    calls = [0]

    def step() -> bool:
        calls[0] += 1
        ids = p.allocate(2)
        p.mark_reusable(ids)
        p.free(ids)  # two more cached blocks
        return calls[0] < 30

    rec = record(p, step, 50)
    frames = [decode_frame(f) for f in rec]
    assert [f.tail["run"]["step"] for f in frames] == list(range(31)) and frames[-1].when == "第 30 / 50 步 (step)"
    assert frames[0].when == "第 0 / 50 步 (step)" and frames[-1].step > 30  # the pool clock is another count
    evictions = [(f.tail["run"]["step"], e) for f in frames for e in f.evictions]
    assert evictions and all(at == e["at"] for at, e in evictions)
    assert decode_frame(build_frame(p)).when == f"池的 {p.clock.now()} 次操作之后 (after pool operations)"


def test_infinite_scores_travel_as_json_the_browser_can_parse():
    from kvlab.core.eviction import OPTPolicy
    p = BlockPool(4, with_storage=False, eviction_policy=OPTPolicy(lambda b: float("inf")))
    with FrameBuilder(p) as b:
        ids = p.allocate(4)
        p.mark_reusable(ids)
        p.free(ids)
        p.allocate(1)
        data = b.build()
    text = data[-fr.HEADER.unpack_from(data)[-1]:].decode()  # the JSON tail, which JSON.parse must accept
    assert "Infinity" in text and json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    (e,) = decode_frame(data).evictions
    assert [s for _, s in e["candidates"]] == ["-Infinity"] * len(e["candidates"])
    assert palette.fmt_score(palette.shown_score("opt", float(e["candidates"][0][1]))) == "∞"


def test_every_view_carries_a_png_and_static_figures_render():
    from kvlab.viz import Dashboard, EvictionView, FragmentationView, PoolView
    p = BlockPool(128, with_storage=False)
    rec = record(p, RandomWorkload(p, preset="bursty", seed=2, steps=400), 400, every=20)
    for cls in (PoolView, EvictionView, FragmentationView):
        view = cls(recording=rec)
        data, _ = view._repr_mimebundle_()
        assert base64.b64decode(data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
        assert "application/vnd.jupyter.widget-view+json" in data
        assert view.frame == rec[len(rec) - 1]  # the PNG is drawn from the final frame, not the first
    assert base64.b64decode(PoolView(recording=rec)._repr_mimebundle_()[0]["image/png"]) == \
        figure_png(plot_pool(rec[len(rec) - 1]))
    data, _ = Dashboard(num_blocks=64)._repr_mimebundle_()
    assert base64.b64decode(data["image/png"])[:4] == b"\x89PNG"
    f = decode_frame(rec[len(rec) - 1])
    evictions = [e for fr_ in rec for e in decode_frame(fr_).evictions]
    assert evictions
    for fig in (plot_pool(p), plot_pool(f), plot_evictions(evictions), plot_evictions([]),
                plot_fragmentation(rec[0], [(0.1, 0, 0.2, 0.3)] * 3), plot_dashboard(f)):
        assert isinstance(fig, Picture) and fig._repr_png_()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match="expected a BlockPool"):
        plot_pool(42)


def test_one_palette_for_python_and_every_widget_module():
    from kvlab.viz.assets import VIEWS, esm_source
    for view in VIEWS:  # every module starts with the palette, generated from kvlab.viz.palette
        first = esm_source(view).split("\n", 1)[0]
        assert first == palette.palette_js().rstrip("\n")
        data = json.loads(first.removeprefix("const KV_PALETTE_DATA = ").removesuffix(";"))
        assert {k: tuple(v) for k, v in data["state"].items() if k != "GAP"} == STATE_RGB
        assert [g[0] for g in data["gauges"]] == [g[0] for g in palette.GAUGES]
    js = "\n".join((REPO / "widgets" / n).read_text() for n in ("common.js", "pool.js", "fragmentation.js",
                                                                "eviction.js", "dashboard.js", "chat.js",
                                                                "blocktable.js"))
    assert not re.findall(r"\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]", js)  # no colour copied into the JS
    assert set(palette.OKABE_ITO.values()) >= {STATE_RGB[k] for k in ("PENDING", "ALLOC1", "EVICTING", "CACHED")}
    # "just allocated" (the flash) is not the pending colour, and no two states share a colour
    assert palette.FLASH_RGB[fr.FLASH_ALLOCATED] != STATE_RGB["PENDING"]
    assert len(set(STATE_RGB.values())) == len(STATE_RGB) and palette.RUN_RGB not in STATE_RGB.values()
    p = BlockPool(16, with_storage=False)
    p.allocate(3)
    p.incref([1] * 7)
    p.mark_reusable([2])
    p.free([2])
    f = decode_frame(build_frame(p))
    colors, mapped = pool_colors(f), map_colors(f)
    assert colors[0].tolist() == list(STATE_RGB["ALLOC1"]) and colors[1].tolist() == list(STATE_RGB["ALLOC8"])
    assert colors[2].tolist() == list(STATE_RGB["CACHED"]) == mapped[2].tolist()  # same state, same colour
    assert mapped[3].tolist() == list(palette.RUN_RGB) and colors[3].tolist() == list(STATE_RGB["FREE"])


def test_every_policy_score_is_explained():
    from kvlab.core.eviction import POLICIES
    assert set(POLICIES) <= set(palette.SCORES)
    assert palette.shown_score("opt", -12.0) == 12 and palette.fmt_score(float("inf")) == "∞"
    assert palette.shown_score("lru", 446.0) == 446 and palette.fmt_score(0.25) == "0.250"


def test_export_html_embeds_everything(tmp_path):
    p = BlockPool(32, with_storage=False)
    rec = record(p, RandomWorkload(p, seed=9, steps=40), 40, every=8)
    for view in ("pool", "eviction", "fragmentation", "dashboard"):
        page = export_html(rec, tmp_path / f"{view}.html", view=view, title="<run>").read_text()
        frames = json.loads(re.search(r'<script id="kvlab-frames" type="application/json">(.*?)</script>', page,
                                      re.S).group(1))
        assert [base64.b64decode(s) for s in frames] == list(rec)
        assert "kvMount" in page and "KvReplayModel" in page and "&lt;run&gt;" in page
        assert not re.search(r"(src|href)=|https?://|import\s*\(", page)  # nothing to fetch
    with pytest.raises(ConfigError, match="no frame"):
        export_html([], tmp_path / "x.html")
    with pytest.raises(ConfigError, match="frame 1 of the recording"):
        export_html([rec[0], b"junk"], tmp_path / "x.html")
    with pytest.raises(ConfigError, match="unknown view"):
        export_html(rec, tmp_path / "x.html", view="pie")
    for kw in ({"recording": None}, {"recording": 5}, {"recording": "abc"}, {"recording": [None]},
               {"view": None}, {"view": ["pool"]}, {"title": None}, {"title": 5}, {"title": "\ud800"},
               {"path": None}, {"path": 5}):
        args = {"recording": rec, "path": tmp_path / "x.html", **kw}
        with pytest.raises(ConfigError):
            export_html(args.pop("recording"), args.pop("path"), **args)
    assert not (tmp_path / "x.html").exists()


def test_import_kvlab_loads_no_jupyter_and_views_load_lazily():
    code = ("import sys, kvlab, kvlab.viz\n"
            "assert not {'anywidget', 'ipywidgets', 'jupyter_client'} & set(sys.modules), sys.modules.keys()\n"
            "assert kvlab.PoolView is kvlab.viz.PoolView and 'anywidget' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_wheel_ships_the_widget_modules(wheel):
    from kvlab.viz.assets import VIEWS, esm_source, widget_dir
    assert widget_dir() == REPO / "widgets"
    assert all("export default" in esm_source(v) for v in VIEWS)
    names = set(wheel.namelist())
    for f in ("common.js", "pool.js", "eviction.js", "fragmentation.js", "dashboard.js", "chat.js", "blocktable.js",
              "replay.js", "kvlab.css"):
        assert f"kvlab/_widgets/{f}" in names, f
    assert "kvlab/viz/assets.py" in names


def test_figure_helpers_show_as_images_in_a_fresh_kernel(tmp_path):
    """The 2.2.4 bug: a bare matplotlib Figure in a kernel that never imported pyplot shows as text."""
    import nbformat
    from nbclient import NotebookClient
    cells = [
        "import sys\nfrom kvlab import BlockPool, PolicyRace, SweepResult, SweepRow, plot_sweep\n"
        "from kvlab.viz import build_frame, plot_dashboard, plot_evictions, plot_fragmentation, plot_pool\n"
        "p = BlockPool(64, with_storage=False); p.allocate(20); p.free([3, 4, 5])\n"
        "assert 'matplotlib.pyplot' not in sys.modules",
        "plot_fragmentation(build_frame(p))", "plot_pool(p)", "plot_evictions([])", "plot_dashboard(p)",
        "PolicyRace('w', 1, 16, (8, 16), {'lru': (0.1, 0.2)}, 0.3, {'lru': (0, 0)}).plot()",
        "plot_sweep(SweepResult('w', 1, [SweepRow(b, 4, 30, 4, 4, 10, 1, 64, 1.0) for b in (8, 16)]))",
        "assert 'matplotlib.pyplot' not in sys.modules",
        # a chapter's live view: displayed at step 0, its saved picture must end up the final frame
        "from kvlab.viz import PoolView, RandomWorkload\nq = BlockPool(64, with_storage=False)\nv = PoolView(q)\n"
        "first = v._repr_mimebundle_()[0]['image/png']\ndisplay(v)",
        "await v.live(RandomWorkload(q, seed=1, steps=30))\n"
        "import hashlib\nlast = v._repr_mimebundle_()[0]['image/png']\nassert last != first\n"
        "print(hashlib.sha256(last.encode()).hexdigest())",
        # a chapter's dashboard: shown, then stepped in the same cell; no run ends, the cell does
        "from kvlab.viz import Dashboard\nd = Dashboard(preset='eviction', num_blocks=64)\ndisplay(d)\n"
        "for _ in range(30):\n    d.step()\n"
        "print(hashlib.sha256(d._repr_mimebundle_()[0]['image/png'].encode()).hexdigest())",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    for cell in nb.cells[1:-4]:
        (out,) = cell.outputs
        assert "image/png" in out["data"], (cell.source, out["data"].get("text/plain"))
        assert base64.b64decode(out["data"]["image/png"])[:4] == b"\x89PNG"
    (shown,), (printed,) = nb.cells[-3].outputs, nb.cells[-2].outputs
    assert "application/vnd.jupyter.widget-view+json" in shown["data"]
    saved = hashlib.sha256(shown["data"]["image/png"].encode()).hexdigest()
    assert saved == printed["text"].strip()  # the output was updated in place to the final frame
    dash, stepped = nb.cells[-1].outputs
    assert hashlib.sha256(dash["data"]["image/png"].encode()).hexdigest() == stepped["text"].strip()


def with_tail(frame: bytes, tail: bytes) -> bytes:
    """``frame`` with its JSON tail replaced by ``tail`` (the header's length updated): a forged recording."""
    from kvlab.viz.frames import HEADER, HEADER_OFFSETS

    old = struct.unpack_from("<I", frame, HEADER_OFFSETS["tail_len"])[0]
    out = bytearray(frame[:len(frame) - old] + tail)
    struct.pack_into("<I", out, HEADER_OFFSETS["tail_len"], len(tail))
    assert len(out) >= HEADER.size
    return bytes(out)


def test_loading_a_recording_with_a_bad_frame_changes_nothing():
    """Every frame is decoded before the view takes any: a bad one leaves history, series and evictions as they
    were; a recording that is no frames at all, and a pool that is no pool, are typed errors."""
    from kvlab.viz import PoolView

    pool = BlockPool(8, with_storage=False)
    view = PoolView(pool)
    before = (list(view.history), list(view.series), list(view.evictions), view.frame, view.frames_sent)
    with pytest.raises(ConfigError, match="not a kvlab frame"):
        view.load([build_frame(pool), b"junk"])
    for bad in (5, None, "abc", b"KVF1", [1.5], [None], iter([])):
        with pytest.raises(ConfigError, match="recording"):
            view.load(bad)
    for tail in (b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b"[1, 2]", b'{"a": ' + b"1" * 5000 + b"}"):
        with pytest.raises(ConfigError, match="frame 1 of the recording is not valid: frame .* tail"):
            view.load([build_frame(pool), with_tail(build_frame(pool), tail)])
    assert (list(view.history), list(view.series), list(view.evictions), view.frame, view.frames_sent) == before
    for bad in ("x", 5):
        with pytest.raises(ConfigError, match="shows a BlockPool"):
            PoolView(bad)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "x", None])
def test_rates_and_step_counts_of_the_wrong_kind_are_refused_before_anything_runs(bad):
    """A frame rate or a speed is a finite number > 0 and a step count an int >= 1: each refused when given,
    not by a ZeroDivisionError or a traitlets error when the run starts."""
    from kvlab.viz import Dashboard, record

    pool = BlockPool(16, with_storage=False)
    with pytest.raises(ConfigError, match="fps"):
        Pacer(bad)
    with pytest.raises(ConfigError, match="fps"):
        LiveRun(pool, lambda: False, fps=bad)
    if bad is not None:  # None: no pacing of steps
        with pytest.raises(ConfigError, match="steps_per_second"):
            LiveRun(pool, lambda: False, steps_per_second=bad)
    for kw in ("fps", "speed"):
        with pytest.raises(ConfigError, match=kw):
            Dashboard(num_blocks=64, **{kw: bad})
    if bad is not None:  # None means "no limit" for a step count
        for kw in ("max_steps", "total_steps"):
            with pytest.raises(ConfigError, match=kw):
                LiveRun(pool, lambda: False, **{kw: bad})
        with pytest.raises(ConfigError, match="steps"):
            RandomWorkload(pool, steps=bad)
        with pytest.raises(ConfigError, match="steps"):
            Dashboard(num_blocks=64, steps=bad)
    with pytest.raises(ConfigError, match="steps|every"):
        record(pool, lambda: False, bad)
    with pytest.raises(ConfigError, match="every"):
        record(pool, lambda: False, 5, bad)
    dash = Dashboard(num_blocks=64)
    if isinstance(bad, (int, float)) and not isinstance(bad, bool):  # the trait itself refuses what is no float
        with pytest.raises(ConfigError, match="speed"):
            dash.speed = bad
    assert dash.speed == 200.0 and pool.clock.now() == 0


def test_frames_and_replay_paths_of_the_wrong_kind_are_typed_errors(tmp_path):
    from kvlab.viz import Dashboard, export_html

    pool = BlockPool(16, with_storage=False)
    for bad in (None, 5, "frame"):
        with pytest.raises(ConfigError, match="not a kvlab frame"):
            decode_frame(bad)
    for path in (None, 5, tmp_path / "nowhere" / "x.html", tmp_path, str(tmp_path / "a\0b.html")):
        with pytest.raises(ConfigError, match="path must be|cannot write the replay"):
            export_html([build_frame(pool)], path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="seed"):
        Dashboard(num_blocks=64, seed="x")
    with pytest.raises(ConfigError, match="seed"):
        RandomWorkload(pool, seed=1.5)
    with pytest.raises(ConfigError, match="BlockPool"):
        LiveRun("pool", lambda: False)


# ---------------------------------------------------------------------------- flashes, histories, runs: edges
def test_a_flash_lasts_one_frame():
    """A flash says what happened since the previous frame: a block allocated before frame 1 and untouched
    afterwards flashes in frame 1 only, and frame 2 shows no flash at all."""
    p = BlockPool(8, with_storage=False)
    with FrameBuilder(p) as b:
        p.allocate(2)
        assert decode_frame(b.build()).flash.tolist() == [fr.FLASH_ALLOCATED] * 2 + [fr.FLASH_NONE] * 6
        p.set_owner([0], 4)  # no flash for a change of owner
        assert decode_frame(b.build()).flash.tolist() == [fr.FLASH_NONE] * 8


def test_every_base_block_of_a_large_block_flashes():
    """In a buddy pool a class-2 block covers 4 base blocks: all 4 flash when it is allocated, and all 4 when it is
    freed, not only its first."""
    p = BlockPool(8, block_sizes=[16, 32, 64], with_storage=False)
    with FrameBuilder(p) as b:
        (big,) = p.allocate(1, size_class=2)
        (small,) = p.allocate(1)
        assert (big, small) == (0, 4)
        f = decode_frame(b.build())
        assert f.flash.tolist() == [fr.FLASH_ALLOCATED] * 5 + [fr.FLASH_NONE] * 3
        assert f.size_class.tolist() == [2, 2, 2, 2, 0, 0, 1, 1]  # the splits left a free class-0 5, class-1 6
        p.free([big])
        assert decode_frame(b.build()).flash.tolist() == [fr.FLASH_FREED] * 4 + [fr.FLASH_NONE] * 4


def test_a_block_swapped_out_flashes_freed():
    """A block that leaves through ``begin_eviction``/``finish_eviction`` (a swap-out: StatusChanged to FREE, no
    Freed event) flashes "freed" in the frame after; starting the eviction (ALLOCATED -> EVICTING) flashes
    nothing."""
    p = BlockPool(4, with_storage=False)
    with FrameBuilder(p) as b:
        ids = p.allocate(2)
        b.build()
        p.begin_eviction([ids[1]])
        f = decode_frame(b.build())
        assert f.flash.tolist() == [fr.FLASH_NONE] * 4 and f.state[ids[1]] == EVICTING
        p.finish_eviction([ids[1]])
        f = decode_frame(b.build())
        assert f.flash.tolist() == [fr.FLASH_NONE, fr.FLASH_FREED, fr.FLASH_NONE, fr.FLASH_NONE]
        assert f.state[ids[1]] == FREE


def test_a_long_history_goes_in_chunks_and_only_the_first_resets(monkeypatch):
    """A history larger than one message goes in several: the first tells the browser to start afresh
    (``reset``), the others add to it, and together they carry every frame once, in order, none over the chunk
    size."""
    from kvlab.viz import PoolView
    from kvlab.viz import views

    p = BlockPool(16, with_storage=False)
    rec = record(p, RandomWorkload(p, seed=2, steps=9), 9)
    assert len(rec) == 10
    size = max(len(f) for f in rec)
    monkeypatch.setattr(views, "HISTORY_CHUNK", 3 * size)  # at most 3 frames a message
    v = PoolView(recording=rec)
    calls = []
    v.send = lambda content, buffers=None: calls.append((content, buffers))
    v._on_msg(v, {"type": "ready"}, [])
    assert [c["reset"] for c, _ in calls] == [True] + [False] * (len(calls) - 1) and len(calls) >= 4
    assert all(c == {"type": "history", "reset": c["reset"], "index": 9} for c, _ in calls)
    assert [bytes(f) for _, bufs in calls for f in bufs] == list(rec)
    assert all(sum(map(len, bufs)) <= 3 * size for _, bufs in calls)


def test_changing_the_dashboards_setup_starts_the_series_afresh():
    """A new policy, block size or workload is a new pool: the fragmentation series and the evictions of the old
    run are dropped with it, leaving the one point of the fresh, empty pool."""
    from kvlab.viz import Dashboard

    d = Dashboard(num_blocks=64, block_size=16, seed=1)
    for _ in range(30):
        d.step()
    assert len(d.series) == 31 and d.series[-1] != (0.0, 0.0, 0.0, 0.0)
    assert d.workload == "bursty"
    for change in ({"policy": "fifo"}, {"block_size": 32}, {"workload": "steady"}):
        for _ in range(5):
            d.step()
        name, value = next(iter(change.items()))
        setattr(d, name, value)
        assert list(d.series) == [(0.0, 0.0, 0.0, 0.0)] and list(d.evictions) == [], name


def test_record_ends_with_the_last_step_whatever_the_interval():
    """``record(steps=10, every=3)`` of a workload that never ends frames steps 0, 3, 6, 9 and the last step,
    10; a workload that ends early (step 5) ends the recording with its last step."""
    p = BlockPool(16, with_storage=False)
    rec = record(p, lambda: True, 10, every=3)
    assert [decode_frame(f).tail["run"] for f in rec] == [{"step": s, "steps": 10} for s in (0, 3, 6, 9, 10)]
    calls = []
    rec = record(p, lambda: calls.append(1) or len(calls) < 5, 10, every=3)
    assert [decode_frame(f).tail["run"]["step"] for f in rec] == [0, 3, 5] and len(calls) == 5


@pytest.mark.parametrize("n", [1, 3])
def test_max_steps_runs_exactly_that_many_steps(n):
    """``LiveRun(max_steps=n)`` calls a step function that never ends exactly ``n`` times and is done."""
    p = BlockPool(16, with_storage=False)
    calls = []
    run = LiveRun(p, lambda: calls.append(1) or True, max_steps=n)
    assert run.run() == n and len(calls) == n and run.steps == n and run.state == "done"
    assert decode_frame(run.recording[len(run.recording) - 1]).tail["run"] == {"step": n, "steps": n}


def test_recording_never_drops_the_newest_frame():
    """Trimming to ``max_bytes`` drops the oldest frames, never the newest, even one larger than ``max_bytes``."""
    rec = Recording(max_bytes=10)
    for i in range(2):
        rec.append(bytes([i]) * 4)
    rec.append(b"\x09" * 25)
    assert list(rec) == [b"\x09" * 25] and rec.nbytes == 25 and rec.trimmed == 2
    rec.append(b"\x07" * 3)
    assert list(rec) == [b"\x07" * 3] and rec.nbytes == 3 and rec.trimmed == 3


@pytest.mark.parametrize("seed", range(4))
def test_the_fragmentation_picture_names_and_shows_what_the_detector_prints(seed):
    """One vocabulary: each gauge of the fragmentation picture carries a name the chapters' GLOSSARY.md defines,
    and the value beside it is the one ``FragmentationDetector.detect_fragmentation()`` prints under that name
    (the views called unusable free memory "external fragmentation" and the contiguity measure "free-space
    scatter", so 2.2.4 printed external_fragmentation 0.945 beside a picture saying 58.0%)."""
    from kvlab.memory.fragmentation import FragmentationDetector, memory_usage

    glossary = (REPO / "chapters" / "GLOSSARY.md").read_text()
    rng = random.Random(seed)
    p = BlockPool(256, block_sizes=[16, 32, 64, 128], with_storage=False, seed=seed)
    held = []
    for _ in range(60):
        if held and rng.random() < 0.4:
            p.free(held.pop(rng.randrange(len(held))))
        else:
            try:
                ids = p.allocate(1, size_class=rng.randrange(4))
            except Exception:  # noqa: BLE001 - a full pool: free instead
                continue
            p.set_token_counts(ids, [rng.randint(1, 16 << p.arrays.size_class[ids[0]])])
            held.append(ids)
    d = FragmentationDetector(p).detect_fragmentation()
    usage = memory_usage(p)
    printed = {"不可用空闲内存 unusable free memory": d["fragmentation_percent"],
               "外部碎片（连续性） external fragmentation (contiguity)": 100 * d["external_fragmentation"],
               "内部浪费 internal waste": 100 * d["internal_waste"],
               "占用块 blocks held": 100 * usage["used"] / usage["total"],
               "可复用缓存块 cached (reusable)": 100 * usage["cached"] / usage["total"]}  # printed under blocks held
    fig = plot_fragmentation(p)
    labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    shown = {m.group(1): float(m.group(2)) for m in (re.fullmatch(r"(.+) (\d+\.\d)%", s) for s in labels)}
    assert set(shown) == set(printed), labels
    for name, value in shown.items():
        assert f"**{name}**" in glossary, f"{name!r} is not a GLOSSARY.md name"
        assert value == pytest.approx(printed[name], abs=0.051), (name, value, printed[name])
    assert d["fragmentation_percent"] > 0 and d["external_fragmentation"] > 0  # both measures are exercised


def test_a_still_of_the_fragmentation_view_shows_its_one_point_in_the_time_series():
    """A still (one frame, no history) drew four lines of one point each: an empty panel (2.2.4's figure)."""
    fig = plot_fragmentation(BlockPool(64, with_storage=False))
    lines = fig.axes[2].get_lines()
    assert len(lines) == 4 and all(line.get_marker() == "o" and len(line.get_xdata()) == 1 for line in lines)


@given(st.lists(st.floats(0, 1e12, allow_nan=False), min_size=1, max_size=12))
def test_bars_start_at_zero_or_where_the_smallest_is_a_third_of_the_largest(scores):
    base = palette.bar_axis(scores)
    lo, hi = min(scores), max(scores)
    if base:
        assert lo > 2 * (hi - lo) and (lo - base) / (hi - base) == pytest.approx(1 / 3)
    else:
        assert hi == lo or lo <= 2 * (hi - lo)


def test_the_eviction_still_tells_a_victim_from_close_runners_up():
    """LRU's last uses 1109 and 1113 drew bars from zero of equal length; the still's axis now starts below the
    smallest score, and says where."""
    e = {"step": 5, "at": 3, "victim": 1, "policy": "lru", "reason": "allocation pressure",
         "candidates": [[1, 1109.0], [2, 1110.0], [3, 1113.0]], "axis": palette.bar_axis([1109.0, 1110.0, 1113.0])}
    fig = plot_evictions([e])
    ax = fig.axes[0]
    widths = [bar.get_width() for bar in ax.patches]
    assert widths[0] < 0.4 * widths[2] and ax.get_xlim()[0] == e["axis"] == 1107.0
    assert "坐标从 1107 起" in ax.get_xlabel()


def test_the_block_size_dashboard_offers_8_to_512_and_its_waste_moves_with_the_block():
    """2.2.1's point on its dashboard: the same requests (lengths in tokens, whatever the block size) waste more
    of a bigger block; the menu reaches 512, and a pool too small for a size is not offered it."""
    from kvlab.viz import Dashboard

    waste = {}
    for bs in (8, 16, 64, 256, 512):
        d = Dashboard(preset="block_size", num_blocks=512, seed=0)
        assert d.options["block_size"] == [8, 16, 32, 64, 128, 256, 512]
        d.block_size = bs
        assert d.own_pool.num_blocks * bs == 512 * 16  # the token capacity stays
        for _ in range(300):
            d.step()
        assert d.workload_fn is not None and d.workload_fn.max_tokens == 6 * 16  # the steady preset, in tokens
        waste[bs] = d.latest().internal_waste
    assert list(waste.values()) == sorted(waste.values()), waste  # more waste with every bigger block
    assert waste[8] < 0.1 < 0.5 < waste[512], waste
    assert Dashboard(preset="block_size", num_blocks=64, block_size=16).options["block_size"] == [8, 16, 32, 64, 128]


def test_an_interrupt_between_cells_pauses_a_background_run_and_leaves_cells_interruptible(monkeypatch):
    """ipykernel ignores SIGINT between cells; while a run goes on in the background, Kernel > Interrupt (SIGINT)
    pauses it instead of vanishing; a cell still gets Python's handler (ipykernel swaps it in per cell); once the
    run's task ends, SIGINT is ignored again. A process that does not run ipykernel is left as it was."""
    import os
    import types

    from kvlab.viz import live

    monkeypatch.setitem(sys.modules, "ipykernel", sys.modules.get("ipykernel", types.ModuleType("ipykernel")))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel between cells
    try:
        p = BlockPool(64, with_storage=False, seed=1)
        run = LiveRun(p, RandomWorkload(p, seed=1, steps=10**6), steps_per_second=1000)
        seen: list[str] = []

        async def main() -> None:
            run.start()
            await asyncio.sleep(0.05)
            assert run.state == "running" and signal.getsignal(signal.SIGINT) == live._between_cells._on_sigint
            os.kill(os.getpid(), signal.SIGINT)  # Kernel > Interrupt, no cell running
            await asyncio.sleep(0.05)
            seen.append(run.state)
            steps = run.steps
            await asyncio.sleep(0.05)
            assert run.steps == steps  # paused: no step taken
            cell = signal.signal(signal.SIGINT, signal.default_int_handler)  # what ipykernel does for a cell
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                await asyncio.sleep(0.05)
            signal.signal(signal.SIGINT, cell)
            assert run.state == "paused"  # a cell's interrupt is the cell's
            run.resume()
            await asyncio.sleep(0.05)
            seen.append(run.state)
            assert run.steps > steps
            run.stop()
            await asyncio.gather(run.task, return_exceptions=True)

        asyncio.run(main())
        assert seen == ["paused", "running"] and run.state == "stopped"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and live._between_cells.runs == []
        p.check_invariants()
        monkeypatch.delitem(sys.modules, "ipykernel")  # a script: SIG_IGN stays what its owner chose
        q = BlockPool(16, with_storage=False)
        assert asyncio.run(_handlers_during(LiveRun(q, RandomWorkload(q, seed=2, steps=20)))) == {signal.SIG_IGN}
    finally:
        signal.signal(signal.SIGINT, previous)


async def _handlers_during(run: LiveRun) -> set:
    """The SIGINT handlers seen while ``run`` goes on in the background, to its end."""
    run.start()
    seen = set()
    while not run.finished:
        seen.add(signal.getsignal(signal.SIGINT))
        await asyncio.sleep(0.001)
    return seen
