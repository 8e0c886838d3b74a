"""Live widgets at 65,536 blocks: Python cost to build a frame (goal <= 1 ms) against a baseline that builds the
same bytes from ``pool.snapshot()``; bytes per frame against a JSON encoding of the same fields; and, in headless
Chromium (Debian's, when present), the PoolView drawing frames pushed at 30 fps: achieved fps (goal >= 30),
render time per frame against the 33 ms budget of one frame, and dropped frames (goal 0).

Run: ``python benchmarks/bench_widgets.py`` (``--quick`` for a few seconds).
"""
from __future__ import annotations

import base64
import functools
import http.server
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvlab import BlockPool
from kvlab.viz import FrameBuilder, RandomWorkload
from kvlab.viz.frames import HEADER, MAGIC, frame_states

N = 65_536
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]
HARNESS = Path(__file__).resolve().parent.parent / "tests" / "browser" / "harness.html"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def busy_pool() -> BlockPool:
    p = BlockPool(N, with_storage=False, seed=0)
    w = RandomWorkload(p, preset="bursty", seed=0)
    ids = p.allocate(N // 2)
    p.mark_reusable(ids[::3])
    p.free(ids[::2])
    for _ in range(2000):
        w()
    return p


def snapshot_frame(p: BlockPool) -> bytes:
    """Baseline: the same frame bytes via pool.snapshot() (copies every metadata array)."""
    s = p.snapshot()
    state = frame_states(s["status"], s["refcount"])
    runs = p.free_runs()
    n_used = int(np.count_nonzero(s["status"]))
    free = N - n_used
    head = HEADER.pack(MAGIC, 0, N, p.block_size, float(p.clock.now()), n_used / N,
                       p.calculate_fragmentation() / 100, 1 - s["tokens"].sum() / max(1, n_used * p.block_size),
                       1 - runs.max() / free if free else 0.0, 0, 0)
    return head + state.tobytes() + np.minimum(s["refcount"], 255).astype(np.uint8).tobytes() + \
        (s["size_class"] << 3).astype(np.uint8).tobytes()


def _best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps * 1e3)
    return best


def python_rows(quick: bool) -> tuple[list[dict], BlockPool]:
    p = busy_pool()
    b = FrameBuilder(p)
    reps = 20 if quick else 200
    ours, base = _best_ms(b.build, reps), _best_ms(lambda: snapshot_frame(p), reps)
    data = b.build()
    s = p.snapshot()
    as_json = len(json.dumps({"state": s["status"].tolist(), "refs": s["refcount"].tolist(),
                              "size_class": s["size_class"].tolist()}).encode())
    b.close()
    return [
        {"name": "python: build one 65,536-block frame", "value": round(ours, 3), "unit": "ms",
         "baseline": round(base, 3), "ratio": round(ours / base, 2), "goal": "<= 1 ms"},
        {"name": "bytes per frame (65,536 blocks)", "value": len(data), "unit": "B", "baseline": as_json,
         "ratio": round(len(data) / as_json, 3), "goal": "3 B/block + 48 B header"},
    ], p


def browser_rows(p: BlockPool, quick: bool) -> list[dict]:
    """Push distinct 65,536-block frames at 30 fps into the PoolView in Chromium (fake model, local server)."""
    if not Path(CHROMIUM).exists():
        return [{"name": "browser: skipped (no Chromium)", "value": 0, "unit": "", "baseline": 0, "ratio": 0,
                 "goal": "-"}]
    from playwright.sync_api import sync_playwright

    from kvlab.viz.assets import css_source, esm_source
    w = RandomWorkload(p, preset="bursty", seed=1)
    frames = []
    with FrameBuilder(p) as b:
        for _ in range(30):
            for _ in range(50):
                w()
            frames.append(base64.b64encode(b.build()).decode())
    seconds = 2 if quick else 10
    root = Path(tempfile.mkdtemp())
    try:
        shutil.copy(HARNESS, root / "index.html")
        (root / "kvlab.css").write_text(css_source())
        (root / "pool.mjs").write_text(esm_source("pool"))
        handler = functools.partial(_Quiet, directory=str(root))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html")
            page.wait_for_function("window.kvtReady === true")
            res = page.evaluate("""async ([frames, seconds]) => {
              const m = await kvt.mount('pool', {}), bufs = frames.map(kvt.b64), times = [];
              const root = document.querySelector('.kv-root'), total = seconds * 30;
              const t0 = performance.now();
              for (let k = 0; k < total; k++) {
                const due = t0 + k * 1000 / 30;  // the pacer's schedule
                while (performance.now() < due) await new Promise(r => setTimeout(r, 1));
                const s = performance.now();
                m.push(bufs[k % bufs.length]);
                times.push(performance.now() - s);
                await new Promise(r => requestAnimationFrame(r));
              }
              const elapsed = (performance.now() - t0) / 1000;
              times.sort((a, b) => a - b);
              return {pushed: total, received: Number(root.dataset.framesReceived), fps: total / elapsed,
                      p50: times[times.length >> 1], p95: times[Math.floor(times.length * 0.95)]};
            }""", [frames, seconds])
            browser.close()
        server.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    budget = 1000 / 30
    return [
        {"name": "browser: fps drawing 65,536-block frames", "value": round(res["fps"], 1), "unit": "fps",
         "baseline": 30, "ratio": round(res["fps"] / 30, 2), "goal": ">= 30"},
        {"name": "browser: decode+draw per frame (p50)", "value": round(res["p50"], 2), "unit": "ms",
         "baseline": round(budget, 1), "ratio": round(res["p50"] / budget, 2), "goal": "< 33 ms"},
        {"name": "browser: decode+draw per frame (p95)", "value": round(res["p95"], 2), "unit": "ms",
         "baseline": round(budget, 1), "ratio": round(res["p95"] / budget, 2), "goal": "< 33 ms"},
        {"name": "browser: frames dropped", "value": res["pushed"] - res["received"], "unit": "frames",
         "baseline": res["pushed"], "ratio": round((res["pushed"] - res["received"]) / res["pushed"], 3),
         "goal": "0"},
    ]


def run(quick: bool = False) -> list[dict]:
    rows, pool = python_rows(quick)
    return rows + browser_rows(pool, quick)


if __name__ == "__main__":
    from kvlab.bench import run_script

    run_script(run)
