"""What kvlab takes as an int, a count and a positive count: one rule for every module, so that ``1.0``, ``True``
and ``"1"`` are refused everywhere and numpy integers accepted everywhere (a float id would be truncated by
numpy or torch, a bool read as 0 or 1). It imports nothing of kvlab but its errors, so the lowest modules
(storage, spec, eviction) use it too."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch

from .errors import ConfigError, KVDataError

if TYPE_CHECKING:
    from .clock import Clock
    from .spec import KVSpec

INT32_MAX = 2**31 - 1  # block ids, owners and token counts are int32 fields
CLOCK_MAX = 2**62  # a clock starting later could tick past int64 (2**63 - 1) and overflow the stamps


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


def check_flag(x: Any, what: str) -> bool:
    """True or False (Python's or numpy's), else :class:`ConfigError`: ``"no"`` or ``0`` would read as a choice."""
    if not isinstance(x, (bool, np.bool_)):
        raise ConfigError(f"{what} must be True or False, got {x!r}")
    return bool(x)


def check_owner(owner: Any) -> int:
    """``owner`` as the int32 owner field stores it (-1 = no one), else :class:`ConfigError`."""
    if not is_int(owner) or not -1 <= owner <= INT32_MAX:
        raise ConfigError(f"owner must be an int in -1..{INT32_MAX} (-1 = no one), got {owner!r}")
    return int(owner)


def occurrences(ids: list[int]) -> dict[int, int]:
    """``{id: how often it occurs}`` in first-occurrence order: what ``Counter`` gives, at a fifth of its cost
    for the one- and few-block calls that dominate."""
    want: dict[int, int] = {}
    for b in ids:
        want[b] = want.get(b, 0) + 1
    return want


def check_block_sizes(spec: "KVSpec", block_sizes: Any) -> tuple["KVSpec", int]:
    """``spec`` with the smallest of ``block_sizes`` as its block size, and the largest class's buddy order;
    ``block_sizes`` None keeps ``spec`` (one class). :class:`ConfigError` unless the sizes are positive ints that
    are power-of-two multiples of the smallest."""
    if block_sizes is None:
        return spec, 0
    if not isinstance(block_sizes, (list, tuple)) or not block_sizes or \
            not all(is_int(s) and s >= 1 for s in block_sizes):
        raise ConfigError(f"block_sizes must be a list of positive ints, got {block_sizes!r}")
    sizes = sorted({int(s) for s in block_sizes})
    bad = [s for s in sizes if s % sizes[0] or (s // sizes[0]) & (s // sizes[0] - 1)]
    if bad:
        raise ConfigError(f"block sizes {bad} are not power-of-two multiples of the smallest, {sizes[0]}")
    return replace(spec, block_size=sizes[0]), (sizes[-1] // sizes[0]).bit_length() - 1


def check_clock(clock: "Clock") -> "Clock":
    """``clock`` if ``now()`` is an int in 0..:data:`CLOCK_MAX` (stamps are int64, with room to tick)."""
    if type(now := clock.now()) is not int or not 0 <= now <= CLOCK_MAX:
        raise ConfigError(f"the clock must count in ints from 0 to {CLOCK_MAX} (stamps are int64, with room to "
                          f"tick), but now() gave {now!r}")
    return clock
