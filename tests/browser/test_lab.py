"""End to end in JupyterLab: a generated notebook is run in Chromium; the grid shows the expected colours for a
known pool state, a live run streams every frame it sends (sent = received, counted on both sides), the player
pauses and steps through received frames, the dashboard's controls drive the run in the kernel between steps,
and one screenshot per view is taken (saved for the docs with KVLAB_SCREENSHOTS=1). A 65,536-block PoolView driven
live by a LiveRun task streams every frame the kernel sends and draws each one, on the path the widget benchmark
measures."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from conftest import KNOWN_KEYS, KNOWN_POOL, page_errors, wait_until

from kvlab.app import bench
from kvlab.viz.browser import open_notebook, run_cell, write_notebook
from kvlab.viz.palette import STATE_RGB

pytestmark = pytest.mark.browser

# Screenshots refresh docs/img only when asked (KVLAB_SCREENSHOTS=1): a test run must not rewrite tracked files.
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"

CELLS = [
    "from kvlab import BlockPool\n"
    "from kvlab.viz import Dashboard, EvictionView, FragmentationView, LiveRun, PoolView, RandomWorkload\n"
    + KNOWN_POOL + "PoolView(p)",
    "q = BlockPool(1024, with_storage=False, seed=1)\nlv = PoolView(q)\nlv",
    "ev = EvictionView(q)\nev",
    "fv = FragmentationView(q)\nfv",
    "import time\n"
    "work = RandomWorkload(q, preset='defrag', seed=1, steps=3000)\n"
    "def slow_step():\n"
    "    time.sleep(0.001)  # ~3 s of stepping: about 100 paced frames while this cell runs\n"
    "    return work()\n"
    "run = LiveRun(q, slow_step, [lv, ev, fv])\n"
    "run.run()\n"
    "print('SENT', run.frames_sent, lv.frames_sent, ev.frames_sent, fv.frames_sent)",
    "d = Dashboard(num_blocks=2048, seed=2, speed=400)\nd",
]


def open_cells(browser, server, name: str, cells: list[str]):
    """A notebook of ``cells`` written to the server's folder and opened in a new page: (page, its errors)."""
    write_notebook(server["work"] / name, cells)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = page_errors(page)
    open_notebook(page, server["url"], name, app=server["app"])
    return page, errors


def settle_after_error(page) -> None:
    """Wait until the kernel is idle after an interrupted cell, and a little more: a cell sent while ipykernel is
    still answering the error is aborted with it (stop_on_error), and its output never comes."""
    page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status "
                           "=== 'idle'", timeout=30_000)
    time.sleep(1)


def roots(page):
    return page.locator(".jp-OutputArea-output .kv-root")


def data(page, i: int) -> dict:
    return page.evaluate("(i) => ({...document.querySelectorAll('.jp-OutputArea-output .kv-root')[i].dataset})", i)


def cell_pixel(page, i: int, b: int) -> list[int]:
    return page.evaluate("""([i, b]) => {
      const root = document.querySelectorAll('.jp-OutputArea-output .kv-root')[i], p = root.kv.panels[0];
      const g = p.layout(), ctx = p.canvas.getContext('2d');
      const x = (b % g.cols) * g.cell + 1, y = Math.floor(b / g.cols) * g.cell + 1;
      return Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3));
    }""", [i, b])


def canvas_url(page, i: int) -> str:
    return page.evaluate("(i) => document.querySelectorAll('.jp-OutputArea-output .kv-root')[i].kv.panels[0]"
                         ".canvas.toDataURL()", i)




