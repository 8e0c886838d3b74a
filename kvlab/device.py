"""Where the KV tensor lives: CUDA when available, else CPU; ``KVLAB_DEVICE`` overrides."""
from __future__ import annotations

import os

import torch

from .errors import ConfigError


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
