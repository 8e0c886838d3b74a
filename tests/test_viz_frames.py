"""Frames: one wire format (the browser gets Python's layout), built from the pool's events (held equal to a
fresh snapshot of the pool by random operations on BlockPool and FastBlockPool, one size and buddy), and encoded
once (Python never decodes a frame it built; decode_frame checks frames from elsewhere)."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import BlockPool, ConfigError, FastBlockPool
from kvlab.core.block import ALLOCATED, EVICTING, FREE, PENDING
from kvlab.core.errors import KVLabError
from kvlab.memory.fragmentation import DefragmentationStrategy
from kvlab.viz import FrameBuilder, LiveRun, RandomWorkload, decode_frame, frame_of
from kvlab.viz import frames as fr

REPO = Path(__file__).resolve().parent.parent
DATAVIEW_CODES = {"Uint8": "B", "Uint16": "H", "Int32": "i", "Uint32": "I", "Float32": "f", "Float64": "d"}


# ---------------------------------------------------------------------------- one wire format
def kv_frame(source: str) -> dict:
    """The KV_FRAME constant of a module's source."""
    (line,) = [x for x in source.splitlines() if x.startswith("const KV_FRAME = ")]
    return json.loads(line.removeprefix("const KV_FRAME = ").removesuffix(";"))


def test_the_browser_gets_pythons_layout():
    from kvlab.viz.assets import VIEWS, esm_source
    layout = kv_frame(fr.layout_js())
    for view in VIEWS:
        assert kv_frame(esm_source(view)) == layout, view
    values = {"magic": b"KVF1", "seq": 7, "num_blocks": 9, "block_size": 16, "step": 2.5, "blocks_held": 0.25,
              "unusable_free": 0.5, "internal_waste": 0.125, "external_fragmentation": 0.75, "flags": 1, "tail_len": 3}
    packed = fr.HEADER.pack(*(values[name] for name, _, _ in fr.HEADER_FIELDS))
    assert layout["headerSize"] == len(packed) and packed[:4].decode() == layout["magic"]
    assert [name for name, _, _ in layout["header"]] == [name for name, _, _ in fr.HEADER_FIELDS[1:]]
    for name, at, kind in layout["header"]:  # each field read where, and as what, the browser reads it
        assert struct.unpack_from("<" + DATAVIEW_CODES[kind], packed, at)[0] == values[name], name
    for key, table in (("body", fr.BODY), ("details", fr.DETAILS)):
        assert layout[key] == [[name, struct.calcsize(code), kind] for (name, code, _), (_, _, kind)
                               in zip(table, layout[key])]
        assert [DATAVIEW_CODES[kind] for _, _, kind in layout[key]] == [code for _, code, _ in table]
    assert layout["states"] == list(fr.STATE_NAMES) and layout["flashes"] == list(fr.FLASH_NAMES)
    assert layout["flagDetails"] == fr.FLAG_DETAILS and layout["flashBits"] == fr.FLASH_BITS
    js = "\n".join(p.read_text() for p in (REPO / "widgets").glob("*.js"))
    assert "KVF1" not in js and not re.search(r"get(Uint|Int|Float)\d+\(\d", js)  # no layout of its own
    assert "KVR1" not in js  # nor of the saved run's


def test_the_browser_gets_the_saved_runs_layout():
    from kvlab.viz import saved
    from kvlab.viz.assets import VIEWS, esm_source
    line = saved.layout_js()
    layout = json.loads(line.removeprefix("const KV_REPLAY = ").removesuffix(";"))
    for view in VIEWS:
        assert line in esm_source(view).splitlines(), view
    packed = saved.HEAD.pack(saved.MAGIC, 3, 40)
    assert layout["magic"].encode() == saved.MAGIC and layout["headSize"] == len(packed)
    assert {name: struct.unpack_from("<" + DATAVIEW_CODES[kind], packed, at)[0]
            for name, at, kind in layout["head"]} == {"every": 3, "total": 40}
    size, kind = layout["length"]
    assert size == saved.LENGTH.size and saved.LENGTH.format.endswith(DATAVIEW_CODES[kind])


# ---------------------------------------------------------------------------- frames from events
def heads(p: BlockPool, *states: int, referenced: bool | None = None) -> list[int]:
    """The blocks (first base blocks) in ``states``; with ``referenced``, only those with (or without) a
    reference."""
    a, ids = p.arrays, np.arange(p.num_blocks)
    keep = ((ids & ((1 << a.size_class.astype(np.int64)) - 1)) == 0) & np.isin(a.status, states)
    if referenced is not None:
        keep &= (a.refcount > 0) == referenced
    return np.flatnonzero(keep).tolist()


