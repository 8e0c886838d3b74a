"""Real-browser fixtures: Debian's Chromium driven by Playwright (never a downloaded browser), a local http
server for the widget harness, and a JupyterLab server for the end-to-end tests.

A missing browser skips these tests on a laptop and fails them in CI (``CI=true``).
"""
from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from kvlab.viz.browser import CHROMIUM, CHROMIUM_FLAGS, lab_server

HERE = Path(__file__).parent
REPO = HERE.parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"


# One pool in every state, as source so a notebook can build the same pool; the colour key of each block.
KNOWN_POOL = """\
p = BlockPool(16, with_storage=False)
p.allocate(6)                      # 0..5, refcount 1
p.incref([1])                      # refcount 2
p.incref([2] * 8)                  # refcount 9: the darkest shade
p.mark_reusable([3]); p.free([3])  # cached
p.reserve(1)                       # 6 PENDING
p.allocate(1); p.mark_reusable([7]); p.free([7]); p.begin_eviction([7])  # 7 EVICTING
"""
KNOWN_KEYS = ["ALLOC1", None, "ALLOC8", "CACHED", "ALLOC1", "ALLOC1", "PENDING", "EVICTING"] + ["FREE"] * 8


@pytest.fixture
def known_pool():
    """(pool, colour key per block; None where the key is ALLOC1 mixed 1/7 towards ALLOC8, refcount 2)."""
    from kvlab import BlockPool
    ns = {"BlockPool": BlockPool}
    exec(KNOWN_POOL, ns)
    ns["p"].check_invariants()
    return ns["p"], KNOWN_KEYS


def wait_until(fn, timeout: float = 30, what: str = "condition"):
    """Poll ``fn`` every 0.1 s until it returns something true (returned), else fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


def page_errors(page) -> list[str]:
    """The script errors ``page`` throws from now on (a list that fills), except Notebook 7's own: 7.6.5 throws
    "Cannot read properties of undefined (reading 'schema')" from its bundle while opening any notebook (one
    cell ``1+1``, no settings of kvlab's: measured)."""
    errors: list[str] = []
    page.on("pageerror", lambda e: None if "/static/notebook/notebook_core" in (e.stack or "") else
            errors.append(str(e)))
    return errors


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is missing, and browser tests must run in CI")
    pytest.skip(f"{what} is missing")


@pytest.fixture(scope="module")  # Playwright's sync API holds an event loop: end it with the module using it
def browser():
    if not Path(CHROMIUM).exists():
        _missing(f"Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package")
    pw = sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
    yield b
    b.close()
    pw.stop()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()


@pytest.fixture
def open_offline(browser):
    """Opens an exported page from its file; returns the page and what it did beyond that file: each request to
    anywhere else and each script error (an offline replay must do neither)."""
    def open_(path: Path):
        page = browser.new_page()
        outside: list[str] = []
        page.on("request", lambda r: None if r.url.startswith("file:") else outside.append(r.url))
        page.on("pageerror", lambda e: outside.append(f"script error: {e}"))
        page.goto(path.as_uri())
        return page, outside
    return open_


@pytest.fixture(scope="session")
def harness_url(tmp_path_factory):
    """A local site with the harness page and one ES module per view, exactly as anywidget receives them."""
    from kvlab.viz.assets import VIEWS, css_source, esm_source
    root = tmp_path_factory.mktemp("harness")
    shutil.copy(HERE / "harness.html", root / "index.html")
    (root / "kvlab.css").write_text(css_source())
    for view in VIEWS:
        (root / f"{view}.mjs").write_text(esm_source(view))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    server.shutdown()


@pytest.fixture
def harness(browser, harness_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(harness_url)
    page.wait_for_function("window.kvtReady === true")
    page.errors = errors
    yield page
    assert not errors, f"JavaScript errors: {errors}"
    page.close()


@pytest.fixture(scope="module", params=["lab", "notebook"])
def front_end(request, tmp_path_factory):
    """JupyterLab, then Notebook 7 (``server["app"]`` says which), served as :func:`lab` is."""
    if importlib.util.find_spec("jupyterlab" if request.param == "lab" else "notebook") is None:
        _missing(request.param)
    with lab_server(tmp_path_factory.mktemp(request.param), app=request.param) as server:
        yield server


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 (no token, xsrf off, the app exposed for tests, deferred windowing)."""
    if importlib.util.find_spec("jupyterlab") is None:
        _missing("jupyterlab")
    with lab_server(tmp_path_factory.mktemp("lab")) as server:
        yield server
