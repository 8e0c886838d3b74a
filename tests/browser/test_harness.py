"""Each widget module in headless Chromium with a fake anywidget model: pixel colours for known pool states,
flashes, frame counters, the player (pause / step back / scrub), controls, and the standalone HTML replay."""
from __future__ import annotations

import base64

import pytest

from kvlab import BlockPool
from kvlab.viz import FrameBuilder, RandomWorkload, build_frame, export_html, record
from kvlab.viz.static import MAP_RGB, STATE_RGB, VICTIM_RGB

pytestmark = pytest.mark.browser

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


def test_size_classes_are_outlined(harness):
    p = BlockPool(64, block_sizes=[16, 32, 64], with_storage=False)
    p.allocate(1, size_class=2)  # blocks 0..3, one block
    mount(harness, "pool", [build_frame(p)])
    g = harness.evaluate("() => document.querySelector('.kv-root').kv.panels[0].layout()")
    outline = harness.evaluate("([x, y]) => kvt.pixel(document.querySelector('.kv-root').kv.panels[0].canvas, x, y)",
                               [g["cell"], 0])  # top edge of the 4-wide block, inside its span
    assert outline == [34, 34, 34]
    assert cell(harness, 1) == list(STATE_RGB["ALLOC1"])


def test_flashes_fade_over_frames_and_counters_match(harness):
    p = BlockPool(16, with_storage=False)
    b = FrameBuilder(p)
    frames = [b.build()]
    p.allocate(1)  # block 0 just allocated
    frames.append(b.build())
    frames.append(b.build())  # nothing new: block 0's flash fades
    mount(harness, "pool", frames)
    harness.evaluate("() => document.querySelector('.kv-root').kv.show(1)")
    assert cell(harness, 0) == [255, 212, 0]
    harness.evaluate("() => document.querySelector('.kv-root').kv.show(2)")
    assert cell(harness, 0) == mix(STATE_RGB["ALLOC1"], [255, 212, 0], 0.6)
    d = root_data(harness)
    assert d["framesReceived"] == d["framesSent"] == "3"
    assert harness.evaluate("() => [m.get('frames_received'), m.saves]") == [3, 3]
    assert harness.evaluate("() => m.sent[0].type") == "ready"


def test_hover_shows_details_and_asks_the_kernel_for_large_pools(harness, known_pool):
    p, _ = known_pool
    p.set_owner([2], 42)
    p.set_token_count(2, 11)
    mount(harness, "pool", [build_frame(p)])
    box = harness.locator(".kv-grid").bounding_box()
    g = harness.evaluate("() => document.querySelector('.kv-root').kv.panels[0].layout()")
    harness.mouse.move(box["x"] + 2.5 * g["cell"], box["y"] + 0.5 * g["cell"])  # block 2
    tip = harness.locator(".kv-tip").inner_text()
    assert "block 2" in tip and "ALLOCATED" in tip and "refcount 9" in tip and "owner 42" in tip and "tokens 11" in tip
    big = BlockPool(8192, with_storage=False)
    big.allocate(3)
    harness.evaluate("() => { document.getElementById('app').innerHTML = ''; }")
    mount(harness, "pool", [build_frame(big)])
    box = harness.locator(".kv-grid").bounding_box()
    harness.mouse.move(box["x"] + 1, box["y"] + 1)  # block 0
    assert harness.evaluate("() => m.sent.filter(s => s.type === 'inspect').map(s => s.block)") == [0]
    harness.evaluate("() => m.emit('msg:custom', {type: 'inspect', block: 0, tokens: 5, owner: 3, last_access: 9})")
    assert "now: tokens 5, owner 3" in harness.locator(".kv-tip").inner_text()


def test_player_pause_step_back_and_scrub(harness):
    p = BlockPool(16, with_storage=False)
    frames = [build_frame(p)]
    for _ in range(3):
        p.allocate(1)
        frames.append(build_frame(p))
    mount(harness, "pool", frames)
    assert cell(harness, 2) == list(STATE_RGB["ALLOC1"])  # live: the latest frame
    harness.click("[data-act=back]")
    assert root_data(harness)["live"] == "0"
    assert cell(harness, 2) == list(STATE_RGB["FREE"])  # one frame back: block 2 not yet allocated
    harness.locator(".kv-slider").fill("0")
    assert cell(harness, 0) == list(STATE_RGB["FREE"])
    p.allocate(1)
    harness.evaluate("(s) => m.push(kvt.b64(s))", B64(build_frame(p)))  # arrives while paused: kept, not shown
    assert root_data(harness)["index"] == "0" and cell(harness, 0) == list(STATE_RGB["FREE"])
    harness.click("[data-act=fwd]")
    assert root_data(harness)["index"] == "1"
    harness.click("[data-act=toggle]")  # back to live: the newest frame
    assert root_data(harness)["index"] == "4" and cell(harness, 3) == list(STATE_RGB["ALLOC1"])


