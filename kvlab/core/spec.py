"""KVSpec: the shape of one token's keys and values, and the block size that groups tokens into blocks."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.core.checks import check_device, is_int
from kvlab.core.device import default_device
from kvlab.core.errors import ConfigError


@dataclass(frozen=True)
class KVSpec:
    """Model-side facts the cache needs. One token costs ``2 * num_layers * num_kv_heads * head_dim`` elements
    (K and V for every layer); a block holds ``block_size`` tokens, always, whether they are written or not."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=default_device)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"KVSpec.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(f"KVSpec.dtype must be a floating torch.dtype (K and V are real numbers), "
                              f"got {self.dtype!r}")
        object.__setattr__(self, "device", check_device(self.device, "KVSpec.device"))

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers, in bytes."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        """Fixed capacity of one block in bytes (``block_size`` token slots)."""
        return self.bytes_per_token * self.block_size

    def blocks_for_budget(self, total_memory: int) -> int:
        """How many blocks fit in ``total_memory`` bytes (the text's ``total_memory`` argument)."""
        if not is_int(total_memory) or total_memory < self.bytes_per_block:
            raise ConfigError(
                f"total_memory={total_memory!r} bytes holds no block of {self.bytes_per_block} bytes")
        return int(total_memory) // self.bytes_per_block
