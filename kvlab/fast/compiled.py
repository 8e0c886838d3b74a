"""Loading kvlab's optional compiled speed tricks (``_fastpath.c``, ``_paged_attention.c``) with one rule.

Each extension is a speed trick with a Python twin that the tests hold equal to it, so a missing binary is never an
error: kvlab runs the Python path. It does say so, once per process and naming what fixes it, when the binary
should have been there: the install found no C compiler or no Python headers (the build hook, ``hatch_build.py``,
records why in ``_build.json`` beside this file), a source checkout with a C compiler but no binary, or a binary
built from an older source (its SHA-256 is compiled in). It stays quiet where the install chose the pure-Python
build (``KVLAB_NO_EXT=1``, the ``py3-none-any`` wheel) or the part does not apply to the platform.
``KVLAB_PURE_PYTHON=1`` switches every extension off at run time.

Nothing here imports torch: :func:`compiled_report` serves ``kvlab --version``, which answers without it.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

HERE = Path(__file__).parent
RECORD = HERE / "_build.json"
REBUILD = "reinstall kvlab to rebuild it (`make install` in a checkout, or pip install --no-deps -e .)"
_warned: set[tuple[str, str]] = set()


class Extension(NamedTuple):
    """One C extension's state in this process: the loaded module (None when its Python twin runs), why not
    (None when loaded) and what fixes that (None where nothing needs fixing: chosen, or not for this platform)."""
    module: ModuleType | None
    why: str | None
    fix: str | None


def build_record() -> dict[str, dict[str, Any]]:
    """What the install's build hook did, per extension (``{"built": bool, "why": str|None, "fix": str|None}``);
    empty where kvlab was not installed through the hook (a bare source tree)."""
    try:
        record = json.loads(RECORD.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def extension(name: str) -> Extension:
    """The state of ``kvlab/fast/<name>.c``'s binary: loaded, or why not and what fixes it."""
    if os.environ.get("KVLAB_PURE_PYTHON"):
        return Extension(None, "switched off by KVLAB_PURE_PYTHON=1", None)
    source = HERE / f"{name}.c"
    recorded = build_record().get(name) or {}
    try:
        module = importlib.import_module(f"kvlab.fast.{name}")
    except ImportError as e:
        if recorded.get("built") is False:
            return Extension(None, f"not compiled at install: {recorded.get('why')}", recorded.get("fix"))
        if recorded.get("built"):
            return Extension(None, f"compiled at install but does not load ({e})", REBUILD)
        if source.exists() and shutil.which(os.environ.get("CC", "").split(" ")[0] or "cc"):
            return Extension(None, "not compiled although a C compiler is at hand", REBUILD)
        return Extension(None, "not compiled (no C compiler here)", None)
    if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != module.SOURCE_SHA256:
        return Extension(None, f"{source.name} changed after it was compiled", REBUILD)
    return Extension(module, None, None)


def load_extension(name: str, attribute: str, meanwhile: str) -> Any:
    """``kvlab.fast.<name>.<attribute>`` from the extension built from ``kvlab/fast/<name>.c``, or None, with one
    warning per cause and process saying why, what fixes it and what runs ``meanwhile``, where there is a fix."""
    ext = extension(name)
    if ext.module is not None:
        return getattr(ext.module, attribute)
    if ext.fix and (ext.why or "", ext.fix) not in _warned:
        _warned.add((ext.why or "", ext.fix))
        warnings.warn(f"kvlab/fast/{name}.c: {ext.why}; {ext.fix}. {meanwhile}", stacklevel=3)
    return None


# What each part is called in `kvlab --version`, compiled and not.
_PARTS = (("_fastpath", "FastBlockPool", "pure Python"), ("_paged_attention", "CPU paged decode", "gather + SDPA"))


def compiled_report() -> str:
    """One line for ``kvlab --version``: each compiled part or what runs instead, then, where a part is not
    compiled, why and what fixes it (once, however many parts share the cause). Imports no torch."""
    parts, causes = [], []
    for name, label, instead in _PARTS:
        ext = extension(name)
        c_file = f"kvlab/fast/{name}.c"
        parts.append(f"{label}: compiled ({c_file})" if ext.module else f"{label}: {instead} (no compiled {c_file})")
        cause = f"{ext.why}" + (f"; fix: {ext.fix}" if ext.fix else "")  # one cause usually holds for both
        if ext.module is None and cause not in causes:
            causes.append(cause)
    return "; ".join(parts) + (f"; why: {' / '.join(causes)}" if causes else "")


def install_check() -> int:
    """After an install (``make install``): print one line to stderr if a part is not compiled and something fixes
    that; 1 then, else 0."""
    report = compiled_report()
    fixable = [e for e in map(extension, (n for n, _, _ in _PARTS)) if e.module is None and e.fix]
    if fixable:
        print(f"kvlab: {report}", file=sys.stderr)
    return 1 if fixable else 0
