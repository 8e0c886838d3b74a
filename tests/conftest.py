"""Shared fixtures: small pools on the default device; kvlab built as a wheel."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from _util import small_spec
from kvlab import BlockPool, KVSpec


@pytest.fixture
def spec() -> KVSpec:
    return small_spec()


@pytest.fixture
def pool(spec: KVSpec) -> BlockPool:
    return BlockPool(16, spec=spec)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """kvlab built as a wheel from this checkout, as `pip install .` would build it."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
                    str(Path(__file__).parents[1])], check=True, capture_output=True)
    (path,) = out.glob("kvlab-*.whl")
    return zipfile.ZipFile(path)