def pick(blocks: list[int], r: int, k: int) -> list[int]:
    """Up to ``k`` of ``blocks`` chosen by ``r`` (sometimes with the last one twice: a repeated id)."""
    if not blocks:
        return []
    out = [blocks[(r + 7 * i) % len(blocks)] for i in range(1 + r % k)]
    out = list(dict.fromkeys(out))
    return out + out[-1:] if r % 5 == 1 else out


def apply(p: BlockPool, op: str, r: int, s: int) -> None:
    """One pool operation chosen by ``op`` with arguments drawn from ``r`` and ``s``; a rejected call (a typed
    kvlab error) changes nothing."""
    top = p.max_order + 1
    try:
        if op == "allocate":  # under pressure this evicts cached blocks
            p.allocate(1 + r % 6, size_class=s % top, owner=r % 5)
        elif op == "reserve":
            p.reserve(1 + r % 3, size_class=s % top)
        elif op == "commit":
            p.commit(pick(heads(p, PENDING), r, 3))
        elif op == "free":
            p.free(pick(heads(p, ALLOCATED, PENDING, referenced=True), r, 3 if s % 2 else 12))
        elif op == "incref":
            p.incref(pick(heads(p, ALLOCATED), r, 4))
        elif op == "decref":
            p.decref(pick(heads(p, ALLOCATED, referenced=True), r, 3))
        elif op == "reusable":
            p.mark_reusable(pick(heads(p, ALLOCATED, PENDING), r, 4), s % 3 != 0)
        elif op == "release":
            p.release_cached(pick(heads(p, ALLOCATED, referenced=False), r, 1)[0])
        elif op == "evict":
            p.evict("drawn")
        elif op == "swap_out":
            p.begin_eviction(pick(heads(p, ALLOCATED), r, 2))
        elif op == "swap_done":
            p.finish_eviction(pick(heads(p, EVICTING), r, 2))
        elif op == "split":
            p.split_block(pick([b for b in heads(p, FREE) if p.arrays.size_class[b]], r, 1)[0])
        elif op == "merge":
            p.merge_free_buddies(r % 4 or None)
        elif op == "migrate":  # the highest ALLOCATED blocks into the lowest FREE ones of their class
            k = s % top
            src = [b for b in heads(p, ALLOCATED) if p.arrays.size_class[b] == k][::-1][:1 + r % 3]
            dst = [b for b in heads(p, FREE) if p.arrays.size_class[b] == k][:len(src)]
            p.migrate(src[:len(dst)], dst)
        elif op == "defragment":
            DefragmentationStrategy(p, minimum_fragmentation=0).defragment(force=True, max_moves=1 + r % 4)
        elif op == "tokens":  # details only: no event
            (b,) = pick(heads(p, ALLOCATED, PENDING), r, 1)[:1]
            p.set_token_counts([b], [s % (p.block_size * p.span(b) + 1)])
        elif op == "owner":
            p.set_owner(pick(heads(p, ALLOCATED, PENDING), r, 3), s % 4)
        elif op == "touch":
            p.touch(pick(heads(p, ALLOCATED), r, 3))
    except (KVLabError, IndexError, ValueError):  # a rejected call, or nothing to pick
        pass


OPS = ("allocate", "reserve", "commit", "free", "incref", "decref", "reusable", "release", "evict", "swap_out",
       "swap_done", "split", "merge", "migrate", "defragment", "tokens", "owner", "touch")


def unflashed(f: fr.Frame) -> bytes:
    """The frame's bytes less what only a following builder has: its number, its flashes and its tail."""
    data = bytearray(f.data)
    (tail_len,) = struct.unpack_from("<I", data, fr.HEADER_OFFSETS["tail_len"])
    for name in ("seq", "tail_len"):
        struct.pack_into("<I", data, fr.HEADER_OFFSETS[name], 0)
    meta = slice(fr.HEADER.size + 2 * f.num_blocks, fr.HEADER.size + 3 * f.num_blocks)
    data[meta] = (np.frombuffer(data[meta], np.uint8) >> fr.FLASH_BITS << fr.FLASH_BITS).tobytes()
    return bytes(data[:len(data) - tail_len])


@settings(max_examples=150, deadline=None)
@given(fast=st.booleans(), buddy=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**16), st.integers(0, 2**16)), max_size=80))
def test_frames_from_events_equal_frames_from_a_snapshot(fast, buddy, ops):
    """Random operations (allocation under pressure evicts; reservations, commits, frees, shared references,
    reusable and cached blocks, swaps, splits, merges, migrations, defragmentation): every frame a following
    builder makes equals, byte for byte but for its number, flashes and tail, a frame read from the pool afresh."""
    cls = FastBlockPool if fast else BlockPool
    p = cls(32, block_sizes=[16, 32, 64] if buddy else None, with_storage=False, seed=1)
    with FrameBuilder(p) as b:
        for i, (op, r, s) in enumerate(ops):
            apply(p, op, r, s)
            assert unflashed(b.frame()) == unflashed(frame_of(p)), (i, op)
        p.check_invariants()
        assert b.resyncs == 1  # the events alone kept up: the pool was read once, when the builder attached


