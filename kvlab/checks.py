"""What kvlab takes as an int, a count and a positive count: one rule for every module, so that ``1.0``, ``True``
and ``"1"`` are refused everywhere and numpy integers accepted everywhere (a float id would be truncated by
numpy or torch, a bool read as 0 or 1). It imports nothing of kvlab but its errors, so the lowest modules
(storage, spec, eviction) use it too."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

import numpy as np

from .errors import ConfigError


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
