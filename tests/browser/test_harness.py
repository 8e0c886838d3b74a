"""Each widget module in headless Chromium with a fake anywidget model: pixel colours for known pool states,
flashes, frame counters, the player (one pause, step back / scrub, replay), controls, legends, the same colour
for the same state in every view (read back from the screen), and the standalone HTML replay."""
from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import pytest
import numpy as np
from PIL import Image

from conftest import REPO

from kvlab import BlockPool
from kvlab.viz import FrameBuilder, RandomWorkload, build_frame, decode_frame, export_html, record
from kvlab.viz import frames as fr
from kvlab.viz.palette import (CANDIDATE_RGB, FLASH_RGB, FLASH_WEIGHT, MOVE_RGB, OUTLINE_RGB, RUN_RGB, STATE_RGB,
                               VICTIM_RGB)
from kvlab.viz.static import pool_colors

pytestmark = pytest.mark.browser
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"

B64 = lambda data: base64.b64encode(data).decode()  # noqa: E731


def mix(a, b, w):
    return [round(x + (y - x) * w) for x, y in zip(a, b)]


CELL_JS = """([b, panel]) => {
  const p = document.querySelector('.kv-root').kv.panels[panel], g = p.layout();
  return kvt.pixel(p.canvas, (b % g.cols) * g.cell + 1, Math.floor(b / g.cols) * g.cell + 1);
}"""


def mount(page, view: str, frames: list[bytes] = (), state: str = "{}") -> None:
    page.evaluate(f"async () => {{ window.m = await kvt.mount({view!r}, {state}); }}")
    for f in frames:
        page.evaluate("(s) => m.push(kvt.b64(s))", B64(f))


def cell(page, b: int, panel: int = 0) -> list[int]:
    return page.evaluate(CELL_JS, [b, panel])


def root_data(page) -> dict:
    return page.evaluate("() => ({...document.querySelector('.kv-root').dataset})")


def test_pool_view_colours_for_a_known_state(harness, known_pool):
    p, keys = known_pool
    mount(harness, "pool", [build_frame(p)])
    alloc2 = mix(STATE_RGB["ALLOC1"], STATE_RGB["ALLOC8"], 1 / 7)
    for b, key in enumerate(keys):
        assert cell(harness, b) == (list(STATE_RGB[key]) if key else alloc2), f"block {b}"
    assert root_data(harness)["framesReceived"] == "1"


DECODED_JS = """(names) => {
  const f = document.querySelector('.kv-root').kv.hist.at(-1), out = { tail: f.tail };
  for (const name of names) out[name] = f[name].length === undefined ? f[name] : Array.from(f[name]);
  for (const [name, d] of Object.entries(f.details || {}))
    out[name] = Array.from({ length: f.num_blocks }, (_, i) => f.dv[`get${d.type}`](d.at + d.size * i, true));
  return out;
}"""


@pytest.mark.parametrize("blocks", [48, fr.DETAILS_LIMIT + 3])  # with and without details; an odd offset
def test_the_browser_decodes_what_python_packed(harness, blocks):
    """kvDecode reads, by Python's layout (KV_FRAME), every header field, section and the tail of a frame with
    size classes, evictions and moves, as Python's Frame holds them."""
    p = BlockPool(blocks, block_sizes=[16, 32, 64], with_storage=False, seed=0)
    w = RandomWorkload(p, preset="defrag", seed=3, steps=400)
    with FrameBuilder(p) as b:
        b.step, b.steps = 0, 400
        while w():
            pass
        p.incref([p.allocate(1)[0]] * 300)  # a refcount past 255
        f = b.frame()
    mount(harness, "pool", [f.data])
    got = harness.evaluate(DECODED_JS, [n for n, _, _ in fr.HEADER_FIELDS[1:] + fr.BODY])
    header = dict(zip((n for n, _, _ in fr.HEADER_FIELDS), fr.HEADER.unpack_from(f.data)))
    for name, _, _ in fr.HEADER_FIELDS[1:]:
        assert got[name] == header[name], name
    for name, _, _ in fr.BODY + (fr.DETAILS if f.tokens is not None else ()):
        assert got[name] == getattr(f, name).tolist(), name
    assert (f.tokens is None) == ("tokens" not in got) and got["tail"] == f.tail
    assert f.evictions and f.moves and f.size_class.any() and 255 in got["refcount"]


