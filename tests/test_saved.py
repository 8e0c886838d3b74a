"""The run a view saves with the notebook (kvlab.viz.saved): packed frames come back equal, a long run keeps a
regular subset that always holds the first and the last frame and fits the budget, a packing that is not one is
refused naming what is wrong, and a view keeps its ``replay`` trait current: after a run ends, after each cell,
after loading a recording, and not again when nothing changed."""
from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import BlockPool, ConfigError
from kvlab.viz import LiveRun, PoolView, RandomWorkload, record, saved, views


def run_frames(steps: int = 120, n: int = 64, seed: int = 1) -> list[bytes]:
    p = BlockPool(n, with_storage=False, seed=seed)
    return list(record(p, RandomWorkload(p, preset="defrag", seed=seed, steps=steps), steps))


@given(st.integers(1, 500), st.integers(1, 64))
def test_kept_is_every_nth_frame_and_the_last(total, every):
    keep = saved.kept(total, every)
    assert keep[0] == 0 and keep[-1] == total - 1
    assert keep == sorted(set(keep))
    assert keep[:-1] == list(range(0, total - 1, every))[:len(keep) - 1]
    assert all(b - a == every for a, b in zip(keep, keep[1:-1]))


def test_a_run_that_fits_comes_back_frame_for_frame():
    frames = run_frames()
    got, every, total = saved.unpack_frames(saved.pack_frames(frames))
    assert (got, every, total) == (frames, 1, len(frames))
    assert saved.pack_frames([]) == b""


@pytest.mark.parametrize("budget", [2_000, 4_000, 8_000])
def test_a_long_run_keeps_every_nth_frame_within_the_budget(budget):
    frames = run_frames(400, 256)
    packed = saved.pack_frames(frames, budget)
    got, every, total = saved.unpack_frames(packed)
    assert every > 1 and total == len(frames) and len(packed) <= budget
    assert got == [frames[i] for i in saved.kept(total, every)]
    assert saved.unpack_frames(saved.pack_frames(frames, budget * 64))[1] < every  # more room, more frames


def test_a_budget_too_small_for_two_frames_still_keeps_the_first_and_last():
    frames = run_frames(50)
    got, every, total = saved.unpack_frames(saved.pack_frames(frames, 10))
    assert every >= total and got == [frames[0], frames[-1]]


def _packing(body: bytes, every: int = 1, total: int = 1, magic: bytes = b"KVR1") -> bytes:
    return struct.pack("<4sII", magic, every, total) + zlib.compress(body)


def _framed(*frames: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(f)) + f for f in frames)


def bad_packings():
    frames = run_frames(10)
    good = saved.pack_frames(frames)
    return [
        ("not bytes", "a text", "is bytes, not"),
        ("short", b"KVR", "not a packed kvlab replay: 3 bytes"),
        ("magic", b"KVF1" + good[4:], "expected b'KVR1'"),
        ("every 0", _packing(_framed(frames[0]), every=0), "every 0 of 1 frames"),
        ("total 0", _packing(_framed(frames[0]), total=0), "every 1 of 0 frames"),
        ("not zlib", good[:12] + b"\x00garbage", "do not decompress"),
        ("cut short", good[:-5], "cut short"),
        ("trailing", good + b"\x00\x01", "2 bytes after its frames"),
        ("length cut", _packing(_framed(frames[0])[:-len(frames[0])] + b"\x01\x02"), "claims"),
        ("half a length", _packing(_framed(frames[0]) + b"\x01\x00"), "inside the length of frame 1"),
        ("a bad frame", _packing(_framed(b"KVF1" + b"\x00" * 40)), "frame 0 of a packed replay is not valid"),
        ("count", _packing(_framed(frames[0], frames[1]), total=5), "should hold 5, holds 2"),
    ]


@pytest.mark.parametrize("name,data,message", bad_packings(), ids=[b[0] for b in bad_packings()])
def test_a_packing_that_is_not_one_is_refused_naming_what_is_wrong(name, data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        saved.unpack_frames(data)


def test_a_small_packing_that_inflates_past_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(saved, "UNPACKED_LIMIT", 1 << 16)
    bomb = _packing(b"\x00" * (1 << 20))  # ~1 KB that inflates to 1 MB
    assert len(bomb) < 2_000
    with pytest.raises(ConfigError, match="inflate past 65,536 bytes"):
        saved.unpack_frames(bomb)


def test_a_view_saves_its_run_when_the_run_ends_after_each_cell_and_on_load():
    p = BlockPool(64, with_storage=False, seed=2)
    v = PoolView(p)
    assert v.replay == b""  # nothing packed before a cell or a run ends
    run = LiveRun(p, RandomWorkload(p, seed=2, steps=200), [v], fps=1e9)  # every step's frame is sent
    run.run()
    got, every, total = saved.unpack_frames(v.replay)
    assert got == list(v.history) and every == 1 and total == len(v.history) > 100
    before = v.replay
    views._refresh_after_cell()  # nothing new since: not packed again (the same bytes object)
    assert v.replay is before
    p.allocate(1)
    v.update()
    views._DISPLAYED.add(v)
    try:
        views._refresh_after_cell()  # the hook IPython calls after each cell
    finally:
        views._DISPLAYED.discard(v)
    assert saved.unpack_frames(v.replay)[0] == list(v.history)
    w = PoolView(recording=v.history)
    assert saved.unpack_frames(w.replay)[0] == list(v.history)
