"""Helpers shared by the tests: small specs, a proof that a rejected call changed nothing, and a copy of the
checkout. Test modules import them from here, never from a conftest (two conftest modules share that name, and
which one an import finds depends on what pytest collected first)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from kvlab import BlockPool, KVSpec

if TYPE_CHECKING:
    import nbformat


def small_spec(**kw) -> KVSpec:
    base = dict(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
    base.update(kw)
    return KVSpec(**base)


def pool_state(pool: BlockPool) -> tuple:
    """Everything observable about a pool: metadata, free lists, evictable set, counters and the KV tensor."""
    snap = pool.snapshot()
    kv = pool.storage.kv.clone() if pool.storage is not None else None
    return ({k: v.copy() for k, v in snap.items()}, [pool.free_ids(k) for k in range(pool.max_order + 1)],
            list(pool.policy.order()), {**pool.stats(), "clock": pool.clock.now()}, kv)


def same_state(before: tuple, after: tuple) -> bool:
    """Whether two :func:`pool_state` results are equal (the KV tensor bitwise)."""
    try:
        assert_same_state(before, after)
    except AssertionError:
        return False
    return True


def assert_same_state(before: tuple, after: tuple) -> None:
    s0, f0, p0, st0, kv0 = before
    s1, f1, p1, st1, kv1 = after
    for k in s0:
        np.testing.assert_array_equal(s0[k], s1[k], err_msg=k)
    assert f0 == f1 and p0 == p1
    assert st0 == st1  # counters, lock acquisitions and the clock
    assert (kv0 is None and kv1 is None) or torch.equal(kv0.view(torch.uint8), kv1.view(torch.uint8))  # bitwise


REPO = Path(__file__).resolve().parents[1]
# What a build leaves behind, never copied: the copy must compile its own binary.
_UNCOPIED = (".git", ".venv", ".hypothesis", ".pytest_cache", "__pycache__", "build", "dist", "site", "*.egg-info",
             "*.pyc", ".ipynb_checkpoints", "bench-results")


def _project_files() -> list[Path] | None:
    """Tracked and untracked-but-not-ignored files, relative to the checkout; None where git cannot say."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [Path(p) for p in out.decode().split("\0") if p]


def copy_project(dest: Path) -> Path:
    """The project's source in ``dest``, without build outputs."""
    files = _project_files()
    if files is None:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(*_UNCOPIED))
        return dest
    for rel in files:
        src = REPO / rel
        if src.is_file():  # a path deleted but not yet committed is skipped
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


CHAPTERS = REPO / "chapters"


def execute_notebook(path: Path, timeout: int) -> "nbformat.NotebookNode":
    """Run every cell of the notebook at ``path`` in a fresh kernel in fast mode (no GPU), from the chapters
    folder; returns the executed notebook. ``timeout`` bounds each cell, in seconds."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = {"KVLAB_FAST": "1", "CUDA_VISIBLE_DEVICES": ""}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the test's environment
    try:
        NotebookClient(nb, kernel_name="python3", timeout=timeout, resources={"metadata": {"path": str(CHAPTERS)}},
                       startup_timeout=60).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def conclusions(nb: "nbformat.NotebookNode") -> dict:
    """What a chapter's one cell tagged ``conclusions`` printed after ``CONCLUSIONS `` (a JSON object)."""
    import json

    cells = [c for c in nb.cells if "conclusions" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "a chapter has exactly one cell tagged 'conclusions'"
    text = "".join(o.get("text", "") for o in cells[0].outputs if o.output_type == "stream")
    line = next(ln for ln in text.splitlines() if ln.startswith("CONCLUSIONS "))
    return json.loads(line.removeprefix("CONCLUSIONS "))