def test_pool_view_large_pool_and_refcount_numbers(harness):
    p = BlockPool(65536, with_storage=False)
    p.allocate(40000)
    p.incref(list(range(0, 40000, 7)))
    mount(harness, "pool", [build_frame(p)])
    g = harness.evaluate("() => document.querySelector('.kv-root').kv.panels[0].layout()")
    assert (g["cols"], g["rows"]) == (256, 256) and g["cell"] >= 2
    assert cell(harness, 1) == list(STATE_RGB["ALLOC1"])
    assert cell(harness, 65535) == list(STATE_RGB["FREE"])
    assert cell(harness, 7) == mix(STATE_RGB["ALLOC1"], STATE_RGB["ALLOC8"], 1 / 7)


GRID_JS = """() => {
  // Every cell's colour at three points (its top-left, centre and bottom-right pixel), as base64 RGB.
  const p = document.querySelector('.kv-root').kv.panels[0], g = p.layout();
  const img = p.canvas.getContext('2d').getImageData(0, 0, g.w, g.h).data, out = new Uint8Array(g.n * 9);
  for (let b = 0; b < g.n; b++) {
    const x0 = (b % g.cols) * g.cell, y0 = Math.floor(b / g.cols) * g.cell;
    [[0, 0], [g.cell >> 1, g.cell >> 1], [g.cell - 1, g.cell - 1]].forEach(([dx, dy], k) => {
      const o = ((y0 + dy) * g.w + x0 + dx) * 4;
      out.set(img.subarray(o, o + 3), b * 9 + k * 3);
    });
  }
  let s = ''; for (let i = 0; i < out.length; i += 8192) s += String.fromCharCode(...out.subarray(i, i + 8192));
  return [g.cell, btoa(s)];
}"""


def test_a_65536_block_grid_paints_every_cell_in_its_colour_with_flashes_of_every_age(harness):
    """The large-pool paint (one pixel per block, scaled up) against the palette: each cell, whole, has its
    state's colour blended towards its newest flash by that flash's age, as in the small grids."""
    p = BlockPool(65536, with_storage=False, seed=3)
    w = RandomWorkload(p, preset="sharing", seed=3)
    with FrameBuilder(p) as b:
        frames = []
        for _ in range(6):
            for _ in range(300):
                w()
            frames.append(b.build())
    mount(harness, "pool", frames)
    cell_px, data = harness.evaluate(GRID_JS)
    assert cell_px < 6  # the scaled-up path
    got = np.frombuffer(base64.b64decode(data), np.uint8).reshape(-1, 3, 3)
    decoded = [decode_frame(f) for f in frames]
    want = pool_colors(decoded[-1]).astype(np.float64)
    base = want.copy()
    for age in (3, 2, 1, 0):  # newest flash wins
        fl = decoded[-1 - age].flash
        for code in set(np.unique(fl).tolist()) - {0}:
            at = fl == code
            want[at] = np.floor(base[at] + (np.array(FLASH_RGB[code]) - base[at]) * FLASH_WEIGHT[age] + 0.5)
    assert all(np.any(decoded[-1 - age].flash) for age in range(4))  # every age is on show
    for k in range(3):
        bad = np.flatnonzero((got[:, k] != want).any(axis=1))
        assert bad.size == 0, (k, bad[:5], got[bad[:5], k], want[bad[:5]])

def test_size_classes_are_outlined(harness):
    p = BlockPool(64, block_sizes=[16, 32, 64], with_storage=False)
    p.allocate(1, size_class=2)  # blocks 0..3, one block
    mount(harness, "pool", [build_frame(p)])
    g = harness.evaluate("() => document.querySelector('.kv-root').kv.panels[0].layout()")
    outline = harness.evaluate("([x, y]) => kvt.pixel(document.querySelector('.kv-root').kv.panels[0].canvas, x, y)",
                               [g["cell"], 0])  # top edge of the 4-wide block, inside its span
    assert outline == list(OUTLINE_RGB)
    assert cell(harness, 1) == list(STATE_RGB["ALLOC1"])


