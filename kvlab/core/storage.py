"""KVStorage: the ONE preallocated tensor that holds K and V for every layer, block and token slot.

Layout ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (K at index 0, V at 1), so the slots
of a block are contiguous and ``slot = block_id * block_size + offset`` addresses a token in the flattened
``[2, num_layers, num_blocks * block_size, heads, dim]`` view. Nothing here knows about states or refcounts:
this is raw memory, and :class:`kvlab.BlockPool` decides who may touch which block.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import torch

from kvlab.core.checks import check_positive, is_int, is_int_array
from kvlab.core.errors import ConfigError, KVDataError, KVLabError, UnknownBlockError
from kvlab.core.spec import KVSpec

IndexLike = Sequence[int] | torch.Tensor


def int_tensor(x: Any, what: str, error: type[KVLabError], device: torch.device | str | None = None) -> torch.Tensor:
    """``x`` as an int64 tensor on ``device``, else ``error`` naming the value at fault: ``x`` is an integer tensor
    or array, or a list, tuple or range of ints as :func:`kvlab.core.checks.is_int` counts them (no bools, no
    floats)."""
    if isinstance(x, (list, tuple)):
        if not set(map(type, x)) <= {int}:  # plain ints pass in one C-level pass; anything else is looked at
            for v in x:  # torch would truncate a float, and read a bool among ints as 0 or 1
                if not is_int(v):
                    raise error(f"{what} must be ints, got {v!r}")
    elif not (isinstance(x, range) or is_int_array(x)):
        raise error(f"{what} must be ints (a list, or an integer tensor or array), got {x!r}")
    try:
        return torch.as_tensor(x, dtype=torch.long, device=device)
    except ValueError:  # an int past int64
        raise error(f"{what} must fit in int64, got {x!r}") from None


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes (CUDA: the driver's count; CPU: available physical pages), or None
    when the platform cannot tell."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


class KVStorage:
    """The KV tensor of a pool with ``num_blocks`` blocks of ``spec.block_size`` slots."""

    def __init__(self, spec: KVSpec, num_blocks: int) -> None:
        if not isinstance(spec, KVSpec):
            raise ConfigError(f"spec must be a KVSpec, got {spec!r}")
        num_blocks = check_positive(num_blocks, "num_blocks")  # a plain int: numpy's would overflow silently below
        self.spec, self.num_blocks = spec, num_blocks
        nbytes = num_blocks * spec.bytes_per_block
        free = device_free_bytes(spec.device)
        if free is not None and nbytes > free:  # fail fast instead of thrashing or an opaque allocator error
            raise ConfigError(f"a pool of {num_blocks} blocks x {spec.bytes_per_block} bytes needs {nbytes:,} bytes "
                              f"but {spec.device} has {free:,} free: at most {free // spec.bytes_per_block} "
                              f"blocks fit")
        self.kv = torch.zeros((2, spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
                              dtype=spec.dtype, device=spec.device)
        # Slot-addressed view (no copy): [2, layers, num_blocks * block_size, heads, dim].
        self.slots = self.kv.view(2, spec.num_layers, num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def check_layer(self, layer: Any) -> int:
        """``layer`` as an int in ``0..num_layers - 1``, else :class:`ConfigError` (a bool or float index would
        select a copy, not the layer)."""
        if not is_int(layer) or not 0 <= layer < self.spec.num_layers:
            raise ConfigError(f"layer {layer!r} is not an int in 0..{self.spec.num_layers - 1}")
        return int(layer)

    def _index(self, ids: IndexLike, what: Literal["block", "slot"] = "block") -> torch.Tensor:
        """Block ids (or slots) as a flat int64 tensor, each in the pool, else :class:`UnknownBlockError`; one
        min/max pass checks the range."""
        n = self.num_blocks * (self.spec.block_size if what == "slot" else 1)
        idx = int_tensor(ids, f"{what} ids", UnknownBlockError, self.kv.device).reshape(-1)
        if idx.numel():
            lo, hi = (int(x) for x in torch.aminmax(idx))
            if lo < 0 or hi >= n:
                raise UnknownBlockError(f"{what} {lo if lo < 0 else hi} is not in this pool ({what}s 0..{n - 1})")
        return idx

    def block_view(self, block_id: int, span: int = 1) -> torch.Tensor:
        """A view (no copy) of ``span`` consecutive blocks from ``block_id``: ``[2, layers, span*B, heads, dim]``."""
        if not (is_int(block_id) and is_int(span) and span >= 1 and 0 <= block_id <= self.num_blocks - span):
            raise UnknownBlockError(f"{span!r} blocks from block {block_id!r} are not all in this pool (ids "
                                    f"0..{self.num_blocks - 1})")
        s = self.spec
        return self.kv[:, :, block_id:block_id + span].reshape(2, s.num_layers, span * s.block_size,
                                                               s.num_kv_heads, s.head_dim)

    def check_kv(self, k: torch.Tensor, v: torch.Tensor, n: int | None = None) -> None:
        """Raise :class:`KVDataError` unless ``k``/``v`` are ``[tokens, heads, dim]`` of the pool's dtype/device."""
        s = self.spec
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise KVDataError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (s.num_kv_heads, s.head_dim) \
                    or (n is not None and t.shape[0] != n):
                want = f"[{n if n is not None else 'tokens'}, {s.num_kv_heads}, {s.head_dim}]"
                raise KVDataError(f"{name} has shape {list(t.shape)}, expected {want}")
            if t.dtype != s.dtype:
                raise KVDataError(f"{name} has dtype {t.dtype}, the pool stores {s.dtype}")
            if t.device != self.kv.device:
                raise KVDataError(f"{name} is on {t.device}, the pool is on {self.kv.device}")

    def write_slots(self, layer: int, slots: IndexLike, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of ``len(slots)`` tokens of one layer with one ``index_copy_`` (K and V together)."""
        layer, idx = self.check_layer(layer), self._index(slots, "slot")
        self.check_kv(k, v, idx.numel())
        self.slots[:, layer].index_copy_(1, idx, torch.stack((k, v)))

    def read_slots(self, layer: int, slots: IndexLike) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V of the given slots of one layer (a copy): two ``[len(slots), heads, dim]`` tensors."""
        kv = self.slots[:, self.check_layer(layer)].index_select(1, self._index(slots, "slot"))
        return kv[0], kv[1]

    def copy_blocks(self, src: IndexLike, dst: IndexLike) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` for all layers in one batched gather/scatter."""
        s, d = self._index(src), self._index(dst)
        if s.numel() != d.numel():
            raise KVDataError(f"copy_blocks got {s.numel()} sources but {d.numel()} destinations")
        if s.numel():
            self.kv[:, :, d] = self.kv[:, :, s]

    def _check_blocks(self, name: str, t: Any, n: int) -> None:
        """Raise :class:`KVDataError` unless ``t`` holds ``n`` whole blocks ``[2, layers, n, B, heads, dim]`` of
        the pool's dtype."""
        if not isinstance(t, torch.Tensor):
            raise KVDataError(f"{name} must be a torch.Tensor, got {t!r}")
        want = (*self.kv.shape[:2], n, *self.kv.shape[3:])
        if t.shape != want or t.dtype != self.kv.dtype:
            raise KVDataError(f"{name} is {t.dtype} of shape {list(t.shape)}; {n} blocks are {self.kv.dtype} of "
                              f"shape {list(want)}")

    def gather_blocks(self, ids: IndexLike, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks ``ids`` as ``[2, layers, len(ids), B, heads, dim]``; into ``out`` (e.g. pinned host memory) if
        given."""
        idx = self._index(ids)
        if out is None:
            return self.kv.index_select(2, idx)
        self._check_blocks("out", out, idx.numel())
        out.copy_(self.kv.index_select(2, idx), non_blocking=out.is_pinned())
        return out

    def scatter_blocks(self, ids: IndexLike, data: torch.Tensor) -> None:
        """Write ``data`` (as returned by :meth:`gather_blocks`) into blocks ``ids``."""
        idx = self._index(ids)
        self._check_blocks("data", data, idx.numel())
        self.kv.index_copy_(2, idx, data.to(self.kv.device, non_blocking=True))
