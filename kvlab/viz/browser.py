"""The views in a real browser, for measurements and tests: a JupyterLab server run for automation, a notebook
opened and run in Chromium (Debian's, through Playwright: never a downloaded browser), and a watch on one view
that records when each frame arrived and how long the view took to draw it.

``benchmarks/bench_widgets.py`` measures a live 65,536-block ``PoolView`` through this path (kernel, comm,
websocket, widget manager, view) and ``tests/browser`` drives the same path, so the benchmark's figures and the
tests' assertions are about one and the same thing. Playwright and JupyterLab are imported when used.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvlab.core.errors import ConfigError

CHROMIUM = os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium")
# No GPU, no sandbox (containers), nothing fetched in the background.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The settings every package installed in this environment ships (kvlab's turns widget state saving on).
INSTALLED_SETTINGS = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.d"
FRONT_ENDS = {"lab": ("jupyterlab", "LabApp"), "notebook": ("notebook", "JupyterNotebookApp")}


@contextmanager
def lab_server(root: str | Path | None = None, *, timeout: float = 90, app: str = "lab") -> Iterator[dict[str, Any]]:
    """JupyterLab (``app="lab"``) or Notebook 7 (``"notebook"``) on 127.0.0.1 serving ``<root>/work`` (default:
    a temporary folder): no token, xsrf off, the app exposed as ``window.jupyterapp``, deferred windowing (every
    cell rendered), no news, and the settings the environment's packages install. Yields ``{"url", "work",
    "log", "app"}``; the server is stopped on exit. A server that does not answer within ``timeout`` seconds
    raises :class:`ConfigError` with the end of its log."""
    if app not in FRONT_ENDS:
        raise ConfigError(f"app must be one of {sorted(FRONT_ENDS)}, got {app!r:.80}")
    module, app_class = FRONT_ENDS[app]
    with tempfile.TemporaryDirectory(prefix="kvlab-lab-") as tmp:
        base = Path(root) if root is not None else Path(tmp)
        settings, work = base / "settings", base / "work"
        (settings / "overrides.d").mkdir(parents=True, exist_ok=True)
        work.mkdir(exist_ok=True)
        for shipped in sorted(INSTALLED_SETTINGS.glob("*.json")):  # as a server with its own settings dir would not
            (settings / "overrides.d" / shipped.name).write_bytes(shipped.read_bytes())
        (settings / "overrides.json").write_text(json.dumps({
            "@jupyterlab/notebook-extension:tracker": {"windowingMode": "defer"},
            "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"},
        }))
        port, log_path = free_port(), base / f"{app}.log"
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(base / "config"), "JUPYTER_RUNTIME_DIR": str(base / "runtime")}
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, "--allow-root", "--no-browser", f"--port={port}",
                 "--ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.disable_check_xsrf=True",
                 f"--{app_class}.expose_app_in_browser=True", f"--{app_class}.app_settings_dir={settings}",
                 f"--ServerApp.root_dir={work}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
            url = f"http://127.0.0.1:{port}"
            try:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        urllib.request.urlopen(f"{url}/api/status", timeout=2)
                        break
                    except OSError:
                        if proc.poll() is not None or time.monotonic() > deadline:
                            raise ConfigError(f"{module} did not start:\n{log_path.read_text()[-3000:]}") from None
                        time.sleep(0.5)
                yield {"url": url, "work": work, "log": log_path, "app": app}
            finally:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def write_notebook(path: Path, cells: list[str]) -> Path:
    """A notebook of code ``cells`` for the ``python3`` kernel at ``path``."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def open_notebook(page: Any, lab_url: str, name: str, timeout_ms: int = 90_000, app: str = "lab") -> None:
    """Open notebook ``name`` (relative to the server's root) in ``page`` and wait until it is in front with its
    kernel idle: in JupyterLab as the only tab (``?reset``: notebooks an earlier page opened are not restored),
    in Notebook 7 (``app="notebook"``) on its own page."""
    page.goto(f"{lab_url}/lab/tree/{name}?reset" if app == "lab" else f"{lab_url}/notebooks/{name}")
    page.wait_for_function("(name) => window.jupyterapp?.shell.currentWidget?.context?.path === name && "
                           "window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel?.status === 'idle'",
                           arg=name, timeout=timeout_ms)


def run_cell(page: Any, index: int) -> None:
    """Run cell ``index`` of the notebook in front (as Shift+Enter on it would), without waiting for it."""
    page.evaluate("""(i) => { const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = i;
                     window.jupyterapp.commands.execute('notebook:run-cell'); }""", index)  # no await


def view_roots(page: Any) -> Any:
    """The kvlab views shown in the notebook's outputs, in order."""
    return page.locator(".jp-OutputArea-output .kv-root")


# Records, on view i: the time each frame arrived (the view's received counter going up), and for each draw of a
# panel the time it took and the sequence number of the frame it drew. Read back with watch_result.
_WATCH = """(i) => {
  const root = document.querySelectorAll('.jp-OutputArea-output .kv-root')[i];
  const w = { arrivals: [], draws: [], drawn: [] };
  let seen = Number(root.dataset.framesReceived);
  new MutationObserver(() => {  // the counter is rewritten on other changes too: count only increases
    const n = Number(root.dataset.framesReceived), t = performance.now();
    for (; seen < n; seen++) w.arrivals.push(t);
  }).observe(root, { attributes: true, attributeFilter: ['data-frames-received'] });
  for (const p of root.kv.panels) {
    const draw = p.draw;
    p.draw = (hist, index, ...rest) => {
      const t = performance.now(), r = draw(hist, index, ...rest);
      w.draws.push(performance.now() - t);
      w.drawn.push(hist[index].seq);
      return r;
    };
  }
  window.kvlabWatch = w;
}"""


def watch_view(page: Any, index: int) -> None:
    """Start recording frame arrivals and draw times on view ``index`` (one watch per page)."""
    page.evaluate(_WATCH, index)


def watch_result(page: Any) -> dict[str, list[float]]:
    """``{"arrivals": [ms, ...], "draws": [ms, ...], "drawn": [frame seq, ...]}`` recorded since
    :func:`watch_view` (times from the page's clock)."""
    return dict(page.evaluate("() => window.kvlabWatch"))


def view_counters(page: Any, index: int) -> tuple[int, int]:
    """(frames the kernel says it sent, frames the browser received) of view ``index``."""
    d = page.evaluate("(i) => ({...document.querySelectorAll('.jp-OutputArea-output .kv-root')[i].dataset})", index)
    return int(d["framesSent"]), int(d["framesReceived"])