def test_flashes_fade_over_frames_and_counters_match(harness):
    p = BlockPool(16, with_storage=False)
    b = FrameBuilder(p)
    frames = [b.build()]
    p.allocate(1)  # block 0 just allocated
    frames.append(b.build())
    frames.append(b.build())  # nothing new: block 0's flash fades
    mount(harness, "pool", frames)
    flash = FLASH_RGB[fr.FLASH_ALLOCATED]
    harness.evaluate("() => document.querySelector('.kv-root').kv.show(1)")
    assert cell(harness, 0) == list(flash) != list(STATE_RGB["PENDING"])  # "just allocated" is not "pending"
    harness.evaluate("() => document.querySelector('.kv-root').kv.show(2)")
    assert cell(harness, 0) == mix(STATE_RGB["ALLOC1"], flash, 0.6)
    d = root_data(harness)
    assert d["framesReceived"] == d["framesSent"] == "3"
    assert harness.evaluate("() => [m.get('frames_received'), m.saves]") == [3, 3]
    assert harness.evaluate("() => m.sent[0].type") == "ready"


def test_the_end_of_a_run_shows_states_not_the_last_flash(harness):
    """A flash fades over the pictures after it; at the end of a run none come, so once the run has ended (or
    the view replays a saved run, or a page has no kernel) the last picture shows the blocks' states. Earlier
    pictures keep their flashes, and a running view shows the newest one."""
    p = BlockPool(16, with_storage=False)
    b = FrameBuilder(p)
    frames = [b.build()]
    p.allocate(1)  # block 0 just allocated, in the last picture
    frames.append(b.build())
    mount(harness, "pool", frames, '{status: "running"}')
    flash = list(FLASH_RGB[fr.FLASH_ALLOCATED])
    assert cell(harness, 0) == flash
    harness.evaluate("() => { m.set('status', 'done'); m.emit('change:status'); }")
    assert cell(harness, 0) == list(STATE_RGB["ALLOC1"])
    assert root_data(harness)["index"] == "1"
    harness.evaluate("() => document.querySelector('.kv-root').kv.show(0)")  # an earlier picture: as it was
    assert cell(harness, 0) == list(STATE_RGB["FREE"])
    harness.evaluate("() => { document.getElementById('app').innerHTML = ''; globalThis.kvlabNoKernel = true; }")
    try:
        mount(harness, "fragmentation", frames)
        assert cell(harness, 0) == list(STATE_RGB["ALLOC1"])  # a page with no kernel: the end is settled
    finally:
        harness.evaluate("() => { delete globalThis.kvlabNoKernel; }")


def test_the_fragmentation_gauges_name_and_show_what_the_detector_prints(harness):
    """One vocabulary, read off the screen: every gauge of the live fragmentation view carries a name the
    chapters' GLOSSARY.md defines, and shows the value FragmentationDetector prints under that name (and
    memory_usage for blocks held and cached), to the 0.1% the gauge shows."""
    from kvlab.memory.fragmentation import FragmentationDetector, memory_usage

    glossary = (REPO / "chapters" / "GLOSSARY.md").read_text()
    p = BlockPool(256, block_sizes=[16, 32, 64], with_storage=False, seed=4)
    held = [p.allocate(1, size_class=k % 3) for k in range(40)]
    for k, ids in enumerate(held):
        p.set_token_counts(ids, [1 + (7 * k) % (16 << (k % 3))])
    for ids in held[::3]:
        p.free(ids)
    p.mark_reusable(held[1])
    p.free(held[1])  # cached
    d, usage = FragmentationDetector(p).detect_fragmentation(), memory_usage(p)
    printed = {"占用块 blocks held": 100 * usage["used"] / usage["total"],
               "可复用缓存块 cached (reusable)": 100 * usage["cached"] / usage["total"],
               "不可用空闲内存 unusable free memory": d["fragmentation_percent"],
               "内部浪费 internal waste": 100 * d["internal_waste"],
               "外部碎片（连续性） external fragmentation (contiguity)": 100 * d["external_fragmentation"]}
    mount(harness, "fragmentation", [build_frame(p)])
    shown = dict(harness.evaluate("() => [...document.querySelectorAll('.kv-gauge')].map((g) => "
                                  "[g.querySelector('.kv-gauge-name').textContent, "
                                  "parseFloat(g.querySelector('.kv-gauge-value').textContent)])"))
    assert list(shown) == list(printed)
    for name, value in shown.items():
        assert f"**{name}**" in glossary, f"{name!r} is not a GLOSSARY.md name"
        assert value == pytest.approx(printed[name], abs=0.051), name
    assert shown["可复用缓存块 cached (reusable)"] > 0 and 0 < shown["不可用空闲内存 unusable free memory"]


