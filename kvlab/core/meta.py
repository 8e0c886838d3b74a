"""Per-block metadata: one flat array per field, indexed by base-block id (text §2.2.2, "块结构设计").

The text's ``KVBlock`` is an object with fields. A pool of a million blocks would then be a million objects;
here each field is one array, and a block is an index into all of them (:class:`kvlab.textbook.pool.KVBlock` is just a
view). Each field has one name, used everywhere — here, in :meth:`BlockPool.snapshot`, in the views:

===============  =====  =====================================================================
field            type   meaning
===============  =====  =====================================================================
``status``       u8     :class:`~kvlab.core.block.BlockStatus`, written on every base block of a block
``size_class``   u8     buddy order k: the block spans ``2**k`` base blocks (every base block records it)
``refcount``     i32    holders of the block (sequences, forks, the prefix cache's hits)
``tokens``       i32    filled token slots
``last_access``  i64    clock step of the last allocation, reference or touch (LRU's key)
``created``      i64    clock step of the allocation (FIFO's key)
``hits``         i64    allocations + references + touches (LFU's key)
``owner``        i32    who holds it (a sequence id; -1 = no one); shown by the views
``reusable``     u8     1 if the data is worth keeping at refcount 0 (the block is then *cached*)
===============  =====  =====================================================================

Every field is kept twice over the same memory: an ``array.array`` (``meta.refcount[b]``, fast for one block
from Python) and a numpy view of it (``meta.np.refcount``, for whole-pool reads and vectorised batch writes).
:meth:`BlockMeta.stamp` and :meth:`BlockMeta.reset` are the only code that writes a block's fields when it is
allocated or freed; they take one id, a slice or an index array.
"""
from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvlab.core.block import FREE

FIELDS: dict[str, str] = {"status": "B", "size_class": "B", "refcount": "i", "tokens": "i", "last_access": "q",
                          "created": "q", "hits": "q", "owner": "i", "reusable": "B"}
_NP = {"B": np.uint8, "i": np.int32, "q": np.int64}
NO_OWNER = -1

Index = int | slice | np.ndarray


class BlockMeta:
    """The metadata arrays of ``num_blocks`` base blocks, all zero (FREE), owners -1."""

    status: array
    size_class: array
    refcount: array
    tokens: array
    last_access: array
    created: array
    hits: array
    owner: array
    reusable: array

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.np = SimpleNamespace()  # writable numpy views, same names
        for name, code in FIELDS.items():
            buf = array(code, bytes(num_blocks * array(code).itemsize))
            setattr(self, name, buf)
            setattr(self.np, name, np.frombuffer(buf, dtype=_NP[code]))
        self.np.owner[:] = NO_OWNER

    def readonly(self) -> SimpleNamespace:
        """Read-only numpy views of every field (what other modules may look at)."""
        out = SimpleNamespace()
        for name in FIELDS:
            v = getattr(self.np, name).view()
            v.flags.writeable = False
            setattr(out, name, v)
        return out

    def span(self, b: int) -> int:
        """Base blocks in block ``b``."""
        return 1 << self.size_class[b]

    def set_status(self, b: int, status: int) -> None:
        """Status of block ``b`` (on each of its base blocks)."""
        k = self.size_class[b]
        if k:
            self.np.status[b:b + (1 << k)] = status
        else:
            self.status[b] = status

    def stamp(self, ix: Index, t: int, owner: int, status: int) -> None:
        """Blocks ``ix`` were just allocated at step ``t``: refcount 1, one hit, created and accessed now.
        Base blocks only when ``ix`` is not a single id (size-class blocks are stamped one at a time)."""
        f: Any = self
        if type(ix) is int:
            self.set_status(ix, status)
        else:
            f = self.np
            f.status[ix] = status
        f.refcount[ix] = f.hits[ix] = 1
        f.last_access[ix] = f.created[ix] = t
        f.owner[ix] = owner

    def reset(self, ix: Index) -> None:
        """Blocks ``ix`` went FREE: no references, tokens, owner or reusable data. Their timestamps and hits
        stay (a FREE block's last access is when it was last used, which the views show)."""
        f: Any = self
        if type(ix) is int:
            self.set_status(ix, FREE)
        else:
            f = self.np
            f.status[ix] = FREE
        f.refcount[ix] = f.tokens[ix] = f.reusable[ix] = 0
        f.owner[ix] = NO_OWNER

    def copy(self, src: int, dst: int) -> None:
        """Move every field but the size class from block ``src`` to ``dst`` (migration)."""
        self.set_status(dst, self.status[src])
        for name in FIELDS:
            if name not in ("status", "size_class"):
                getattr(self, name)[dst] = getattr(self, name)[src]

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every field's numpy view."""
        return {name: getattr(self.np, name).copy() for name in FIELDS}