def test_frames_from_events_on_a_busy_fast_pool():
    """A long bursty run on the compiled pool (its C paths publish the same events), 65,536 blocks as in the
    benchmark, checked every 500 steps."""
    p = FastBlockPool(65_536, with_storage=False, seed=0)
    w = RandomWorkload(p, preset="bursty", seed=0)
    with FrameBuilder(p) as b:
        p.free(p.allocate(30_000)[::2])  # one large event of each kind
        for i in range(3000):
            w()
            if i % 500 == 0:
                assert unflashed(b.frame()) == unflashed(frame_of(p))
        assert b.resyncs == 1
    w.close()


def test_a_change_no_event_reports_is_caught():
    """An evict hook that raises stops the pool call after its victim went FREE and before the Evicted event:
    the builder sees the FREE count disagree and reads the pool again. A builder the bus dropped does too."""
    p = BlockPool(8, with_storage=False)
    with FrameBuilder(p) as b:
        ids = p.allocate(8)
        p.mark_reusable(ids)
        p.free(ids)  # all cached

        def broken(block: int) -> None:
            raise RuntimeError("a broken hook")

        p.evict_hooks.append(broken)
        with pytest.raises(RuntimeError):
            p.allocate(1)
        p.evict_hooks.remove(broken)
        assert unflashed(b.frame()) == unflashed(frame_of(p)) and b.resyncs == 2
        p.events.remove(b._on_event)  # what the bus does to a subscriber that raised
        p.allocate(2)
        assert unflashed(b.frame()) == unflashed(frame_of(p)) and b.resyncs == 3


# ---------------------------------------------------------------------------- encoded once
def test_a_built_frame_holds_what_its_bytes_say():
    p = BlockPool(64, block_sizes=[16, 32, 64], with_storage=False, seed=2)
    w = RandomWorkload(p, preset="defrag", seed=2, steps=300)
    with FrameBuilder(p) as b:
        b.step, b.steps = 0, 300
        frames = []
        while w():
            if w.done % 50 == 0:
                frames.append(b.frame(note=w.done))
    assert any(f.evictions for f in frames) and any(f.moves for f in frames)
    for f in frames:
        g = decode_frame(f.data)
        for name in fr.Frame.__dataclass_fields__:
            x, y = getattr(f, name), getattr(g, name)
            assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y), name


def test_python_never_decodes_a_frame_it_built(monkeypatch):
    """Views, live runs, static figures and the ChatView's frames use the Frame the builder made;
    decode_frame is left to frames from elsewhere (a loaded recording)."""
    from kvlab.viz import Dashboard, FragmentationView, PoolView, static, views

    def refuse(data: bytes) -> fr.Frame:
        raise AssertionError("a frame built in this process was decoded")

    monkeypatch.setattr(views, "decode_frame", refuse)
    monkeypatch.setattr(static, "decode_frame", refuse)
    p = BlockPool(64, with_storage=False)
    pv, frag = PoolView(p), FragmentationView(p)
    run = LiveRun(p, RandomWorkload(p, seed=1, steps=40), [pv, frag])
    run.run()
    assert pv.frames_sent == frag.frames_sent == 1 + run.frames_sent and len(frag.series) == frag.frames_sent
    assert pv.frame == run.recording[len(run.recording) - 1] and pv.shown is not None and pv.shown.data is pv.frame
    pv.figure(), frag.figure(), static.plot_dashboard(p)
    d = Dashboard(num_blocks=64, seed=1)
    d.step()
    d.figure()
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="not a kvlab frame"):
        PoolView(recording=[b"junk"])  # a recording from elsewhere is checked


def test_decode_names_what_is_wrong():
    data = frame_of(BlockPool(16, with_storage=False), note="x").data
    (tail_len,) = struct.unpack_from("<I", data, fr.HEADER_OFFSETS["tail_len"])
    with pytest.raises(ConfigError, match="not a kvlab frame"):
        decode_frame(data[:10])
    with pytest.raises(ConfigError, match="is no bytes"):
        decode_frame("KVF1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tail is not JSON"):
        decode_frame(data[:-tail_len] + b"{" * tail_len)
    with pytest.raises(ConfigError, match="not a JSON object"):
        decode_frame(data[:-tail_len] + b" " * (tail_len - 2) + b"[]")
    assert decode_frame(memoryview(data)).tail == {"note": "x"}
