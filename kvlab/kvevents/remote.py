"""A server's prefix cache as a router sees it: rebuilt from its KV events alone.

The idea: a ``BlockStored`` names each new block by its hash, its parent's hash and its tokens, so the events
rebuild the tree of cached prefixes; a ``BlockRemoved`` takes a block out, ``AllBlocksCleared`` empties it. kvlab
cannot recompute the server's hashes (vLLM hashes with its own function and seed, and extra keys), so a prompt is
matched the way the tree is built: from the root, each next full block of the prompt's tokens must be a stored
child, by its token ids, of the block before (:meth:`RemoteCache.hit_path`). A block whose parent was never seen
(the stream was joined late, or a gap lost its store) is kept but no prompt reaches it.

Blocks live per tier, ``(medium, group_idx)``: the same hash can be on the GPU and offloaded to the CPU, and a
hybrid model has one KV group per kind of layer. What events never say (physical block ids, the free list,
refcounts, blocks still filling, owners) this model does not know either.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvlab.core.checks import check_positive, token_list
from kvlab.kvevents.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

Tier = tuple[str | None, int | None]  # (medium, group_idx)


@dataclass(slots=True)
class RemoteBlock:
    """One cached block as the events describe it."""
    block_hash: BlockHash
    parent: BlockHash | None
    tokens: tuple[int, ...]
    medium: str | None
    group: int | None


class RemoteCache:
    """The cached blocks a stream of KV events describes; feed it with :meth:`apply` (events in order)."""

    def __init__(self) -> None:
        self.blocks: dict[Tier, dict[BlockHash, RemoteBlock]] = {}
        # tier -> parent hash (None: the root) -> the tokens of a child block -> its hash
        self._children: dict[Tier, dict[BlockHash | None, dict[tuple[int, ...], BlockHash]]] = {}
        self.stored = self.removed = self.cleared = 0  # blocks stored and removed, clears
        self.unknown_removed = 0  # removals of a hash never stored (the stream was joined late, or lost a batch)
        self.mismatched = 0  # BlockStored events whose token count is not one block_size per hash
        self.block_size: int | None = None  # the last one the events gave

    def __len__(self) -> int:
        return sum(len(b) for b in self.blocks.values())

    def apply(self, events: Iterable[KVEvent]) -> None:
        """Take ``events`` in order into the model."""
        for e in events:
            if isinstance(e, BlockStored):
                self._store(e)
            elif isinstance(e, BlockRemoved):
                self._remove(e)
            elif isinstance(e, AllBlocksCleared):
                self.clear()
                self.cleared += 1

    def clear(self) -> None:
        """Forget every block (an ``AllBlocksCleared``, or a publisher that restarted)."""
        self.blocks.clear()
        self._children.clear()

    def _store(self, e: BlockStored) -> None:
        tier = (e.medium, e.group_idx)
        blocks, kids = self.blocks.setdefault(tier, {}), self._children.setdefault(tier, {})
        size = e.block_size
        if size < 1 or len(e.token_ids) != size * len(e.block_hashes):
            self.mismatched += 1
        if size >= 1:
            self.block_size = size
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            tokens = tuple(e.token_ids[i * size:(i + 1) * size]) if size >= 1 else ()
            old = blocks.get(h)
            if old is not None:  # stored again: re-link it where the event says
                self._unlink(tier, old)
            blocks[h] = RemoteBlock(h, parent, tokens, e.medium, e.group_idx)
            kids.setdefault(parent, {})[tokens] = h
            parent = h
        self.stored += len(e.block_hashes)

    def _remove(self, e: BlockRemoved) -> None:
        tier = (e.medium, e.group_idx)
        blocks = self.blocks.get(tier, {})
        for h in e.block_hashes:
            block = blocks.pop(h, None)
            if block is None:
                self.unknown_removed += 1
                continue
            self._unlink(tier, block)
            self.removed += 1

    def _unlink(self, tier: Tier, block: RemoteBlock) -> None:
        siblings = self._children[tier].get(block.parent)
        if siblings is not None and siblings.get(block.tokens) == block.block_hash:
            del siblings[block.tokens]
            if not siblings:
                del self._children[tier][block.parent]

    def tiers(self) -> list[Tier]:
        """The ``(medium, group_idx)`` pairs that hold blocks now."""
        return [t for t, b in self.blocks.items() if b]

    def hit_path(self, token_ids: Sequence[int], block_size: int | None = None, *, tier: Tier) -> list[BlockHash]:
        """The hashes of the leading full blocks of ``token_ids`` that ``tier`` holds, root first, walking the tree
        of stored blocks by their tokens. ``block_size`` defaults to the one the events gave; with none known, []."""
        return self._walk(token_list(token_ids, "hit_path"), self._size(block_size), tier)

    def hit_blocks(self, token_ids: Sequence[int], block_size: int | None = None, *, medium: str | None = None,
                   group: int | None = None) -> int:
        """How many leading full blocks of ``token_ids`` the server holds (:meth:`hit_path`): the best tier among
        those matching ``medium`` and ``group`` (None: any). With no block size known, 0."""
        tokens, size = token_list(token_ids, "hit_blocks"), self._size(block_size)
        return max((len(self._walk(tokens, size, (m, g))) for m, g in self._children
                    if (medium is None or m == medium) and (group is None or g == group)), default=0)

    def _size(self, block_size: int | None) -> int | None:
        return self.block_size if block_size is None else check_positive(block_size, "block_size")

    def _walk(self, tokens: list[int], size: int | None, tier: Tier) -> list[BlockHash]:
        kids = self._children.get(tier, {})
        path: list[BlockHash] = []
        if size is None:
            return path
        for at in range(0, len(tokens) - size + 1, size):
            child = kids.get(path[-1] if path else None, {}).get(tuple(tokens[at:at + size]))
            if child is None:
                break
            path.append(child)
        return path

    def chain(self, block_hash: BlockHash, tier: Tier) -> list[RemoteBlock]:
        """``block_hash``'s blocks from the root down to it, as far up as its ancestors are known."""
        blocks, out = self.blocks.get(tier, {}), list[RemoteBlock]()
        at: BlockHash | None = block_hash
        while at is not None and (b := blocks.get(at)) is not None and len(out) <= len(blocks):
            out.append(b)
            at = b.parent
        return out[::-1]

    def counts(self) -> dict[str, int]:
        """Blocks held now, and blocks stored, removed, removed unknown, mismatched, and clears so far."""
        return {"blocks": len(self), "stored": self.stored, "removed": self.removed,
                "unknown_removed": self.unknown_removed, "mismatched": self.mismatched, "cleared": self.cleared}


__all__ = ["RemoteBlock", "RemoteCache", "Tier"]
