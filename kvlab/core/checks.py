"""What kvlab takes as an int, a number, a flag, a seed, a path...: one rule for every module, so that ``1.0``,
``True`` and ``"1"`` are refused everywhere and numpy integers accepted everywhere (a float id would be truncated
by numpy or torch, a bool read as 0 or 1). It imports nothing of kvlab but its errors, so the lowest modules
(storage, spec, eviction) use it too. A module keeps only its own ranges (the pool's size classes, the storage's
layers) and calls these for the rest; each raises :class:`~kvlab.ConfigError` naming the value, before anything
has changed.

The vocabulary, one line a rule:

* :func:`is_int`: a Python or numpy int, never a bool; :func:`is_int_array`: an integer tensor or array.
* :func:`check_count`: an int >= 0; :func:`check_positive`: an int >= 1; :func:`check_owner`: an owner id,
  -1..:data:`INT32_MAX`.
* :func:`is_number`: a Python or numpy int or float, never a bool (NaN and infinities included);
  :func:`is_real`: one that is finite. :func:`check_real`: a number in a range (finite unless asked).
* :func:`check_flag`: True or False (numpy's too), never ``0`` or ``"no"``.
* :func:`check_seed`: a random seed, an int in 0..:data:`SEED_MAX` (what torch, numpy and ``random`` all take).
* :func:`check_choice`: one of a few named options (strs, or None).
* :func:`check_list`: a sequence other than a str. :func:`check_token_ids`: a non-empty list of token ids below
  a vocabulary (a model's input, :class:`ConfigError`); :func:`token_bytes` / :func:`token_list`: token ids as
  the KV cache stores and hashes them, int64 (:class:`~kvlab.KVDataError`); :class:`TokenBytes` is what
  :func:`token_bytes` returns and passes through unchecked, so ids are checked once on their way in;
  :func:`token_ids` gives both forms from one check. :func:`is_text`: a str UTF-8 can encode (no lone
  surrogate); :func:`check_tenant`: such a str or None.
* :func:`is_path` / :func:`check_path`: a file name, a str or path-like (the OS judges the rest on opening).
* :func:`check_device`: a torch device this machine has.
* :func:`check_kv_data`: K/V a pool can store. :func:`check_block_sizes`: size classes. :func:`check_clock`: a
  clock whose stamps fit int64.
* :func:`show`: a value as an error message names it (cut short, never failing).
"""
from __future__ import annotations

import math
from array import array
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar, overload

import numpy as np
import torch

from kvlab.core.errors import ConfigError, KVDataError

if TYPE_CHECKING:
    from kvlab.core.clock import Clock
    from kvlab.core.spec import KVSpec

T = TypeVar("T")

INT32_MAX = 2**31 - 1  # block ids, owners and token counts are int32 fields
CLOCK_MAX = 2**62  # a clock starting later could tick past int64 (2**63 - 1) and overflow the stamps
SEED_MAX = 2**64 - 1  # torch's generators take 0..2**64-1; numpy's and random's take those too
TOKEN_MAX = 2**63 - 1  # token ids are hashed and stored as int64


def is_int(x: Any) -> TypeGuard[int]:
    """The id rule, everywhere: a Python int or numpy integer, never a bool (nor numpy's, which is no integer)."""
    return type(x) is int or isinstance(x, np.integer)


def is_int_array(x: Any) -> bool:
    """Ids as one object: an integer torch tensor or numpy array (no bool, float or complex elements)."""
    if isinstance(x, torch.Tensor):
        return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    return isinstance(x, np.ndarray) and x.dtype.kind in "iu"


