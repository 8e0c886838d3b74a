"""Shared fixtures: small pools on the default device; kvlab built as a wheel. Also what CI changes:

* ``CI=true`` turns every skip into a failure (a skip in CI means something was not installed), except tests
  marked ``gpu`` on a machine without CUDA.
* Hypothesis profiles: ``dev`` (default: random), ``ci`` (loaded with ``CI=true``: derandomized, prints the
  blob to reproduce a failure), ``long`` (loaded with ``KVLAB_LONG=1``). Pick one by hand with
  ``pytest --hypothesis-profile=long``. A test's own ``@settings(max_examples=...)`` wins over the profile's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from _util import copy_project, execute_notebook, small_spec
from kvlab import BlockPool, KVSpec



def in_ci() -> bool:
    """Read at each call, so a test can switch it (the browser fixtures use the same rule)."""
    return os.environ.get("CI", "").lower() == "true"


# Each from Hypothesis' defaults, not from whichever profile is loaded now (Hypothesis loads its own "ci" on CI).
_BASE = settings.get_profile("default")
settings.register_profile("dev", _BASE, deadline=None)
settings.register_profile("ci", _BASE, derandomize=True, deadline=None, print_blob=True, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow])  # a shared runner's timing is noise
settings.register_profile("long", _BASE, deadline=None, max_examples=2000)
# Loaded before test modules import, so their @settings(...) inherit the rest; --hypothesis-profile loads later.
settings.load_profile("long" if os.environ.get("KVLAB_LONG") == "1" else "ci" if in_ci() else "dev")


class CIGuard:
    """With ``CI=true``, a skipped test is reported as failed, naming the skip's reason."""

    def __init__(self, cuda: bool | None = None) -> None:
        self._cuda = cuda  # None: ask torch when a gpu test first skips

    def cuda(self) -> bool:
        if self._cuda is None:
            import torch
            self._cuda = torch.cuda.is_available()
        return self._cuda

    @staticmethod
    def _reason(longrepr) -> str:
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        return reason.removeprefix("Skipped: ")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):  # xfail reports as skipped too
            return
        if item.get_closest_marker("gpu") is not None and not self.cuda():
            return
        report.outcome = "failed"
        report.longrepr = f"CI=true, so this test may not skip; it skipped with: {self._reason(report.longrepr)}"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector):
        report = (yield).get_result()
        if in_ci() and report.skipped:  # a module-level skip or importorskip would hide a whole file
            report.outcome = "failed"
            report.longrepr = f"CI=true, so {collector.nodeid} may not skip; it skipped with: " \
                              f"{self._reason(report.longrepr)}"


def pytest_configure(config) -> None:
    config.pluginmanager.register(CIGuard(), "kvlab-ci-guard")


# Session fixtures that cost seconds or more: under pytest-xdist, the modules that use one are handed out first.
COSTLY_FIXTURES = ("executed", "smol", "lab", "wheel")


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``make test`` runs ``-n auto --dist loadfile``: each module on one worker, so module
    fixtures are built once), the modules using a costly session fixture come first, so no worker is left alone
    with a long one at the end. A plain run keeps its order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # set in each worker, which collects
        return
    costly = {item.nodeid.split("::")[0] for item in items if set(COSTLY_FIXTURES) & set(item.fixturenames)}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in costly)


@pytest.fixture(scope="session", autouse=True)
def _torch_threads_per_worker() -> None:
    """Under pytest-xdist, the machine's cores are shared between the workers (more torch threads than free
    cores mostly wait)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def spec() -> KVSpec:
    return small_spec()


@pytest.fixture
def pool(spec: KVSpec) -> BlockPool:
    return BlockPool(16, spec=spec)


@pytest.fixture(scope="session")
def smol():
    """The real SmolLM2-135M (tests marked ``llm``), loaded once for the session: each load takes seconds, and the
    tests only read the model (its K/V live in each test's own pool)."""
    from kvlab import load_model
    return load_model("smollm2-135m", progress=False)


# What a build leaves behind, never copied: the copy must compile its own binary.
@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """kvlab built as a wheel, as `pip install .` would build it, from a copy of the checkout (a build must
    never write into the tree the tests run from)."""
    src = copy_project(tmp_path_factory.mktemp("src") / "kvlab")
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    if built.returncode:
        pytest.fail(f"the wheel did not build:\n{(built.stdout + built.stderr)[-4000:]}")
    (path,) = out.glob("kvlab-*.whl")
    return zipfile.ZipFile(path)


@pytest.fixture(scope="session")
def executed(tmp_path_factory):
    """``executed(path)``: the notebook at ``path`` run top to bottom in fast mode (``execute_notebook``, each cell
    within 120 s) and the seconds the run took. Each notebook runs once per session, under pytest-xdist too:
    tests/test_notebooks.py and the chapter tests read the same run (running each chapter twice cost minutes).
    The first process to ask runs it, holding a lock, and saves it where the others read it. A run that fails is
    not kept."""
    import fcntl
    import hashlib
    import json

    import nbformat

    base = tmp_path_factory.getbasetemp()
    store = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "executed-notebooks"
    store.mkdir(exist_ok=True)
    runs: dict[Path, tuple] = {}

    def get(path: Path) -> tuple:
        path = Path(path).resolve()
        if path not in runs:
            saved = store / hashlib.sha256(str(path).encode()).hexdigest()[:16]
            with open(saved.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if saved.with_suffix(".json").exists():  # another process ran it
                    runs[path] = (nbformat.read(saved.with_suffix(".ipynb"), as_version=4),
                                  json.loads(saved.with_suffix(".json").read_text()))
                else:
                    t = time.perf_counter()
                    nb = execute_notebook(path, timeout=120)
                    seconds = time.perf_counter() - t
                    runs[path] = nb, seconds
                    nbformat.write(nb, saved.with_suffix(".ipynb"))
                    saved.with_suffix(".json").write_text(json.dumps(seconds))  # written last
        return runs[path]
    return get
