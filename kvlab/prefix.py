"""Prefix caching by chained block hashes (text §2.2.6 "长序列处理优化": 智能缓存, caching frequent blocks).

A *full* block is named by a content hash chained through its parent: ``h_i = blake2b(h_{i-1}, salt, tokens of
block i)``, so equal hashes mean an equal *whole prefix*, not just an equal block, and a per-tenant salt keeps
tenants from ever sharing a block. A new prompt walks its full blocks hash by hash; each hit takes a reference
on the cached block (``pool.incref``, which also takes it out of the evictable set) instead of recomputing its
K/V, and the token ids are compared on every hit, so a hash collision can never serve wrong data.

Registered blocks are marked reusable: at refcount 0 they stay ALLOCATED with their data ("cached") until the
pool's policy evicts them. The cache keeps the chains whole:

* a block is registered only on top of its registered parent, so whoever holds a cached child holds its parent;
* ``pool.evict_guard`` vetoes a block while blocks are still registered on top of it, so chains lose their
  tails first and no cached child is ever orphaned (unreachable because its head is gone);
* ``pool.evict_hooks`` tells the cache whenever a block's data stops being kept (evicted, released, unmarked,
  swapped out), ``pool.relocation_hooks`` where blocks moved: every entry names live data, always.

Token ids travel as int64 bytes: a prompt is validated and converted once (numpy, no Python loop per token),
and each block's hash input and stored copy are slices of those bytes. Per registered block the cache keeps its
digest, its parent's digest and its tokens in lists indexed by block id (a few hundred bytes a block, so a pool
of millions of cached blocks fits). :meth:`PrefixCache.store_blocks` registers a whole chain in one call (one
``mark_reusable``), which is what :meth:`SequenceManager.cache_full_blocks` uses.

Counters (:meth:`PrefixCache.get_stats`) come in blocks and in tokens: ``query_tokens`` and ``hit_tokens`` are
vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits`` (prompt tokens looked up, prompt tokens served).
``reuse_gaps`` holds, for every hit that revived a cached block (refcount 0), the pool clock ticks the block had
been idle.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .block import BlockStatus
from .errors import ConfigError, IllegalTransitionError, KVDataError
from .events import Event
from .pool import BlockPool, is_int

TOKEN_MAX = 2**63 - 1  # token ids are hashed as int64
_NONE = object()  # "no bad token found" (None itself is a bad token)
ALLOCATED = int(BlockStatus.ALLOCATED)


def token_array(x: object, where: str) -> np.ndarray:
    """``x`` (a list, tuple, range or 1-D integer array/tensor of token ids in 0..2**63-1) as a 1-D int64 array,
    else :class:`KVDataError` naming the bad id, starting with ``where``. Strings, sets and dicts are refused:
    they iterate, but not as an ordered sequence of ids. No Python loop runs per token for a list of ints or an
    integer array (an int64 array comes back as it is, not copied)."""
    items: list | tuple | range
    if isinstance(x, (torch.Tensor, np.ndarray)):
        if x.ndim != 1:
            raise KVDataError(f"{where}: token ids must be 1-D, got shape {tuple(x.shape)}")
        a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) and x.dtype != torch.bool else x
        if isinstance(a, np.ndarray) and a.dtype.kind in "iu":
            if not a.size or (a.min() >= 0 and a.max() <= TOKEN_MAX):
                return a.astype(np.int64, copy=False)
        items = x.tolist()  # floats, bools, ids out of range: the loop below names the first bad one
    elif isinstance(x, (list, tuple, range)):
        items = x
    else:
        raise KVDataError(f"{where}: token ids are a list of ints, not {x!r}")
    if not items:
        return np.empty(0, dtype=np.int64)
    if set(map(type, items)) == {int}:  # the common case: exact ints, converted and range-checked in C
        try:
            a = np.array(items, dtype=np.int64)
        except OverflowError:  # some id is past int64: the loop below names it
            pass
        else:
            if a.min() >= 0:
                return a
    bad = next((t for t in items if not (is_int(t) and 0 <= t <= TOKEN_MAX)), _NONE)
    if bad is not _NONE:
        raise KVDataError(f"{where}: token ids are ints in 0..2**63-1, got {bad!r}")
    return np.array([int(t) for t in items], dtype=np.int64)  # numpy integers among them


def check_token_ids(x: object, where: str) -> list[int]:
    """:func:`token_array` as a list of ints (a copy), for the sequences that keep token ids as a list."""
    if type(x) is list and x and set(map(type, x)) == {int} and min(x) >= 0 and max(x) <= TOKEN_MAX:
        return list(x)  # the common case, checked in C without building an array
    return token_array(x, where).tolist()


def check_tenant(tenant: object) -> str | None:
    """A tenant is a str (its hash salt) or None."""
    if tenant is not None and not isinstance(tenant, str):
        raise ConfigError(f"tenant must be a str or None, got {tenant!r}")
    return tenant


def _check_parent(parent: object) -> bytes | None:
    """A parent is a block hash (bytes) or None; a str would not even hash."""
    if parent is not None and not isinstance(parent, bytes):
        raise ConfigError(f"parent must be a block hash (bytes) or None, got {parent!r}")
    return parent


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
    """Block ``block_id`` (hash ``digest``) left the cache: its data was evicted, released, unmarked or moved out."""
    block_id: int
    digest: str


@lru_cache(maxsize=1024)
def _salt(tenant: str | None) -> bytes:
    """A tenant's 16-byte hash salt (empty without a tenant), computed once per tenant."""
    return hashlib.blake2b(tenant.encode(), digest_size=16).digest() if tenant is not None else b""


