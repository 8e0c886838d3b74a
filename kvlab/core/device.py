"""Where the KV tensor lives: CUDA when available, else CPU; ``KVLAB_DEVICE`` overrides. And how many CPU
threads torch computes with (:func:`torch_threads`)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvlab.core.checks import check_positive
from kvlab.core.errors import ConfigError


def default_device() -> torch.device:
    """The device kvlab uses when none is given: ``$KVLAB_DEVICE`` if set, else ``cuda`` if available, else ``cpu``."""
    name = os.environ.get("KVLAB_DEVICE")
    if name:
        try:
            dev = torch.device(name)
        except RuntimeError as e:
            raise ConfigError(f"KVLAB_DEVICE={name!r} is not a torch device: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"KVLAB_DEVICE={name!r} but CUDA is not available on this machine")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the number there was (on a shared machine,
    threads beyond the free cores mostly wait for one, so the real model's runs and benchmarks set it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(check_positive(n, "threads"))
    try:
        yield
    finally:
        torch.set_num_threads(before)
