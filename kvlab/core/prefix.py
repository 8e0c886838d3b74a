"""Prefix caching by chained block hashes (text §2.2.6 "长序列处理优化": 智能缓存, caching frequent blocks).

The idea: a *full* block is named by a hash chained through its parent, ``h_i = blake2b(h_{i-1}, salt, tokens of
block i)``, so equal hashes mean an equal *whole prefix*; a per-tenant salt keeps tenants from sharing a block.
A new prompt walks its full blocks hash by hash (:meth:`PrefixCache.match`); each hit takes a reference on the
cached block (``pool.incref``) instead of recomputing its K/V, and the token ids are compared on every hit, so a
hash collision never serves wrong data. Registered blocks (:meth:`PrefixCache.store_blocks`) are marked
reusable: at refcount 0 they stay ALLOCATED with their data ("cached") until the pool's policy evicts them.

Invariants (:meth:`PrefixCache.check_invariants`), which keep the chains whole:

* a block is registered only on top of its registered parent, so whoever holds a cached child holds its parent;
* a block is never evicted while blocks are registered on top of it (:class:`ChainGuard`, the pool's
  ``evict_guard``), so chains lose their tails first and no cached child is orphaned; the guard also tells the
  pool which cached blocks would go, so an allocation the chains cannot serve is refused before any eviction;
* an entry is trusted only while its block is the same allocation (ALLOCATED, reusable, same creation stamp);
  anything else is a stale entry, dropped on sight. The pool's hooks say which blocks left or moved.

Token ids travel as int64 bytes, validated and converted once per prompt; per registered block the cache keeps its
digest, its parent's digest, its tokens and its creation stamp. Counters (:meth:`PrefixCache.get_stats`):
``query_tokens`` and ``hit_tokens`` are vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``; ``reuse_gaps``
holds, for every hit that revived a cached block, the clock ticks it had been idle.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvlab.core.block import ALLOCATED, BlockStatus
from kvlab.core.errors import ConfigError, IllegalTransitionError, KVDataError
from kvlab.core.events import Event
from kvlab.core.checks import TokenBytes, check_list, check_positive, check_tenant, is_int, token_bytes
from kvlab.core.eviction import FutureUses
from kvlab.core.pool import BlockPool
from kvlab.core.interrupts import atomic

TokenIds = Sequence[int] | np.ndarray | torch.Tensor | TokenBytes


def _check_parent(parent: object) -> bytes | None:
    """A parent is a block hash (bytes) or None; a str would not even hash."""
    if parent is not None and not isinstance(parent, bytes):
        raise ConfigError(f"parent must be a block hash (bytes) or None, got {parent!r}")
    return parent


@atomic()
class PrefixCache:
    """Hash chains of full blocks over ``pool``. Hooks itself into the pool's eviction and migration."""


    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a PrefixCache needs a BlockPool, got {pool!r}")
        self.pool, self.block_size = pool, pool.block_size
        n = pool.num_blocks
        self._block: dict[bytes, int] = {}  # digest -> the block caching that prefix
        self._digest: list[bytes | None] = [None] * n  # block -> its digest (None: not registered)
        self._parent: list[bytes | None] = [None] * n  # block -> its parent's digest (None: a prompt's first block)
        self._tokens: list[bytes | None] = [None] * n  # block -> its token ids as int64 bytes, compared on hits
        self._created = array("q", bytes(8 * n))  # block -> the pool's allocation stamp when it was registered
        self._suspects: set[int] = set()  # registered blocks that may be stale (the pool's stale_hooks said so)
        f = pool.fields
        self._status, self._reusable, self._stamp = f.status, f.reusable, f.created  # what _valid reads
        self._refs = f.refcount
        self._children: dict[bytes, int] = {}  # digest -> blocks registered on top of it
        self.requests = self.queries = self.hits = self.stores = self.evictions = 0
        self.query_tokens = self.hit_tokens = 0
        self.reuse_gaps = array("q")  # per revived hit block: clock ticks it was idle (cached) before the hit
        pool.evict_hooks.append(self._on_evict)
        pool.relocation_hooks.append(self._on_relocate)
        pool.stale_hooks.append(self._on_stale)
        pool.evict_guard = ChainGuard(self, self._digest, self._parent, self._block, self._children,
                                      pool.evict_guard)

    def match(self, token_ids: TokenIds, tenant: str | None = None,
              max_blocks: int | None = None) -> tuple[list[int], bytes | None]:
        """The cached blocks of the longest cached prefix of ``token_ids`` (at most ``max_blocks`` full blocks),
        each with one new reference taken for the caller; and the hash of the last one (None if no hit)."""
        tokens, salted, n = self._query(token_ids, tenant, max_blocks)
        ids, parent = self._walk(tokens, salted, n)
        self.requests += 1
        self.queries += n
        self.query_tokens += len(tokens) // 8
        if ids:
            pool = self.pool
            now, refs, last = pool.clock.now(), pool.fields.refcount, pool.fields.last_access
            self.reuse_gaps.extend([now - last[b] for b in ids if not refs[b]])
            pool.incref(ids)
            self.hits += len(ids)
            self.hit_tokens += len(ids) * self.block_size
            if pool.events:
                pool.events.publish(PrefixHit(pool.clock.now(), tuple(ids), len(ids) * self.block_size, tenant))
        return ids, parent

    def peek(self, token_ids: TokenIds, tenant: str | None = None, max_blocks: int | None = None) -> list[int]:
        """The blocks :meth:`match` would return now, without taking references or counting a lookup (admission
        control asks what a prompt would cost before committing to it)."""
        return self._walk(*self._query(token_ids, tenant, max_blocks))[0]

    def store(self, block_id: int, token_ids: TokenIds, parent: bytes | None,
              tenant: str | None = None) -> bytes | None:
        """Register full, referenced block ``block_id`` holding ``token_ids`` under parent hash ``parent``; marks
        it reusable. Returns its hash, or None when another live block already caches this exact prefix."""
        got = self.store_blocks([self.pool.check_id(block_id)], token_ids, parent, tenant)
        return got[0] if got else None

    def store_blocks(self, block_ids: Sequence[int], token_ids: TokenIds, parent: bytes | None = None,
                     tenant: str | None = None) -> list[bytes]:
        """Register a chain of full, referenced blocks: ``block_ids[i]`` holds ``token_ids[i*B:(i+1)*B]``, the
        first is chained on ``parent``, each next one on the one before; all are marked reusable in one call.
        Returns the hashes of the blocks registered, in order: fewer than ``block_ids`` when another live block
        already caches one of these prefixes (registration stops there). A block already registered under the
        same hash counts as registered. Everything is checked before anything changes."""
        pool, B = self.pool, self.block_size
        blocks = pool.check_ids(block_ids)
        tokens = token_bytes(token_ids, "prefix store")
        parent, salted = _check_parent(parent), _salted(check_tenant(tenant))
        status, refs = self._status, self._refs
        for b in blocks:
            if status[b] != ALLOCATED or not refs[b]:
                raise IllegalTransitionError(f"block {b} is {BlockStatus(status[b]).name} with refcount {refs[b]}: "
                                             f"only a held block can be registered")
        if len(tokens) != 8 * B * len(blocks):
            raise KVDataError(f"blocks {blocks}: only full blocks of {B} tokens are cached; {len(blocks)} blocks "
                              f"hold {B * len(blocks)} token ids, got {len(tokens) // 8}: "
                              f"{array('q', tokens[:16 * B]).tolist()}")
        if parent is not None and parent not in self._block:
            raise IllegalTransitionError(f"block {blocks[0]}: its parent hash {parent.hex()} is not cached")
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):
            twice = next(b for i, b in enumerate(blocks) if b in blocks[:i])
            raise IllegalTransitionError(f"block {twice} appears twice in one chain")
        # Plan: every hash, before anything changes; a block not yet registered is new, stale entries in the
        # way are dropped when applying.
        width, first = B * 8, parent
        digests: list[bytes] = []
        new: list[int] = []
        stale: list[int] = []
        for at, b in zip(range(0, len(tokens), width), blocks):
            digest = _hash(parent, tokens[at:at + width], salted)
            other = self._block.get(digest)
            if other is not None and other != b and not self._valid(other):
                stale.append(other)
                other = None
            if other is None:
                known = self._digest[b]
                if known is not None and self._valid(b):
                    raise IllegalTransitionError(f"block {b} is already cached under hash {known.hex()}")
                if known is not None:
                    stale.append(b)
                new.append(len(digests))
            elif other != b:  # another live block caches this exact prefix
                break
            digests.append(digest)
            parent = digest
        # Apply.
        for b in dict.fromkeys(stale) if stale else ():
            self._drop(b)
        if new:
            pool.mark_reusable(blocks if len(new) == len(blocks) else [blocks[i] for i in new])
        kids, created = self._children, self._stamp
        for i in new:
            b, digest, up = blocks[i], digests[i], digests[i - 1] if i else first
            self._digest[b], self._parent[b], self._tokens[b] = digest, up, tokens[i * width:(i + 1) * width]
            self._created[b] = created[b]
            self._block[digest] = b
            if up is not None:
                kids[up] = kids.get(up, 0) + 1
        self.stores += len(new)
        if pool.events:
            for i in new:
                pool.events.publish(PrefixStored(pool.clock.now(), blocks[i], digests[i].hex()))
        return digests

    def __len__(self) -> int:
        return len(self._block)

    @staticmethod
    def block_hash(parent: bytes | None, token_ids: TokenIds, tenant: str | None = None) -> bytes:
        """16-byte blake2b of the parent hash and the block's token ids (int64), salted per tenant."""
        return _hash(_check_parent(parent), token_bytes(token_ids, "block_hash"), _salted(check_tenant(tenant)))

    @staticmethod
    def future_uses(prompts: Sequence[Sequence[int]], block_size: int,
                    tenants: Sequence[str | None] | None = None) -> FutureUses:
        """The uses this cache will look up, the oracle of Belady's :class:`~kvlab.core.eviction.OPTPolicy`: for each
        prompt, the chained hashes (:meth:`block_hash`, salted by its tenant) of its first
        ``(len - 1) // block_size`` full blocks, as a sequence looks its prompt up (the last token is always
        computed)."""
        check_positive(block_size, "block_size")
        check_list(prompts, "prompts must be a list of token id lists")
        if tenants is not None:
            check_list(tenants, "tenants must be a list of tenants, one per prompt, or None")
            if len(tenants) != len(prompts):
                raise ConfigError(f"{len(tenants)} tenants for {len(prompts)} prompts: give one per prompt, or None")
        keys = []
        for i, tokens in enumerate(prompts):
            token_bytes(tokens, f"future_uses: prompt {i}")  # all of it, not only the blocks hashed
            tenant = None if tenants is None else check_tenant(tenants[i])
            chain, parent = [], None
            for j in range(max(0, (len(tokens) - 1) // block_size)):
                parent = PrefixCache.block_hash(parent, tokens[j * block_size:(j + 1) * block_size], tenant)
                chain.append(parent)
            keys.append(chain)
        return FutureUses(keys)

    def holds(self, block_id: int) -> bool:
        """True if ``block_id`` is registered (and still the registered allocation)."""
        b = self.pool.check_id(block_id)  # a float would find the entry of its int
        return self._digest[b] is not None and self._valid(b)

    def digest_of(self, block_id: int) -> bytes | None:
        """The hash ``block_id`` is registered under, or None if it is not (or no longer) registered."""
        b = self.pool.check_id(block_id)
        return self._digest[b] if self._digest[b] is not None and self._valid(b) else None

    def cached_block(self, digest: bytes, token_ids: TokenIds) -> int | None:
        """The live block registered under ``digest`` (a :meth:`block_hash`) holding exactly ``token_ids``, or
        None (nothing registered there, or a hash collision)."""
        if not isinstance(digest, bytes):
            raise ConfigError(f"a block hash is bytes, got {digest!r}")
        tokens = token_bytes(token_ids, "cached_block")
        b = self._block.get(digest)
        return b if b is not None and self._valid(b) and self._tokens[b] == tokens else None

    def held_back(self, min_order: int = 0, kept: Sequence[int] = ()) -> set[int]:
        """The cached blocks (of class >= ``min_order``) that evicting other such blocks never frees: each one
        with an entry above it that no such eviction removes, plus ``kept`` (block ids another guard keeps) and
        the cached blocks below those. Only the entries the pool said may be stale are looked at (its
        ``stale_hooks``), then each stuck chain is walked down: a referenced block's chain below it is
        referenced too."""
        pool = self.pool
        if not is_int(min_order) or not 0 <= min_order <= pool.max_order:
            raise ConfigError(f"min_order must be a size class of this pool, 0..{pool.max_order}, got {min_order!r}")
        kept = pool.check_ids(kept)
        size = pool.fields.size_class

        def candidate(b: int) -> bool:
            return self._status[b] == ALLOCATED and not self._refs[b] and size[b] >= min_order

        # Stale entries whose blocks are no candidates (evicting a candidate would drop its entry).
        stuck = [b for b in self._suspects if not self._valid(b) and not candidate(b)]
        if min_order:  # a cached block of a smaller class is no candidate: it stays, and so does its chain
            a = pool.arrays
            small = np.flatnonzero((a.status == ALLOCATED) & (a.refcount == 0) & (a.size_class < min_order))
            stuck += [b for b in small.tolist() if self._digest[b] is not None]
        out = set(kept)
        for b in [*stuck, *kept]:
            while (up := self._parent[b]) is not None and (b := self._block.get(up, -1)) >= 0 and candidate(b):
                if b in out:
                    break
                out.add(b)
        return out

    def _valid(self, b: int) -> bool:
        return self._status[b] == ALLOCATED and self._reusable[b] == 1 and self._stamp[b] == self._created[b]

    def entries(self) -> dict[int, tuple[bytes, bytes | None, tuple[int, ...]]]:
        """Every registered block: ``{block: (digest, parent digest, token ids)}``, in block order."""
        return {b: (d, self._parent[b], tuple(np.frombuffer(self._tokens[b] or b"", dtype=np.int64).tolist()))
                for b, d in enumerate(self._digest) if d is not None}

    def entry(self, block_id: int) -> tuple[bytes, bytes | None, tuple[int, ...]] | None:
        """``block_id``'s entry as :meth:`entries` gives it, ``(digest, parent digest, token ids)``, or None if it
        is not (or no longer) registered: one block's, for an observer of :class:`PrefixStored` events."""
        b = self.pool.check_id(block_id)
        digest = self._digest[b]
        if digest is None or not self._valid(b):
            return None
        return digest, self._parent[b], tuple(array("q", self._tokens[b] or b"").tolist())

    def _query(self, token_ids: TokenIds, tenant: str | None,
               max_blocks: int | None) -> tuple[bytes, hashlib.blake2b, int]:
        """The validated arguments of :meth:`match`/:meth:`peek` (tokens, the tenant's hasher, full blocks to
        look up): all of them before any lookup is counted."""
        tokens = token_bytes(token_ids, "prefix lookup")
        salted = _salted(check_tenant(tenant))
        if max_blocks is not None and not (is_int(max_blocks) and max_blocks >= 0):
            raise ConfigError(f"max_blocks must be an int >= 0 or None, got {max_blocks!r}")
        full = len(tokens) // (8 * self.block_size)
        return tokens, salted, full if max_blocks is None else min(int(max_blocks), full)

    def _walk(self, tokens: bytes, salted: hashlib.blake2b, n: int) -> tuple[list[int], bytes | None]:
        """Follow the hash chain of the first ``n`` full blocks of validated ``tokens``: (hit blocks, last hit's
        hash)."""
        width = self.block_size * 8
        ids: list[int] = []
        parent = None
        for at in range(0, n * width, width):
            chunk = tokens[at:at + width]
            digest = _hash(parent, chunk, salted)
            b = self._block.get(digest)
            if b is None:
                break
            if not self._valid(b):
                self._drop(b)
                break
            if self._tokens[b] != chunk:  # a hash collision: never serve another prefix's K/V
                break
            ids.append(b)
            parent = digest
        return ids, parent

    def _drop(self, b: int) -> None:
        digest, parent = self._digest[b], self._parent[b]
        assert digest is not None
        self._digest[b] = self._parent[b] = self._tokens[b] = None
        self._suspects.discard(b)
        if self._block.get(digest) == b:
            del self._block[digest]
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
        self.evictions += 1
        if self.pool.events:
            self.pool.events.publish(PrefixEvicted(self.pool.clock.now(), b, digest.hex()))

    def _on_evict(self, b: int) -> None:
        if self._digest[b] is not None:
            self._drop(b)

    def _on_stale(self, ids: list[int]) -> None:
        self._suspects.update(b for b in ids if self._digest[b] is not None)

    def _on_relocate(self, src: np.ndarray, dst: np.ndarray) -> None:
        for a, b in zip(src.tolist(), dst.tolist()):
            digest = self._digest[a]
            if digest is None:
                continue
            self._digest[b], self._parent[b], self._tokens[b] = digest, self._parent[a], self._tokens[a]
            self._created[b] = self._created[a]
            self._digest[a] = self._parent[a] = self._tokens[a] = None
            if a in self._suspects:
                self._suspects.remove(a)
                self._suspects.add(b)
            self._block[digest] = b

    def get_stats(self) -> dict[str, float]:
        """``requests`` (prompts looked up), ``queries`` (full blocks looked up), ``hits`` (blocks served),
        ``hit_rate`` (hits / queries), ``query_tokens`` and ``hit_tokens`` (prompt tokens looked up and served,
        as vLLM counts them), ``tokens_saved``, ``stores``, ``evictions`` and ``cached_blocks`` (registered now)."""
        return {"requests": self.requests, "queries": self.queries, "hits": self.hits,
                "hit_rate": self.hits / self.queries if self.queries else 0.0,
                "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
                "tokens_saved": self.hits * self.block_size, "stores": self.stores, "evictions": self.evictions,
                "cached_blocks": len(self._block)}

    def check_invariants(self) -> None:
        """Raise AssertionError if the hash index and the block entries disagree, a registered block's parent is
        counted wrongly, or a stored copy is not a block's worth of tokens. (Stale entries may exist: they are
        dropped on sight.)"""
        reg = {d: b for b, d in enumerate(self._digest) if d is not None}
        assert reg == self._block, "the hash index and the block entries disagree"
        stale = {b for b in reg.values() if not self._valid(b)}
        assert stale <= self._suspects <= set(reg.values()), f"unreported stale entries {stale - self._suspects}"
        for b in reg.values():
            assert len(self._tokens[b] or b"") == 8 * self.block_size, f"block {b}: stored tokens are not a block"
        kids: dict[bytes, int] = {}
        for b in reg.values():
            up = self._parent[b]
            if up is not None:
                kids[up] = kids.get(up, 0) + 1
        assert kids == self._children, "children counts disagree with the registered parents"


class ChainGuard:
    """The prefix cache's ``pool.evict_guard``: a registered block may be evicted only once no block is
    registered on top of it (chains lose their tails first), and only if the guard it wraps agrees.

    :meth:`held_back` answers the pool's capacity check: which cached blocks no eviction of other cached blocks
    will free. Evicting a tail frees its parent, so a cached block is held back only by an entry above it that
    no eviction removes (a stale entry whose block is not cached) or by a block the wrapped guard keeps."""

    def __init__(self, cache: "PrefixCache", digest: list[bytes | None], parent: list[bytes | None],
                 block: dict[bytes, int], children: dict[bytes, int], inner: Callable[[int], bool] | None) -> None:
        self.cache, self.inner = cache, inner
        # the cache's own, shared: asked once per candidate
        self._digest, self._parent, self._block, self._children = digest, parent, block, children

    def __call__(self, b: int) -> bool:
        digest = self._digest[b]
        return (digest is None or digest not in self._children) and (self.inner is None or self.inner(b))

    def lifted_by(self, b: int) -> int | None:
        """The block whose veto evicting ``b`` may lift: the one registered under ``b``'s parent hash, which
        may lose its last child (None for a chain's first block). The wrapped guard, if any, is taken to keep
        its verdicts."""
        parent = self._parent[b]
        return None if parent is None else self._block.get(parent)

    def held_back(self, min_order: int = 0) -> set[int]:
        """The cached blocks of class >= ``min_order`` that this guard keeps however many others are evicted."""
        inner, kept = self.inner, []
        if inner is not None:
            if (later := getattr(inner, "held_back", None)) is not None:
                kept = list(later(min_order))
            else:  # a plain guard keeps its verdicts: ask it about every candidate
                size = self.cache.pool.fields.size_class
                kept = [b for b, _ in self.cache.pool.policy.order() if size[b] >= min_order and not inner(b)]
        return self.cache.held_back(min_order, kept)


@dataclass(slots=True)
class PrefixHit(Event):
    """A prompt reused ``block_ids`` (``tokens`` tokens not recomputed)."""
    block_ids: tuple[int, ...]
    tokens: int
    tenant: str | None


@dataclass(slots=True)
class PrefixStored(Event):
    """Full block ``block_id`` was registered under hash ``digest`` (hex)."""
    block_id: int
    digest: str


@dataclass(slots=True)
class PrefixEvicted(Event):
    """Cached block ``block_id`` (hash ``digest``) left the cache: evicted by the pool, or found stale."""
    block_id: int
    digest: str


@lru_cache(maxsize=1024)
def _salted(tenant: str | None) -> hashlib.blake2b:
    """A tenant's empty hasher: 16-byte blake2b salted with the tenant's own 16-byte hash (no salt without a
    tenant). Made once per tenant; each block hash starts from a copy (cheaper than building one)."""
    salt = hashlib.blake2b(tenant.encode(), digest_size=16).digest() if tenant is not None else b""
    return hashlib.blake2b(digest_size=16, salt=salt)


def _hash(parent: bytes | None, chunk: bytes, salted: hashlib.blake2b) -> bytes:
    """The chained hash of one block: ``chunk`` is its token ids as int64 bytes (the lookups' inner loop)."""
    h = salted.copy()
    if parent:
        h.update(parent)
    h.update(chunk)
    return h.digest()
