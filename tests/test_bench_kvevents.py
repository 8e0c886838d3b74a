"""benchmarks/bench_kvevents.py at tiny sizes: every part runs and reports well-formed rows (never how fast: the
figures live in docs/benchmarks.md), its payloads decode to the events they were made from in both encodings,
and RemoteCacheView's pacing, which the benchmark's redraw rows rest on: a burst costs one redraw, and on a fake
clock the redraws over a long stream of batches stay within fps x elapsed + 1."""
from __future__ import annotations

import asyncio
import math

import msgspec

from kvlab.app import bench
from kvlab.kvevents import Subscriber, decode_batch
from kvlab.viz import remote
from kvlab.viz.remote import MAX_DRAWN, RemoteCacheView

kv = bench.load("bench_kvevents")
KEYS = {"name", "value", "unit", "baseline", "ratio", "goal"}


def check_rows(rows, unit, n):
    assert len(rows) == n, rows
    for r in rows:
        assert set(r) == KEYS and r["unit"] == unit, r
        assert math.isfinite(r["value"]) and r["value"] > 0 and math.isfinite(r["ratio"]) and r["ratio"] > 0, r


def test_decode_and_model_rows_cover_both_encodings_and_both_shapes():
    rows = kv.decode_rows(rounds=1, reps=1)
    check_rows(rows, "events/s", 4)
    assert [r["name"].split(",")[1].strip() for r in rows] == ["map encoding", "array encoding"] * 2
    assert all(r["goal"].startswith(">= 200,000 events/s (") for r in rows[:2]) and rows[2]["goal"] == "-"
    check_rows(kv.model_rows(rounds=1, n_batches=1), "events/s", 2)


def test_the_payloads_are_both_encodings_of_the_same_events():
    data = kv.payloads((3, 2), seed=5)
    events = kv.stored_events(3, 2, seed=5)
    assert decode_batch(data["map"]).events == decode_batch(data["array"]).events == events
    raw_map, raw_array = (msgspec.msgpack.decode(data[k])[1][0] for k in ("map", "array"))
    assert raw_map["type"] == "BlockStored" and raw_map["block_size"] == kv.B
    assert raw_array[0] == "BlockStored" and len(raw_array) == 1 + len(kv.SGLANG_STORED)  # SGLang's six fields
    assert [e.parent_block_hash for e in events[1:]] == [e.block_hashes[-1] for e in events[:-1]]


def test_view_rows_draw_each_block_and_fall_back_to_bars():
    state = kv.busy_state(MAX_DRAWN + 1, timeline=5)
    assert len(state.cache) == MAX_DRAWN + 1 and len(state.timeline) == 5
    rows = kv.view_rows((10, MAX_DRAWN + 1), rounds=1)
    check_rows(rows, "ms", 2)
    assert "(each drawn)" in rows[0]["name"] and "(bars per column)" in rows[1]["name"]


def test_rate_rows_report_frames_and_batches_for_each_fps_drawn_and_not():
    rows = kv.rate_rows(seconds=0.05, n_batches=6, cached=2)
    assert len(rows) == 8 and all(set(r) == KEYS for r in rows)
    assert [r["unit"] for r in rows] == ["frames/s", "batches/s"] * 4
    assert [r["baseline"] for r in rows[::2]] == [4.0, 30.0] * 2
    assert all(r["goal"] == "<= fps (met)" for r in rows[::2])


def counting_view(fps):
    """A RemoteCacheView on a Subscriber that never listens (closed once the view starts it); its redraws are
    counted, not drawn. Call inside a running loop."""
    sub = Subscriber("tcp://127.0.0.1:1")
    view = RemoteCacheView(sub, fps=fps)
    sub.close()
    drawn = [0]
    view.redraw = lambda: drawn.__setitem__(0, drawn[0] + 1)
    return sub, view, drawn


def deliver(sub, r):
    for fn in list(sub.callbacks):  # as the subscriber's task delivers a batch
        fn(r)


def test_a_burst_delivered_in_one_loop_turn_costs_exactly_one_redraw():
    async def go():
        sub, view, drawn = counting_view(30)
        for r in kv.feed_batches(1000, cached=10):
            deliver(sub, r)
        assert drawn[0] == 0 and view._pending is not None  # one redraw waits, whatever the burst
        while view._pending is not None:
            await asyncio.sleep(view.interval)
        view.close()
        return drawn[0], view.state.batches

    assert asyncio.run(go()) == (1, 1000)


def test_redraws_over_a_stream_stay_within_fps_on_a_fake_clock(monkeypatch):
    """One batch per fake millisecond for 10 fake seconds: never more than fps redraws a second (+1), and no fewer
    than one per interval plus the millisecond a due redraw waits for the next batch's turn (-1)."""
    async def go(fps):
        loop = asyncio.get_running_loop()
        now, due = [0.0], []

        def call_later(delay, fn, *args):
            handle = asyncio.TimerHandle(now[0] + delay, fn, args, loop)
            due.append((handle, fn, args))
            return handle

        sub, view, drawn = counting_view(fps)
        monkeypatch.setattr(loop, "call_later", call_later)
        # the view times its pictures to pace the next one: on this clock a picture takes no time, as it should
        # (timed by the wall clock, a collector pause on a loaded machine made one look slow and delayed the next)
        monkeypatch.setattr(remote.time, "perf_counter", lambda: now[0])
        batches = kv.feed_batches(50, cached=5)
        for k in range(10_000):
            now[0] = k / 1000
            for timer in [t for t in due if t[0].when() <= now[0]]:
                due.remove(timer)
                handle, fn, args = timer
                if not handle.cancelled():
                    fn(*args)
            deliver(sub, batches[k % len(batches)])
        view.close()
        return drawn[0]

    for fps in (4.0, 30.0):
        drawn = asyncio.run(go(fps))
        assert 10 / (1 / fps + 0.001) - 1 <= drawn <= fps * 10 + 1, (fps, drawn)