def _hash(parent: bytes | None, chunk: bytes, salt: bytes) -> bytes:
    """The chained hash of one block: ``chunk`` is its token ids as int64 bytes (the lookups' inner loop)."""
    h = hashlib.blake2b(parent or b"", digest_size=16, salt=salt)
    h.update(chunk)
    return h.digest()


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
        self._children: dict[bytes, int] = {}  # digest -> blocks registered on top of it
        self.requests = self.queries = self.hits = self.stores = self.evictions = 0
        self.query_tokens = self.hit_tokens = 0
        self.reuse_gaps = array("q")  # per revived hit block: clock ticks it was idle (cached) before the hit
        pool.evict_hooks.append(self._on_evict)
        pool.relocation_hooks.append(self._on_relocate)
        prev = pool.evict_guard
        pool.evict_guard = self._may_evict if prev is None else (lambda b: self._may_evict(b) and prev(b))

    def __len__(self) -> int:
        return len(self._block)

    @staticmethod
    def block_hash(parent: bytes | None, token_ids: Sequence[int], tenant: str | None = None) -> bytes:
        """16-byte blake2b of the parent hash and the block's token ids (int64), salted per tenant."""
        return _hash(_check_parent(parent), token_array(token_ids, "block_hash").tobytes(),
                     _salt(check_tenant(tenant)))

    def holds(self, block_id: int) -> bool:
        """True if ``block_id`` is registered."""
        return self._digest[self.pool.check_id(block_id)] is not None  # check_id: a float must not find its int

    def entries(self) -> dict[int, tuple[bytes, bytes | None, tuple[int, ...]]]:
        """Every registered block: ``{block: (digest, parent digest, token ids)}``, in block order."""
        return {b: (d, self._parent[b], tuple(np.frombuffer(self._tokens[b] or b"", dtype=np.int64).tolist()))
                for b, d in enumerate(self._digest) if d is not None}

    # ------------------------------------------------------------------ lookup
    def match(self, token_ids: Sequence[int], tenant: str | None = None,
              max_blocks: int | None = None) -> tuple[list[int], bytes | None]:
        """The cached blocks of the longest cached prefix of ``token_ids`` (at most ``max_blocks`` full blocks),
        each with one new reference taken for the caller; and the hash of the last one (None if no hit)."""
        tokens, salt, n = self._query(token_ids, tenant, max_blocks)
        ids, parent = self._walk(tokens, salt, n)
        self.requests += 1
        self.queries += n
        self.query_tokens += len(tokens)
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

    def peek(self, token_ids: Sequence[int], tenant: str | None = None, max_blocks: int | None = None) -> list[int]:
        """The blocks :meth:`match` would return now, without taking references or counting a lookup (admission
        control asks what a prompt would cost before committing to it)."""
        return self._walk(*self._query(token_ids, tenant, max_blocks))[0]

    def _query(self, token_ids: Sequence[int], tenant: str | None,
               max_blocks: int | None) -> tuple[np.ndarray, bytes, int]:
        """The validated arguments of :meth:`match`/:meth:`peek` (tokens, salt, full blocks to look up): all of
        them before any lookup is counted."""
        tokens = token_array(token_ids, "prefix lookup")
        salt = _salt(check_tenant(tenant))
        if max_blocks is not None and not (is_int(max_blocks) and max_blocks >= 0):
            raise ConfigError(f"max_blocks must be an int >= 0 or None, got {max_blocks!r}")
        full = len(tokens) // self.block_size
        return tokens, salt, full if max_blocks is None else min(int(max_blocks), full)

    def _walk(self, tokens: np.ndarray, salt: bytes, n: int) -> tuple[list[int], bytes | None]:
        """Follow the hash chain of the first ``n`` full blocks of validated ``tokens``: (hit blocks, last hit's
        hash)."""
        width = self.block_size * 8
        data = tokens[:n * self.block_size].tobytes()
        ids: list[int] = []
        parent = None
        for at in range(0, n * width, width):
            chunk = data[at:at + width]
            digest = _hash(parent, chunk, salt)
            b = self._block.get(digest)
            if b is None or self._tokens[b] != chunk:  # a miss, or a hash collision: never serve another prefix
                break
            ids.append(b)
            parent = digest
        return ids, parent

    # ------------------------------------------------------------------ registration
    def store(self, block_id: int, token_ids: Sequence[int], parent: bytes | None,
              tenant: str | None = None) -> bytes | None:
        """Register full, referenced block ``block_id`` holding ``token_ids`` under parent hash ``parent``; marks
        it reusable. Returns its hash, or None when another live block already caches this exact prefix."""
        got = self.store_blocks([self.pool.check_id(block_id)], token_ids, parent, tenant)
        return got[0] if got else None

    def store_blocks(self, block_ids: Sequence[int], token_ids: Sequence[int], parent: bytes | None = None,
                     tenant: str | None = None) -> list[bytes]:
        """Register a chain of full, referenced blocks: ``block_ids[i]`` holds ``token_ids[i*B:(i+1)*B]``, the
        first is chained on ``parent``, each next one on the one before; all are marked reusable in one call.
        Returns the hashes of the blocks registered, in order: fewer than ``block_ids`` when another live block
        already caches one of these prefixes (registration stops there). A block already registered under the
        same hash counts as registered. Everything is checked before anything changes."""
        pool, B = self.pool, self.block_size
        blocks = pool.check_ids(block_ids)
        tokens = token_array(token_ids, f"blocks {blocks[:4]}{'...' if len(blocks) > 4 else ''}")
        parent, salt = _check_parent(parent), _salt(check_tenant(tenant))
        status, refs = pool.fields.status, pool.fields.refcount
        for b in blocks:
            if status[b] != ALLOCATED or not refs[b]:
                raise IllegalTransitionError(f"block {b} is {BlockStatus(status[b]).name} with refcount {refs[b]}: "
                                             f"only a held block can be registered")
        if len(tokens) != B * len(blocks):
            raise KVDataError(f"blocks {blocks}: only full blocks of {B} tokens are cached; {len(blocks)} blocks "
                              f"hold {B * len(blocks)} token ids, got {len(tokens)}: {tokens.tolist()[:2 * B]}")
        if parent is not None and parent not in self._block:
            raise IllegalTransitionError(f"block {blocks[0]}: its parent hash {parent.hex()} is not cached")
        # Plan: every hash, before anything changes.
        width, data = B * 8, tokens.tobytes()
        digests: list[bytes] = []
        new: list[tuple[int, bytes, bytes | None, bytes]] = []
        planned: set[int] = set()
        for i, b in enumerate(blocks):
            chunk = data[i * width:(i + 1) * width]
            digest = _hash(parent, chunk, salt)
            other = self._block.get(digest)
            if other is None:
                if self._digest[b] is not None or b in planned:
                    known = self._digest[b] or next(d for x, d, _, _ in new if x == b)
                    raise IllegalTransitionError(f"block {b} is already cached under hash {known.hex()}")
                new.append((b, digest, parent, chunk))
                planned.add(b)
            elif other != b:  # another live block caches this exact prefix
                break
            digests.append(digest)
            parent = digest
        # Apply.
        if new:
            pool.mark_reusable([b for b, _, _, _ in new])
        kids = self._children
        for b, digest, up, chunk in new:
            self._digest[b], self._parent[b], self._tokens[b] = digest, up, chunk
            self._block[digest] = b
            if up is not None:
                kids[up] = kids.get(up, 0) + 1
        self.stores += len(new)
        if pool.events:
            for b, digest, _, _ in new:
                pool.events.publish(PrefixStored(pool.clock.now(), b, digest.hex()))
        return digests

    # ------------------------------------------------------------------ pool hooks
    def _drop(self, b: int) -> None:
        digest, parent = self._digest[b], self._parent[b]
        assert digest is not None
        self._digest[b] = self._parent[b] = self._tokens[b] = None
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

    def _may_evict(self, b: int) -> bool:
        """Veto evicting a registered block while blocks are registered on top of it (tails go before heads)."""
        digest = self._digest[b]
        return digest is None or digest not in self._children

    def _on_evict(self, b: int) -> None:
        if self._digest[b] is not None:
            self._drop(b)

    def _on_relocate(self, src: np.ndarray, dst: np.ndarray) -> None:
        for a, b in zip(src.tolist(), dst.tolist()):
            digest = self._digest[a]
            if digest is None:
                continue
            self._digest[b], self._parent[b], self._tokens[b] = digest, self._parent[a], self._tokens[a]
            self._digest[a] = self._parent[a] = self._tokens[a] = None
            self._block[digest] = b

    # ------------------------------------------------------------------ reporting
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
        """Raise AssertionError if an entry names a block that is not ALLOCATED and reusable, the hash index and
        the entries disagree, a registered block's parent is counted wrongly, or a stored copy is not a block."""
        reg = {d: b for b, d in enumerate(self._digest) if d is not None}
        assert reg == self._block, "the hash index and the block entries disagree"
        f = self.pool.fields
        for b in reg.values():
            assert f.status[b] == ALLOCATED and f.reusable[b], f"block {b} is registered but keeps no data"
            assert len(self._tokens[b] or b"") == 8 * self.block_size, f"block {b}: stored tokens are not a block"
        kids: dict[bytes, int] = {}
        for b in reg.values():
            up = self._parent[b]
            if up is not None:
                kids[up] = kids.get(up, 0) + 1
        assert kids == self._children, "children counts disagree with the registered parents"