def is_number(x: Any) -> bool:
    """A real number: a Python or numpy int or float, never a bool (NaN and infinities are numbers here; callers
    bound them)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def is_real(x: Any) -> bool:
    """A finite real number: :func:`is_number` and neither NaN, infinite nor an int too large for a float."""
    try:
        return is_number(x) and math.isfinite(x)
    except OverflowError:  # an int past the float range
        return False


def show(v: Any, limit: int = 80) -> str:
    """``repr(v)`` cut to ``limit`` characters, as an error message names a value: a huge value still makes a
    readable message, and an int past Python's digit limit (no repr at all) or a broken ``__repr__`` still one."""
    try:
        text = repr(v)
    except Exception:  # a hostile or broken __repr__ must not hide the real problem
        text = f"an int of {v.bit_length()} bits" if type(v) is int else f"<{type(v).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_real(x: Any, what: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
               hi_open: bool = False, finite: bool = True, unit: str = "", note: str = "") -> float:
    """``x`` as a float if it is a number (:func:`is_number`), not NaN, finite (``finite=False`` lets the
    infinities through where the bounds do), ``>= lo`` (``> lo`` if ``lo_open``) and ``<= hi`` (``< hi`` if
    ``hi_open``); else :class:`ConfigError`: ``"{what} must be a finite number{unit} >= {lo}{note}, got ..."``
    (a number in [lo, hi] when both bounds are given)."""
    try:
        v = float(x) if is_number(x) else math.nan
    except OverflowError:  # an int past the float range
        v = math.nan
    if not (v == v and (math.isfinite(v) or not finite) and (lo is None or (v > lo if lo_open else v >= lo))
            and (hi is None or (v < hi if hi_open else v <= hi))):
        if lo is not None and hi is not None:
            kind = f"a number{unit} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        else:
            kind = f"a {'finite ' if finite else ''}number{unit}" + (
                f" {'>' if lo_open else '>='} {lo}" if lo is not None else
                f" {'<' if hi_open else '<='} {hi}" if hi is not None else "")
        raise ConfigError(f"{what} must be {kind}{note}, got {show(x)}")
    return v


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


def check_token_ids(tokens: Any, what: str, vocab_size: int | None = None) -> list[int]:
    """``tokens`` as a list of ids, else :class:`ConfigError` naming the first bad one: a non-empty list (tuple,
    range) of ints in ``0..vocab_size - 1`` (None: any id an int64 holds, ``0..TOKEN_MAX``). A list of plain
    ints is checked in C, with no Python step per token."""
    if not isinstance(tokens, (list, tuple, range)) or not tokens:
        raise ConfigError(f"{what} must be a non-empty list of token ids, got {show(tokens)}")
    top = TOKEN_MAX if vocab_size is None else vocab_size - 1
    if type(tokens) is list and set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) <= top:
        return list(tokens)
    for i, t in enumerate(tokens):
        if not is_int(t) or not 0 <= t <= top:
            raise ConfigError(f"{what}: token {i} is {show(t)}, not an id in 0..{top}")
    return [int(t) for t in tokens]


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


@overload
def check_seed(seed: Any, what: str = ..., *, optional: Literal[False] = ...) -> int: ...
@overload
def check_seed(seed: Any, what: str = ..., *, optional: Literal[True]) -> int | None: ...
def check_seed(seed: Any, what: str = "seed", *, optional: bool = False) -> int | None:
    """``seed`` as a plain int in 0..:data:`SEED_MAX` (torch's ``manual_seed`` takes no numpy integer), or None
    when ``optional`` (None: not seeded); else :class:`ConfigError`. A float or a list would seed ``random`` too
    (it takes anything hashable), but not the generator the caller meant."""
    if optional and seed is None:
        return None
    if not is_int(seed) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"{what} must be {'None or ' if optional else ''}an int in 0..2**64-1, got {show(seed)}")
    return int(seed)


def check_choice(x: Any, what: str, options: Sequence[T]) -> T:
    """``x`` if it is one of ``options`` (strs, and None where None is one), else :class:`ConfigError` listing
    them."""
    if (x is None or isinstance(x, str)) and x in options:
        return x  # type: ignore[return-value]  # x is one of the options: of their type
    names = [str(o) for o in options]
    listed = f"one of {', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    raise ConfigError(f"{what} must be {listed}, got {show(x)}")


def is_path(x: Any) -> bool:
    """A file name: a str or path-like (``os.PathLike`` giving a str). Whether the OS takes it (a NUL
    character, a missing folder) is known only when the file is opened: the caller says so then."""
    try:
        return isinstance(x, (str, os.PathLike)) and isinstance(os.fspath(x), str)
    except TypeError:  # a __fspath__ that gives neither str nor bytes
        return False


def check_path(x: Any, what: str) -> Path:
    """``x`` as a :class:`~pathlib.Path` if :func:`is_path`, else :class:`ConfigError`."""
    if not is_path(x):
        raise ConfigError(f"{what} must be a str or Path, got {show(x)}")
    return Path(x)