def test_hover_shows_details_and_asks_the_kernel_for_large_pools(harness, known_pool):
    p, _ = known_pool
    p.set_owner([2], 42)
    p.set_token_count(2, 11)
    mount(harness, "pool", [build_frame(p)])
    box = harness.locator(".kv-grid").bounding_box()
    g = harness.evaluate("() => document.querySelector('.kv-root').kv.panels[0].layout()")
    harness.mouse.move(box["x"] + 2.5 * g["cell"], box["y"] + 0.5 * g["cell"])  # block 2
    tip = harness.locator(".kv-tip").inner_text()
    assert "块 2 (block)" in tip and "ALLOCATED" in tip and "9 个引用" in tip and "序列 42" in tip
    assert "装着 11 个 token" in tip
    big = BlockPool(8192, with_storage=False)
    big.allocate(3)
    harness.evaluate("() => { document.getElementById('app').innerHTML = ''; }")
    mount(harness, "pool", [build_frame(big)])
    box = harness.locator(".kv-grid").bounding_box()
    harness.mouse.move(box["x"] + 1, box["y"] + 1)  # block 0
    assert harness.evaluate("() => m.sent.filter(s => s.type === 'inspect').map(s => s.block)") == [0]
    harness.evaluate("() => m.emit('msg:custom', {type: 'inspect', block: 0, tokens: 5, owner: 3, last_access: 9})")
    assert "现在 (now)：装着 5 个 token，序列 3" in harness.locator(".kv-tip").inner_text()


def test_player_step_back_scrub_and_replay(harness):
    p = BlockPool(16, with_storage=False)
    frames = [build_frame(p)]
    for _ in range(3):
        p.allocate(1)
        frames.append(build_frame(p))
    mount(harness, "pool", frames)
    assert cell(harness, 2) == list(STATE_RGB["ALLOC1"])  # live: the latest frame
    assert harness.locator(".kv-label").inner_text() == \
        f"池的 {p.clock.now()} 次操作之后 (after pool operations) · 回放 (replay)"
    harness.click("[data-act=back]")
    assert root_data(harness)["live"] == "0"
    assert cell(harness, 2) == list(STATE_RGB["FREE"])  # one frame back: block 2 not yet allocated
    assert "较早的画面 3 / 4 (an earlier picture)" in harness.locator(".kv-label").inner_text()
    harness.locator(".kv-slider").fill("0")
    assert cell(harness, 0) == list(STATE_RGB["FREE"])
    p.allocate(1)
    harness.evaluate("(s) => m.push(kvt.b64(s))", B64(build_frame(p)))  # arrives while looking back: kept, not shown
    assert root_data(harness)["index"] == "0" and cell(harness, 0) == list(STATE_RGB["FREE"])
    harness.click("[data-act=fwd]")
    assert root_data(harness)["index"] == "1"
    # No run drives this view: its one button replays the received pictures in the browser, to the newest.
    assert harness.locator("[data-act=toggle]").get_attribute("data-does") == "replay"
    harness.click("[data-act=toggle]")
    harness.wait_for_function("() => document.querySelector('.kv-root').dataset.playing === '0'")
    assert root_data(harness)["index"] == "4" and root_data(harness)["live"] == "1"
    assert cell(harness, 3) == list(STATE_RGB["ALLOC1"])
    assert not [s for s in harness.evaluate("() => m.sent") if s["type"] == "control"]  # nothing asked of a kernel


def test_one_pause_pauses_the_workload_of_a_live_run(harness):
    p = BlockPool(16, with_storage=False)
    with FrameBuilder(p) as b:
        b.step, b.steps = 507, 600
        p.allocate(2)
        frames = [b.build()]
    mount(harness, "pool", frames, '{status: "running"}')
    assert harness.locator(".kv-label").inner_text() == "第 507 / 600 步 (step) · 运行中 (running)"
    assert harness.locator("button:has-text('pause')").count() == 1  # exactly one pause
    harness.click("[data-act=toggle]")  # pause: a message to the kernel, which pauses the workload
    harness.evaluate("() => { m.set('status', 'paused'); m.emit('change:status'); }")
    assert harness.locator(".kv-label").inner_text() == "第 507 / 600 步 (step) · 已暂停 (paused)"
    assert harness.locator("[data-act=toggle]").inner_text() == "▶ 运行 run"
    harness.click("[data-act=fwd]")  # at the newest picture of a paused run: one step of the workload
    harness.click("[data-act=toggle]")
    assert harness.evaluate("() => m.sent.filter(s => s.type === 'control').map(s => s.action)") == \
        ["pause", "step", "run"]