def test_eviction_view_marks_the_victim(harness):
    p = BlockPool(8, with_storage=False)
    b = FrameBuilder(p)
    ids = p.allocate(8)
    p.mark_reusable(ids)
    p.free(ids[::-1])  # LRU order: 7 first ... 0 last
    p.allocate(1)      # evicts block 7
    mount(harness, "eviction", [b.build()])
    assert harness.evaluate("() => document.querySelector('.kv-evictions').dataset.victim") == "7"
    px = harness.evaluate("() => kvt.pixel(document.querySelector('.kv-bars'), 172, 9)")
    assert px == list(VICTIM_RGB)
    assert "policy lru chose block 7" in harness.locator(".kv-title").inner_text()


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
    assert cell(harness, 0) == list(MAP_RGB["USED"])
    assert cell(harness, 2) == list(MAP_RGB["FREE"])
    assert cell(harness, 13) == list(MAP_RGB["RUN"])
    assert harness.evaluate("() => document.querySelector('.kv-frag').dataset.largestRun") == "4"
    gauge = harness.evaluate("() => kvt.pixel(document.querySelector('.kv-gauges'), 162, 10)")
    assert gauge == [74, 134, 200]  # utilisation 75%: the bar starts filled
    harness.evaluate("() => document.querySelector('.kv-root').kv.show(1)")
    assert cell(harness, 14) == list(MAP_RGB["RUN"])  # 11..15 is now the largest run
    assert harness.evaluate("() => document.querySelector('.kv-frag').dataset.largestRun") == "5"
    arrow = harness.evaluate("() => kvt.pixel(document.querySelector('.kv-map'), ...[2, 1].map(c => "
                             "(c + 0.5) * document.querySelector('.kv-root').kv.panels[0].layout().cell))")
    assert arrow == [0, 150, 190]  # the move 11 -> 1 is drawn (through the middle of cell 6, on its path)


def test_dashboard_controls_send_messages(harness, known_pool):
    p, _ = known_pool
    state = ('{status: "idle", speed: 100, policy: "lru", block_size: 16, workload: "steady", '
             'options: {policy: ["fifo", "lru"], block_size: [16, 32], workload: ["steady", "bursty"]}}')
    mount(harness, "dashboard", [build_frame(p)], state)
    for act in ("run", "pause", "step", "stop"):
        harness.click(f"[data-ctl={act}]")
    assert harness.evaluate("() => m.sent.filter(s => s.type === 'control').map(s => s.action)") == \
        ["run", "pause", "step", "stop"]
    harness.select_option("select[data-key=policy]", "fifo")
    harness.select_option("select[data-key=block_size]", "32")
    assert harness.evaluate("() => [m.get('policy'), m.get('block_size')]") == ["fifo", 32]
    assert cell(harness, 2) == list(STATE_RGB["ALLOC8"])  # the pool panel of the dashboard
    harness.evaluate("() => { m.set('status', 'running'); m.emit('change:status'); }")
    assert harness.locator(".kv-status").inner_text() == "running"


def test_exported_html_replays_offline(browser, tmp_path):
    p = BlockPool(64, with_storage=False)
    rec = record(p, RandomWorkload(p, seed=3, steps=120), 120, every=10)
    path = export_html(rec, tmp_path / "replay.html", view="dashboard")
    page = browser.new_page()
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector(".kv-root[data-index='0']")
    assert page.evaluate("() => document.querySelector('.kv-root').kv.hist.length") == len(rec)
    first = page.evaluate("() => document.querySelector('.kv-root').kv.hist[0].seq")
    page.click("[data-act=fwd]")
    assert page.evaluate("() => document.querySelector('.kv-root').dataset.index") == "1"
    page.locator(".kv-slider").fill(str(len(rec) - 1))
    assert page.evaluate("() => document.querySelector('.kv-root').kv.hist.at(-1).seq") == first + len(rec) - 1
    assert [u for u in requests if not u.startswith("file:")] == [] and not errors
    page.close()
