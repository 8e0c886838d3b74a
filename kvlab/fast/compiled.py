"""Loading kvlab's optional compiled speed tricks (``_fastpath.c``, ``_paged_attention.c``) with one rule.

Each extension is a speed trick with a Python twin that the tests hold equal to it, so a missing binary is never an
error: kvlab runs the Python path. It does say so, once, when the binary should have been there: a source
checkout with a C compiler but no binary, or a binary built from an older source (its SHA-256 is compiled in).
``KVLAB_PURE_PYTHON=1`` switches every extension off.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any


def load_extension(name: str, attribute: str, meanwhile: str) -> Any:
    """``kvlab.fast.<name>.<attribute>`` from the extension built from ``kvlab/fast/<name>.c``, or None (with one
    warning saying what runs ``meanwhile`` when it should have been built, or is stale)."""
    if os.environ.get("KVLAB_PURE_PYTHON"):
        return None
    source = Path(__file__).with_name(f"{name}.c")
    try:
        module = importlib.import_module(f".{name}", __package__)
    except ImportError:
        if source.exists() and shutil.which(os.environ.get("CC", "").split(" ")[0] or "cc"):
            warnings.warn(f"kvlab/fast/{name}.c is not compiled although a C compiler is at hand; reinstall kvlab "
                          f"(`make install`). {meanwhile}", stacklevel=3)
        return None
    if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != module.SOURCE_SHA256:
        warnings.warn(f"{source} changed after it was compiled; reinstall kvlab (`make install`) to rebuild it. "
                      f"{meanwhile}", stacklevel=3)
        return None
    return getattr(module, attribute)
