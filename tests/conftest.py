"""Shared fixtures: small pools on the default device."""
from __future__ import annotations

import pytest

from _util import small_spec
from kvlab import BlockPool, KVSpec


@pytest.fixture
def spec() -> KVSpec:
    return small_spec()


@pytest.fixture
def pool(spec: KVSpec) -> BlockPool:
    return BlockPool(16, spec=spec)