def screen(page, x: float, y: float) -> list[int]:
    """The colour on the screen at page point (x, y), as the user sees it (whatever drew it)."""
    png = page.screenshot(clip={"x": x, "y": y, "width": 1, "height": 1})
    return list(Image.open(io.BytesIO(png)).convert("RGB").getpixel((0, 0)))


def centre(page, selector: str, nth: int = 0) -> tuple[float, float]:
    box = page.locator(selector).nth(nth).bounding_box()
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


def _bars(harness) -> list[list[float]]:
    """Each bar's drawn width, its track's width and the score it shows."""
    return harness.evaluate("() => [...document.querySelectorAll('.kv-bar-row')].map(r => "
                            "[r.querySelector('.kv-bar').getBoundingClientRect().width, "
                            "r.querySelector('.kv-bar-track').clientWidth, "
                            "Number(r.querySelector('.kv-bar-value').textContent)])")


def test_eviction_view_explains_the_score_and_draws_bars_from_zero(harness):
    p = BlockPool(8, with_storage=False)
    b = FrameBuilder(p)
    ids = p.allocate(8)
    p.mark_reusable(ids)
    p.free(ids[::-1])  # LRU order: 7 first ... 0 last
    p.allocate(1)      # evicts block 7
    mount(harness, "eviction", [b.build()])
    assert harness.evaluate("() => document.querySelector('.kv-evictions').dataset.victim") == "7"
    title = harness.locator(".kv-evictions .kv-title").inner_text()
    assert "LRU 淘汰了块 7 (evicted)" in title and "原因：分配需要空间 (an allocation needed room)" in title
    assert "demo" not in title and "到目前共淘汰 1 次" in title
    assert harness.locator(".kv-explain").inner_text() == \
        "分数 (score) = 上次使用，池时钟 (last use)；最久未用的先走。条形从 0 起。"
    assert screen(harness, *centre(harness, ".kv-bar-row[data-victim='1'] .kv-bar")) == list(VICTIM_RGB)
    # Equal scores: from zero, each bar's length is its score over the largest score.
    widths = _bars(harness)
    top = max(v for *_, v in widths)
    for bar, track, value in widths:
        assert bar == pytest.approx(track * value / top, abs=1.5)
    assert len(widths) == 8
    assert harness.locator(".kv-evlist li").all_inner_texts() == [
        f"池时钟 {p.clock.now()} (pool tick)：LRU 淘汰了块 7 （分配需要空间 (an allocation needed room)），"
        "在显示的 8 个候选中排第 1"]
    b.close()


def test_close_eviction_scores_get_bars_that_tell_the_victim_apart(harness):
    """Scores far from zero and close together (last uses 1001 ... 1008) drew bars that looked identical: the axis
    starts half their spread below the smallest (``palette.bar_axis``, shipped in the frame), and says so."""
    p = BlockPool(8, with_storage=False)
    for _ in range(1000):
        p.clock.tick()
    b = FrameBuilder(p)
    ids = p.allocate(8)
    p.mark_reusable(ids)
    for i in ids:
        p.free([i])    # last uses one tick apart: block 0 is the least recently used
    p.allocate(1)
    mount(harness, "eviction", [b.build()])
    assert harness.locator(".kv-explain").inner_text().endswith("起而不是从 0 起：分数太接近。")
    widths = _bars(harness)
    values = [v for *_, v in widths]
    lo, hi = min(values), max(values)
    base = lo - (hi - lo) / 2
    for bar, track, value in widths:
        assert bar == pytest.approx(track * (value - base) / (hi - base), abs=1.5)
    victim = harness.evaluate("() => document.querySelector(\".kv-bar-row[data-victim='1'] .kv-bar\")"
                              ".getBoundingClientRect().width")
    assert victim < 0.4 * max(bar for bar, *_ in widths)  # a third of the longest, not ~100% of it
    b.close()