def check_device(value: Any, what: str) -> torch.device:
    """``value`` as a torch device this machine has (``cpu``, ``cuda``, ``cuda:1``), else :class:`ConfigError`
    naming ``what``: refused here rather than at the first tensor, long after the mistake."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{what} must be a torch device (e.g. cpu, cuda, cuda:1), got {value!r:.80}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what}: kvlab runs on cpu or cuda devices, got {value!r:.80}")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"{what} {value!r:.80}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


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


_NONE = object()  # "no bad token found" (None itself is a bad token)
_INT = {int}
_SHORT = 64  # token lists up to this long are checked for negatives by min, longer ones by numpy


class TokenBytes(bytes):
    """Token ids that passed :func:`token_bytes`: int64 bytes, 8 per id, native order. Handing one to
    :func:`token_bytes` again costs nothing, so a prompt is checked once on its way in (the sequence manager
    checks it, the prefix cache looks it up). Only :func:`token_bytes`, and code holding ids it already checked,
    make one."""

    __slots__ = ()


def token_bytes(x: object, where: str) -> TokenBytes:
    """``x`` (a list, tuple, range or 1-D integer array/tensor of token ids in 0..2**63-1) as :class:`TokenBytes`,
    else :class:`KVDataError` naming the bad id, starting with ``where``. Strings, sets and dicts are refused:
    they iterate, but not as an ordered sequence of ids. A list of ints or an integer array is checked and
    converted in C, with no Python loop per token."""
    items: list | tuple | range
    if type(x) is TokenBytes:
        return x
    if isinstance(x, (list, tuple, range)):
        items = x
    elif isinstance(x, (torch.Tensor, np.ndarray)):
        if x.ndim != 1:
            raise KVDataError(f"{where}: token ids must be 1-D, got shape {tuple(x.shape)}")
        a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) and x.dtype != torch.bool else x
        if isinstance(a, np.ndarray) and a.dtype.kind in "iu":
            small = a.dtype.kind == "i" or a.dtype.itemsize < 8  # no such id passes TOKEN_MAX
            if not a.size or (a.min() >= 0 and (small or a.max() <= TOKEN_MAX)):
                return TokenBytes(np.ascontiguousarray(a, dtype=np.int64))
        items = x.tolist()  # floats, bools, ids out of range: the loop below names the first bad one
    else:
        raise KVDataError(f"{where}: token ids are a list of ints, not {x!r}")
    if (data := _exact_bytes(items)) is not None:
        return data
    bad = next((t for t in items if not (is_int(t) and 0 <= t <= TOKEN_MAX)), _NONE)
    if bad is not _NONE:
        raise KVDataError(f"{where}: token ids are ints in 0..2**63-1, got {bad!r}")
    return TokenBytes(array("q", [int(t) for t in items]))  # numpy integers among them


def _exact_bytes(items: list | tuple | range) -> TokenBytes | None:
    """``items`` as :class:`TokenBytes` if they are exact ints in 0..2**63-1 (checked and converted in C, no
    Python loop per token), else None: the caller's slow path names what is wrong."""
    if not items:
        return TokenBytes()
    if set(map(type, items)) != _INT:
        return None
    try:
        a = array("q", items)
    except OverflowError:  # some id is past int64
        return None
    low = min(items) if len(items) <= _SHORT else np.frombuffer(a, dtype=np.int64).min()
    return TokenBytes(a) if low >= 0 else None


def token_ids(x: object, where: str) -> tuple[list[int], TokenBytes]:
    """Token ids checked once (:func:`token_bytes`'s rule and errors), both as a sequence keeps them (a list of
    ints, a copy) and as the prefix cache hashes them."""
    if type(x) is list and (data := _exact_bytes(x)) is not None:
        return list(x), data
    data = token_bytes(x, where)
    return array("q", data).tolist(), data


def token_list(x: object, where: str) -> list[int]:
    """:func:`token_bytes` as a list of ints (a copy), for the sequences that keep token ids as a list."""
    if type(x) is list and x and set(map(type, x)) == _INT and min(x) >= 0 and max(x) <= TOKEN_MAX:
        return list(x)  # the common case, checked in C without converting
    return array("q", token_bytes(x, where)).tolist()


def is_text(x: object) -> TypeGuard[str]:
    """A str that UTF-8 can encode: not one holding a lone surrogate (``"\\ud800"``, which JSON can spell), since
    such a name could not be hashed, written to a trace or sent to a browser."""
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_tenant(tenant: object) -> str | None:
    """A tenant is a str UTF-8 can encode (its hash salt, :func:`is_text`) or None."""
    if tenant is not None and not is_text(tenant):
        raise ConfigError(f"tenant must be a str (UTF-8 text) or None, got {show(tenant)}")
    return tenant
