"""Block states (text §2.2.2, "块结构设计"), declared once for all of kvlab.

State machine (enforced by :meth:`BlockStatus.check`; anything else raises :class:`IllegalTransitionError`)::

    FREE ──allocate──▶ ALLOCATED ──refcount→0, no reusable data──▶ FREE
      │                   │  ▲
      │ reserve           │  └─ refcount→0 with reusable data: stays ALLOCATED ("cached", evictable)
      ▼                   ▼
    PENDING ─commit─▶ ALLOCATED ─begin eviction / swap-out─▶ EVICTING ─done─▶ FREE
      └──abort──▶ FREE

PENDING is a block that is owned but whose data is still arriving (a swap-in, a prefill being written, a
pre-allocated reserve); EVICTING is a block whose data is leaving (eviction, swap-out). Neither may be chosen by
allocation, eviction or compaction.

The text's block object, ``KVBlock``, is :class:`kvlab.textbook.pool.KVBlock`: a view that reads the pool's arrays.
"""
from __future__ import annotations

from enum import IntEnum

from kvlab.core.errors import IllegalTransitionError


class BlockStatus(IntEnum):
    """One byte per block in the pool's ``status`` array."""

    FREE = 0
    PENDING = 1
    ALLOCATED = 2
    EVICTING = 3

    @staticmethod
    def check(block_id: int, old: "BlockStatus | int", new: "BlockStatus | int") -> None:
        """Raise :class:`IllegalTransitionError` unless ``old -> new`` is an edge of the state machine."""
        if new not in _ALLOWED[old]:
            raise IllegalTransitionError(
                f"block {block_id}: illegal transition {BlockStatus(old).name} -> {BlockStatus(new).name} "
                f"(allowed from {BlockStatus(old).name}: {', '.join(s.name for s in _ALLOWED[old]) or 'none'})")


_ALLOWED: dict[int, frozenset[BlockStatus]] = {
    BlockStatus.FREE: frozenset({BlockStatus.PENDING, BlockStatus.ALLOCATED}),
    BlockStatus.PENDING: frozenset({BlockStatus.ALLOCATED, BlockStatus.FREE}),
    BlockStatus.ALLOCATED: frozenset({BlockStatus.EVICTING, BlockStatus.FREE}),
    BlockStatus.EVICTING: frozenset({BlockStatus.FREE}),
}

# The states as plain ints, for the hot paths and numpy comparisons (an IntEnum member costs a lookup each time).
FREE, PENDING, ALLOCATED, EVICTING = (int(s) for s in BlockStatus)
STATE_NAMES = tuple(s.name for s in BlockStatus)