def test_notebook_views_in_jupyterlab(browser, lab, tmp_path):
    write_notebook(lab["work"] / "views.ipynb", CELLS)
    page = browser.new_page(viewport={"width": 1600, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    open_notebook(page, lab["url"], "views.ipynb")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")

    # The known state: every block has the colour of its state.
    wait_until(lambda: roots(page).count() >= 4, 60, "the first four views")
    alloc2 = [round(a + (b - a) / 7) for a, b in zip(STATE_RGB["ALLOC1"], STATE_RGB["ALLOC8"])]
    for b, key in enumerate(KNOWN_KEYS):
        assert cell_pixel(page, 0, b) == (list(STATE_RGB[key]) if key else alloc2), f"block {b}"

    # The live run streamed while its cell ran: every frame sent arrived, on all three views.
    out = page.locator(".jp-OutputArea-output pre", has_text="SENT")
    out.wait_for(timeout=120_000)
    sent = [int(x) for x in re.findall(r"\d+", out.inner_text())]
    assert sent[0] > 20 and sent[1:] == [sent[0] + 1] * 3  # each view also got its first frame on creation
    for i in (1, 2, 3):
        wait_until(lambda i=i: data(page, i)["framesReceived"] == str(sent[1]), 30, f"frames of view {i}")
        assert data(page, i)["framesSent"] == str(sent[1])
    assert int(page.evaluate("() => document.querySelectorAll('.jp-OutputArea-output .kv-root')[1].kv.hist.length")) \
        == sent[1]

    # Pause / step back / step forward change what is shown.
    live = canvas_url(page, 1)
    view = roots(page).nth(1)
    view.locator("[data-act=back]").click()
    d = data(page, 1)
    assert d["live"] == "0" and d["index"] == str(sent[1] - 2)
    view.locator("[data-act=back]").click()
    view.locator("[data-act=back]").click()
    assert canvas_url(page, 1) != live
    view.locator("[data-act=toggle]").click()  # the run is over: play replays the received frames to the last
    wait_until(lambda: data(page, 1)["index"] == str(sent[1] - 1) and data(page, 1)["playing"] == "0", 20, "replay")
    assert canvas_url(page, 1) == live

    # The dashboard: step, run, pause and stop are handled by the kernel between steps.
    wait_until(lambda: roots(page).count() >= 5, 60, "the dashboard")
    dash = roots(page).nth(4)
    dash.locator("[data-ctl=step]").click()
    wait_until(lambda: data(page, 4)["framesReceived"] == "2", 20,
               f"a stepped frame {data(page, 4)} {page.locator('.jp-OutputArea-output').nth(5).inner_text()[:2000]}")
    dash.locator("[data-act=toggle]").click()  # run: the player's one button
    wait_until(lambda: data(page, 4)["status"] == "running", 20, "running")
    wait_until(lambda: int(data(page, 4)["framesReceived"]) > 15, 30, "live frames")
    dash.locator("[data-act=toggle]").click()  # pause
    wait_until(lambda: data(page, 4)["status"] == "paused", 20, "paused")
    time.sleep(1)
    d = data(page, 4)
    assert d["framesReceived"] == d["framesSent"]
    frozen = d["framesReceived"]
    time.sleep(0.5)
    assert data(page, 4)["framesReceived"] == frozen  # paused in the kernel: nothing more is sent
    dash.locator("[data-act=back]").click()
    assert data(page, 4)["index"] == str(int(frozen) - 2)

    shots = DOCS_IMG if os.environ.get("KVLAB_SCREENSHOTS") == "1" else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    for i, name in ((1, "pool_view"), (2, "eviction_view"), (3, "fragmentation_view"), (4, "dashboard")):
        roots(page).nth(i).screenshot(path=str(shots / f"{name}.png"))
        assert (shots / f"{name}.png").stat().st_size > 1000
    dash.locator("[data-ctl=stop]").click()
    wait_until(lambda: data(page, 4)["status"] == "idle", 20, "stopped, ready to run again")
    assert not errors, errors
    page.close()


def test_a_live_65536_block_pool_view_streams_and_draws_every_frame(browser, lab):
    """The benchmark's own run (``bench_widgets.live_lab_run``), shortened: kernel task, comm, websocket, widget
    manager, PoolView. Frames arrive, every frame the kernel sent is received, and each one that arrived is drawn."""
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    res = bench.load("bench_widgets").live_lab_run(page, lab, seconds=3, name="live_65536.ipynb")
    counts = {k: v if isinstance(v, int) else len(v) for k, v in res.items() if k != "seconds"}
    assert page.evaluate("() => document.querySelector('.jp-OutputArea-output .kv-pool').dataset.n") == "65536"
    assert res["steps"] > 0 and len(res["python_ms"]) > 5 and len(res["arrivals"]) > 5, counts  # frames arrive
    assert res["sent_seen"] == res["sent"] and res["received"] == res["sent"], counts  # none dropped
    assert len(set(res["drawn"])) >= len(res["arrivals"]), counts  # and each one that arrived was drawn
    assert res["arrivals"] == sorted(res["arrivals"]) and not errors, errors
    page.close()


def test_pause_resume_scrub_step_and_interrupt_an_awaited_live_run(browser, front_end):
    """The reported freeze, in JupyterLab and Notebook 7: a cell awaits a live run; the view's button pauses it,
    then resumes it (the run must step again: it used to stay paused for good, labelled "running"); scrubbing
    back shows an earlier picture while frames keep arriving; paused, "one forward" at the latest picture takes
    one step of the workload; Kernel > Interrupt then ends the cell with KeyboardInterrupt, the run stopped, and
    the kernel runs the next cell."""
    cells = ["from kvlab import BlockPool\nfrom kvlab.viz import PoolView, RandomWorkload\n"
             "q = BlockPool(256, with_storage=False)\nv = PoolView(q)\nv",
             "run = v.live(RandomWorkload(q, seed=1, steps=10**6), steps_per_second=40)\nawait run",
             "print('USABLE', run.state, q.check_invariants() is None)"]
    page, errors = open_cells(browser, front_end, "awaited.ipynb", cells)
    run_cell(page, 0)
    wait_until(lambda: roots(page).count() >= 1, 60, "the view")
    run_cell(page, 1)
    wait_until(lambda: data(page, 0)["status"] == "running", 30, "the awaited run")
    toggle = roots(page).nth(0).locator("[data-act=toggle]")
    toggle.click()  # pause
    wait_until(lambda: data(page, 0)["status"] == "paused", 20, "paused")
    time.sleep(0.5)
    frozen = int(data(page, 0)["framesReceived"])
    time.sleep(0.5)
    assert int(data(page, 0)["framesReceived"]) == frozen
    toggle.click()  # resume
    wait_until(lambda: int(data(page, 0)["framesReceived"]) > frozen + 5, 20, "frames again after resuming")
    # Scrub to the first picture while the run goes on: the view stays there, frames keep arriving.
    roots(page).nth(0).locator(".kv-slider").evaluate(
        "(s) => { s.value = 0; s.dispatchEvent(new Event('input')); }")
    arrived = int(data(page, 0)["framesReceived"])
    wait_until(lambda: int(data(page, 0)["framesReceived"]) > arrived + 5, 20, "frames while scrubbed back")
    assert data(page, 0)["index"] == "0" and data(page, 0)["live"] == "0" and data(page, 0)["status"] == "running"
    toggle.click()  # pause (the run's button, whatever picture is shown)
    wait_until(lambda: data(page, 0)["status"] == "paused", 20, "paused again")
    roots(page).nth(0).locator(".kv-slider").evaluate(
        "(s) => { s.value = s.max; s.dispatchEvent(new Event('input')); }")
    time.sleep(0.5)
    before = int(data(page, 0)["framesReceived"])
    roots(page).nth(0).locator("[data-act=fwd]").click()  # at the latest picture of a paused run: one step
    wait_until(lambda: int(data(page, 0)["framesReceived"]) == before + 1, 20, "one stepped frame")
    assert data(page, 0)["status"] == "paused" and data(page, 0)["live"] == "1"
    toggle.click()  # resume, then interrupt the awaiting cell
    wait_until(lambda: data(page, 0)["status"] == "running", 20, "running again")
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:interrupt')")
    page.locator(".jp-OutputArea-output", has_text="KeyboardInterrupt").first.wait_for(timeout=30_000)
    wait_until(lambda: data(page, 0)["status"] == "stopped", 20, "the run stopped")
    settle_after_error(page)
    run_cell(page, 2)
    page.locator(".jp-OutputArea-output pre", has_text="USABLE stopped True").wait_for(timeout=30_000)
    assert not errors, errors
    page.close()


def test_pause_resume_scrub_step_and_interrupt_a_background_live_run(browser, front_end):
    """A run started in the background (``run.start()``, the cell ends at once), in JupyterLab and Notebook 7:
    pause, resume, scrub back while it runs, one step while paused; Kernel > Interrupt with no cell running pauses
    it (ipykernel ignores that signal between cells: it used to change nothing); the view resumes it; a long cell
    run meanwhile is still interrupted itself, and the run goes on after it."""
    cells = ["from kvlab import BlockPool\nfrom kvlab.viz import PoolView, RandomWorkload\n"
             "q = BlockPool(256, with_storage=False)\nv = PoolView(q)\ndisplay(v)\n"
             "run = v.live(RandomWorkload(q, seed=1, steps=10**6), steps_per_second=40)\nrun.start();",
             "import time\ntime.sleep(60)",
             "import asyncio\nrun.stop()\nawait asyncio.gather(run.task, return_exceptions=True)\n"
             "print('USABLE', run.state, q.check_invariants() is None)"]
    page, errors = open_cells(browser, front_end, "background.ipynb", cells)
    run_cell(page, 0)
    wait_until(lambda: roots(page).count() >= 1 and data(page, 0)["status"] == "running", 60, "the background run")
    view = roots(page).nth(0)
    toggle = view.locator("[data-act=toggle]")
    toggle.click()  # pause
    wait_until(lambda: data(page, 0)["status"] == "paused", 20, "paused")
    before = int(data(page, 0)["framesReceived"])
    view.locator("[data-act=fwd]").click()  # one step
    wait_until(lambda: int(data(page, 0)["framesReceived"]) == before + 1, 20, "one stepped frame")
    toggle.click()  # resume
    wait_until(lambda: data(page, 0)["status"] == "running", 20, "running")
    view.locator(".kv-slider").evaluate("(s) => { s.value = 1; s.dispatchEvent(new Event('input')); }")
    arrived = int(data(page, 0)["framesReceived"])
    wait_until(lambda: int(data(page, 0)["framesReceived"]) > arrived + 5, 20, "frames while scrubbed back")
    assert data(page, 0)["index"] == "1" and data(page, 0)["live"] == "0"
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:interrupt')")  # no cell is running
    wait_until(lambda: data(page, 0)["status"] == "paused", 20, "paused by the interrupt")
    frozen = data(page, 0)["framesReceived"]
    time.sleep(0.5)
    assert data(page, 0)["framesReceived"] == frozen
    toggle.click()  # resume from the view
    wait_until(lambda: data(page, 0)["status"] == "running", 20, "running after the interrupt")
    run_cell(page, 1)  # a long cell: the interrupt is the cell's
    time.sleep(2)
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:interrupt')")
    page.locator(".jp-OutputArea-output", has_text="KeyboardInterrupt").first.wait_for(timeout=30_000)
    arrived = int(data(page, 0)["framesReceived"])
    wait_until(lambda: int(data(page, 0)["framesReceived"]) > arrived + 5, 20, "the run going on after the cell")
    assert data(page, 0)["status"] == "running"
    settle_after_error(page)
    run_cell(page, 2)
    page.locator(".jp-OutputArea-output pre", has_text="USABLE stopped True").wait_for(timeout=30_000)
    assert not errors, errors
    page.close()