def test_fragmentation_view_map_gauges_and_moves(harness):
    p = BlockPool(16, with_storage=False)
    p.allocate(12)
    p.free([1, 2, 3, 8])  # free runs: 1..3 (3 blocks), 8, 12..15 (4: the largest)
    b = FrameBuilder(p)
    frames = [b.build()]
    p.migrate([11], [1])
    frames.append(b.build())
    mount(harness, "fragmentation", frames)
    harness.evaluate("() => document.querySelector('.kv-root').kv.show(0)")
    assert cell(harness, 0) == list(STATE_RGB["ALLOC1"])  # the pool's own state colours
    assert cell(harness, 2) == list(STATE_RGB["FREE"])
    assert cell(harness, 13) == list(RUN_RGB)
    assert harness.evaluate("() => document.querySelector('.kv-frag').dataset.largestRun") == "4"
    fill = harness.evaluate("() => document.querySelector('.kv-gauge[data-key=blocks_held] .kv-fill').style.width")
    # 8 of 16 blocks in use
    assert fill == "50%" and harness.locator(".kv-gauge[data-key=blocks_held]").inner_text().endswith("50.0%")
    harness.evaluate("() => document.querySelector('.kv-root').kv.show(1)")
    assert cell(harness, 14) == list(RUN_RGB)  # 11..15 is now the largest run
    assert harness.evaluate("() => document.querySelector('.kv-frag').dataset.largestRun") == "5"
    arrow = harness.evaluate("() => kvt.pixel(document.querySelector('.kv-map'), ...[2, 1].map(c => "
                             "(c + 0.5) * document.querySelector('.kv-root').kv.panels[0].layout().cell))")
    assert arrow == list(MOVE_RGB)  # the move 11 -> 1 is drawn (through the middle of cell 6, on its path)


def test_dashboard_controls_send_messages(harness, known_pool):
    p, _ = known_pool
    state = ('{status: "idle", speed: 100, policy: "lru", block_size: 16, workload: "steady", '
             'panels: ["pool", "fragmentation", "eviction"], controls: ["policy", "block_size", "workload"], '
             'options: {policy: ["fifo", "lru"], block_size: [16, 32], workload: ["steady", "bursty"]}}')
    mount(harness, "dashboard", [build_frame(p)], state)
    harness.click("[data-act=toggle]")  # run
    harness.evaluate("() => { m.set('status', 'running'); m.emit('change:status'); }")
    harness.click("[data-act=toggle]")  # pause
    for act in ("step", "stop"):
        harness.click(f"[data-ctl={act}]")
    assert harness.evaluate("() => m.sent.filter(s => s.type === 'control').map(s => s.action)") == \
        ["run", "pause", "step", "stop"]
    assert harness.locator(".kv-root button:has-text('pause')").count() == 1  # one pause in the whole dashboard
    harness.select_option("select[data-key=policy]", "fifo")
    harness.select_option("select[data-key=block_size]", "32")
    assert harness.evaluate("() => [m.get('policy'), m.get('block_size')]") == ["fifo", 32]
    assert cell(harness, 2) == list(STATE_RGB["ALLOC8"])  # the pool panel of the dashboard
    assert "running" in harness.locator(".kv-label").inner_text()


def test_dashboard_presets_show_their_panels_without_a_large_empty_area(harness):
    p = BlockPool(1024, with_storage=False)  # the dashboard's default size, after enough steps to evict
    rec = record(p, RandomWorkload(p, preset="sharing", seed=1, steps=1500), 1500, every=500)
    assert decode_frame(rec[len(rec) - 1]).evictions or any(decode_frame(f).evictions for f in rec)
    for panels, controls in ((["pool", "eviction"], ["policy", "workload"]),
                             (["pool", "fragmentation"], ["block_size", "workload"]),
                             (["pool", "fragmentation", "eviction"], ["policy", "block_size", "workload"])):
        harness.evaluate("() => { document.getElementById('app').innerHTML = ''; }")
        mount(harness, "dashboard", list(rec),
              f'{{status: "idle", speed: 100, policy: "lru", block_size: 16, workload: "steady", panels: {panels}, '
              f'controls: {controls}, options: {{policy: ["lru"], block_size: [16], workload: ["steady"]}}}}')
        shown = [k for k, sel in (("pool", ".kv-pool"), ("fragmentation", ".kv-frag"), ("eviction", ".kv-evictions"))
                 if harness.locator(sel).count()]
        assert shown == panels
        assert harness.evaluate("() => [...document.querySelectorAll('select')].map(s => s.dataset.key)") == controls
        cols = harness.evaluate("() => [...document.querySelectorAll('.kv-dash > .kv-col')].map(c => "
                                "c.getBoundingClientRect().height)")
        assert len(cols) == 2 and min(cols) > 0.6 * max(cols), cols  # neither column is mostly empty


