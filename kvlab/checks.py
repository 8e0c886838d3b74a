"""What kvlab takes as an int, a count and a positive count: one rule for every module, so that ``1.0``, ``True``
and ``"1"`` are refused everywhere and numpy integers accepted everywhere (a float id would be truncated by
numpy or torch, a bool read as 0 or 1). It imports nothing of kvlab but its errors, so the lowest modules
(storage, spec, eviction) use it too."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch

from .errors import ConfigError, KVDataError

if TYPE_CHECKING:
    from .spec import KVSpec


def is_int(x: Any) -> TypeGuard[int]:
    """The id rule, everywhere: a Python int or numpy integer, never a bool (nor numpy's, which is no integer)."""
    return type(x) is int or isinstance(x, np.integer)


def is_number(x: Any) -> bool:
    """A real number: a Python or numpy int or float, never a bool (NaN and infinities are numbers here; callers
    bound them)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def check_count(n: Any, what: str) -> int:
    """A count >= 0 (not a bool), else :class:`ConfigError`."""
    if not is_int(n) or n < 0:
        raise ConfigError(f"{what} must be an int >= 0, got {n!r}")
    return int(n)


def check_positive(n: Any, what: str) -> int:
    """A count >= 1 (not a bool), else :class:`ConfigError`."""
    if not is_int(n) or n < 1:
        raise ConfigError(f"{what} must be a positive int, got {n!r}")
    return int(n)


def check_list(x: Any, what: str) -> None:
    """:class:`ConfigError` (``what``, then ``x``) unless ``x`` is a sequence other than a string."""
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise ConfigError(f"{what}, got {x!r:.80}")


def check_kv_data(spec: "KVSpec", device: torch.device, kv: Any, capacity_tokens: int | None = None) -> int:
    """The token count of ``kv`` ``[2, layers, tokens, kv_heads, head_dim]`` if a pool of ``spec`` on ``device``
    can store it (right shape, dtype and device; at most ``capacity_tokens``), else :class:`KVDataError`."""
    if not isinstance(kv, torch.Tensor):
        raise KVDataError(f"kv_data must be a torch.Tensor, got {type(kv).__name__}")
    want = (2, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
        raise KVDataError(f"kv_data has shape {list(kv.shape)}, expected [2, {spec.num_layers}, tokens, "
                          f"{spec.num_kv_heads}, {spec.head_dim}]")
    if kv.dtype != spec.dtype or kv.device != device:
        raise KVDataError(f"kv_data is {kv.dtype} on {kv.device}; the pool stores {spec.dtype} on {device}")
    if capacity_tokens is not None and kv.shape[2] > capacity_tokens:
        raise KVDataError(f"kv_data holds {kv.shape[2]} tokens; the block holds {capacity_tokens}")
    return int(kv.shape[2])