def test_every_view_has_a_legend_and_text_readable_on_a_projector(harness, known_pool):
    p, _ = known_pool
    for view, keys in (("pool", {"FREE", "PENDING", "ALLOC1", "ALLOC8", "EVICTING", "CACHED", "FLASH1", "FLASH2",
                                 "FLASH3", "FADE", "OUTLINE"}),
                       ("fragmentation", {"FREE", "RUN", "PENDING", "ALLOC1", "ALLOC8", "EVICTING", "CACHED",
                                          "FLASH1", "FLASH2", "FLASH3", "FADE", "MOVE", "LINE_blocks_held",
                                          "LINE_unusable_free", "LINE_internal_waste", "LINE_external_fragmentation"}),
                       ("eviction", {"VICTIM", "CANDIDATE"})):
        harness.evaluate("() => { document.getElementById('app').innerHTML = ''; }")
        mount(harness, view, [build_frame(p)])
        got = harness.evaluate("() => [...document.querySelectorAll('.kv-legend .kv-key')].map(k => [k.dataset.key, "
                               "k.querySelector('.kv-words').textContent])")
        assert {k for k, _ in got} == keys, view
        assert all(words.strip() for _, words in got)
        sizes = harness.evaluate("() => [...document.querySelectorAll('.kv-root *')].filter(e => [...e.childNodes]"
                                 ".some(n => n.nodeType === 3 && n.textContent.trim())).map(e => "
                                 "parseFloat(getComputedStyle(e).fontSize))")
        assert sizes and min(sizes) >= 14, (view, min(sizes))


def test_the_same_state_has_the_same_colour_in_every_view(harness):
    """Read back from the screen: each state's colour in the pool grid, the memory map, the eviction bars and every
    legend is the palette's."""
    p = BlockPool(16, with_storage=False)
    with FrameBuilder(p) as b:
        p.allocate(16)
        p.mark_reusable([4, 5, 6])
        p.free([4, 5, 6])  # cached
        p.free([1] + list(range(12, 16)))  # free: block 1 alone, 12..15 the largest run
        p.evict("test")  # evicts cached block 4: the candidates' bars are the cached ones
        frames = [b.build()] + [b.build() for _ in range(4)]  # four quiet frames: every flash has faded
    want = {"CACHED": 5, "FREE": 1, "ALLOC1": 0}
    seen: dict[str, list[list[int]]] = {k: [] for k in want}
    for view in ("pool", "fragmentation", "eviction", "dashboard"):
        harness.evaluate("() => { document.getElementById('app').innerHTML = ''; }")
        state = ('{status: "idle", speed: 100, policy: "lru", block_size: 16, workload: "steady", panels: ["pool", '
                 '"fragmentation", "eviction"], controls: [], options: {}}') if view == "dashboard" else "{}"
        mount(harness, view, frames, state)
        for k, block in want.items():
            for sel in (".kv-grid", ".kv-map"):
                for i in range(harness.locator(sel).count()):
                    box = harness.locator(sel).nth(i).bounding_box()
                    cellpx = box["width"] / 4  # 16 blocks: a 4 x 4 grid; sample clear of the refcount digits
                    seen[k].append(screen(harness, box["x"] + (block % 4 + 0.2) * cellpx,
                                          box["y"] + (block // 4 + 0.2) * cellpx))
            for i in range(harness.locator(f".kv-key[data-key={k}] .kv-swatch").count()):
                seen[k].append(screen(harness, *centre(harness, f".kv-key[data-key={k}] .kv-swatch", i)))
        if view in ("eviction", "dashboard"):
            seen["CACHED"].append(screen(harness, *centre(harness, ".kv-bar-row[data-victim='0'] .kv-bar")))
            assert screen(harness, *centre(harness, ".kv-bar-row[data-victim='1'] .kv-bar")) == list(VICTIM_RGB)
    assert list(CANDIDATE_RGB) == list(STATE_RGB["CACHED"])
    for k, colours in seen.items():
        assert len(colours) >= 4, k
        assert all(c == list(STATE_RGB[k]) for c in colours), (k, colours)


def test_exported_html_replays_offline(open_offline, tmp_path):
    p = BlockPool(64, with_storage=False)
    rec = record(p, RandomWorkload(p, seed=3, steps=120), 120, every=10)
    path = export_html(rec, tmp_path / "replay.html", view="dashboard")
    page, outside = open_offline(path)
    page.wait_for_selector(f".kv-root[data-index='{len(rec) - 1}']")  # opens on the end of the run
    assert page.evaluate("() => document.querySelector('.kv-root').kv.hist.length") == len(rec)
    assert page.locator(".kv-label").inner_text() == "第 120 / 120 步 (step) · 回放 (replay)"
    first = page.evaluate("() => document.querySelector('.kv-root').kv.hist[0].seq")
    page.locator(".kv-slider").fill("0")
    page.click("[data-act=fwd]")
    assert page.evaluate("() => document.querySelector('.kv-root').dataset.index") == "1"
    page.click("[data-act=toggle]")  # play: the recorded pictures, in the browser, to the last
    page.wait_for_selector(f".kv-root[data-index='{len(rec) - 1}'][data-playing='0']")
    assert page.evaluate("() => document.querySelector('.kv-root').kv.hist.at(-1).seq") == first + len(rec) - 1
    assert outside == []
    page.close()


def test_docs_screenshots(harness, tmp_path):
    """One screenshot per view of a realistic run, at a notebook cell's width. ``KVLAB_SCREENSHOTS=1`` writes them
    to docs/img (the pictures docs/widgets.md shows); otherwise they go to a temporary folder."""
    shots = DOCS_IMG if os.environ.get("KVLAB_SCREENSHOTS") == "1" else tmp_path
    dashboard = ('{status: "idle", speed: 200, policy: "lru", block_size: 16, workload: "bursty", '
                 'panels: ["pool", "fragmentation", "eviction"], controls: ["policy", "block_size", "workload"], '
                 'options: {policy: ["clock", "fifo", "lfu", "lru", "opt", "random"], '
                 'block_size: [8, 16, 32, 64, 128, 256, 512], workload: ["steady", "bursty", "sharing", "defrag"]}}')
    for name, view, preset, sizes, state in (("pool_view", "pool", "steady", [16, 32, 64], "{}"),
                                             ("eviction_view", "eviction", "sharing", None, "{}"),
                                             ("fragmentation_view", "fragmentation", "defrag", None, "{}"),
                                             ("dashboard", "dashboard", "bursty", None, dashboard)):
        p = BlockPool(1024, block_sizes=sizes, with_storage=False, seed=1)
        rec = record(p, RandomWorkload(p, preset=preset, seed=1, steps=600), 600, every=10)
        harness.evaluate("() => { const app = document.getElementById('app'); app.innerHTML = '';"
                         " app.style.width = '1100px'; }")
        mount(harness, view, list(rec), state)
        assert harness.locator(".kv-label").inner_text().startswith("第 600 / 600 步 (step) · ")
        harness.locator(".kv-root").screenshot(path=str(shots / f"{name}.png"))
        assert Image.open(shots / f"{name}.png").size[0] <= 1100


def test_views_scale_to_a_narrow_cell(harness, known_pool):
    p, _ = known_pool
    big = BlockPool(4096, with_storage=False)
    big.allocate(1000)
    for view, frame in (("pool", build_frame(big)), ("fragmentation", build_frame(big)),
                        ("dashboard", build_frame(p))):
        harness.evaluate("() => { const app = document.getElementById('app'); app.innerHTML = '';"
                         " app.style.width = '420px'; }")
        mount(harness, view, [frame], '{panels: ["pool", "fragmentation", "eviction"], controls: []}'
              if view == "dashboard" else "{}")
        widths = harness.evaluate("() => [...document.querySelectorAll('.kv-root canvas, .kv-root .kv-legend, "
                                  ".kv-root .kv-player')].map(e => e.getBoundingClientRect().right - "
                                  "document.getElementById('app').getBoundingClientRect().left)")
        assert widths and max(widths) <= 421, (view, max(widths))
        sizes = harness.evaluate("() => [...document.querySelectorAll('.kv-root *')].filter(e => [...e.childNodes]"
                                 ".some(n => n.nodeType === 3 && n.textContent.trim())).map(e => "
                                 "parseFloat(getComputedStyle(e).fontSize))")
        assert min(sizes) >= 14
