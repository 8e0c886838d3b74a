"""Prefix caching by chained block hashes (text §2.2.6 "长序列处理优化": 智能缓存, cache frequently used blocks).

A *full* block is named by a content hash chained through its parent: ``h_i = blake2b(h_{i-1}, salt, tokens of
block i)``, so equal hashes mean an equal *whole prefix*, not just an equal block, and a per-tenant salt keeps
tenants from ever sharing a block. A new prompt walks its full blocks hash by hash; each hit takes a reference
on the cached block (``pool.incref``, which also takes it out of the evictable set) instead of recomputing its
K/V, and the token ids are compared on every hit, so a hash collision can never serve wrong data.

Registered blocks are marked reusable: at refcount 0 they stay ALLOCATED with their data ("cached") until the
pool's policy evicts them. The cache keeps the chains whole:

* a block is registered only on top of its registered parent, so whoever holds a cached child holds its parent;
* ``pool.evict_guard`` vetoes a block while one of its children is still cached, so chains lose their tails
  first and no cached child is ever orphaned (unreachable because its head is gone);
* ``pool.evict_hooks`` tells the cache which block left, ``pool.relocation_hooks`` where blocks moved;
* an entry is trusted only while its block is still the same allocation (ALLOCATED, reusable, same creation
  stamp); anything else is a stale entry and is dropped on sight.
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


def check_token_ids(x: object, where: str) -> list[int]:
    """``x`` (a list, tuple, range or 1-D integer array/tensor of token ids in 0..2**63-1) as a list of ints,
    else :class:`KVDataError` naming the bad id, starting with ``where``. Strings, sets and dicts are refused:
    they iterate, but not as an ordered sequence of ids."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        if x.ndim != 1:
            raise KVDataError(f"{where}: token ids must be 1-D, got shape {tuple(x.shape)}")
        x = x.tolist()
    elif not isinstance(x, (list, tuple, range)):
        raise KVDataError(f"{where}: token ids are a list of ints, not {x!r}")
    if all(type(t) is int for t in x) and (not x or 0 <= min(x) and max(x) <= TOKEN_MAX):
        return list(x)  # the common case, without a call per token
    bad = next((t for t in x if not (is_int(t) and 0 <= t <= TOKEN_MAX)), _NONE)
    if bad is not _NONE:
        raise KVDataError(f"{where}: token ids are ints in 0..2**63-1, got {bad!r}")
    return [int(t) for t in x]


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
    """Cached block ``block_id`` (hash ``digest``) left the cache: evicted by the pool, or found stale."""
    block_id: int
    digest: str


@lru_cache(maxsize=1024)
def _salt(tenant: str | None) -> bytes:
    """A tenant's 16-byte hash salt (empty without a tenant), computed once per tenant."""
    return hashlib.blake2b(tenant.encode(), digest_size=16).digest() if tenant is not None else b""


def _hash(parent: bytes | None, token_ids: Sequence[int], tenant: str | None) -> bytes:
    """:meth:`PrefixCache.block_hash` of validated arguments (the lookups' inner loop)."""
    h = hashlib.blake2b(parent or b"", digest_size=16, salt=_salt(tenant))
    h.update(array("q", token_ids).tobytes())  # int64 bytes, as numpy would give, without numpy's call cost
    return h.digest()


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    created: float  # the pool's allocation stamp: a reallocated block is a different block


class PrefixCache:
    """Hash chains of full blocks over ``pool``. Hooks itself into the pool's eviction and migration."""

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a PrefixCache needs a BlockPool, got {pool!r}")
        self.pool, self.block_size = pool, pool.block_size
        self._block: dict[bytes, int] = {}
        self._entry: dict[int, _Entry] = {}
        self._children: dict[bytes, set[int]] = {}
        self.requests = self.queries = self.hits = self.stores = self.evictions = 0
        pool.evict_hooks.append(self._on_evict)
        pool.relocation_hooks.append(self._on_relocate)
        prev = pool.evict_guard
        pool.evict_guard = self._may_evict if prev is None else (lambda b: self._may_evict(b) and prev(b))

    def __len__(self) -> int:
        return len(self._entry)

    @staticmethod
    def block_hash(parent: bytes | None, token_ids: Sequence[int], tenant: str | None = None) -> bytes:
        """16-byte blake2b of the parent hash and the block's token ids, salted per tenant."""
        return _hash(_check_parent(parent), check_token_ids(token_ids, "block_hash"), check_tenant(tenant))

    def holds(self, block_id: int) -> bool:
        """True if ``block_id`` is registered (and still the registered allocation)."""
        b = self.pool.check_id(block_id)  # a float would find the entry of its int
        e = self._entry.get(b)
        return e is not None and self._valid(b, e)

    def _valid(self, b: int, e: _Entry) -> bool:
        p = self.pool
        f = p.fields
        return f.status[b] == BlockStatus.ALLOCATED and f.reusable[b] == 1 and f.created[b] == e.created

    # ------------------------------------------------------------------ lookup and registration
    def match(self, token_ids: Sequence[int], tenant: str | None = None,
              max_blocks: int | None = None) -> tuple[list[int], bytes | None]:
        """The cached blocks of the longest cached prefix of ``token_ids`` (at most ``max_blocks`` full blocks),
        each with one new reference taken for the caller; and the hash of the last one (None if no hit)."""
        ids, parent, n = self._walk(*self._query(token_ids, tenant, max_blocks))
        self.requests += 1
        self.queries += n
        if ids:
            self.pool.incref(ids)
            self.hits += len(ids)
            if self.pool.events:
                self.pool.events.publish(PrefixHit(self.pool.clock.now(), tuple(ids), len(ids) * self.block_size,
                                                   tenant))
        return ids, parent

    def peek(self, token_ids: Sequence[int], tenant: str | None = None, max_blocks: int | None = None) -> list[int]:
        """The blocks :meth:`match` would return now, without taking references or counting a lookup (admission
        control asks what a prompt would cost before committing to it)."""
        return self._walk(*self._query(token_ids, tenant, max_blocks))[0]

    def _query(self, token_ids: Sequence[int], tenant: str | None,
               max_blocks: int | None) -> tuple[list[int], str | None, int]:
        """The validated arguments of :meth:`match`/:meth:`peek`: all of them before any lookup is counted."""
        tokens = check_token_ids(token_ids, "prefix lookup")
        tenant = check_tenant(tenant)
        if max_blocks is not None and not (is_int(max_blocks) and max_blocks >= 0):
            raise ConfigError(f"max_blocks must be an int >= 0 or None, got {max_blocks!r}")
        full = len(tokens) // self.block_size
        return tokens, tenant, full if max_blocks is None else min(int(max_blocks), full)

    def _walk(self, token_ids: list[int], tenant: str | None, n: int) -> tuple[list[int], bytes | None, int]:
        """Follow the hash chain of the first ``n`` full blocks of validated ``token_ids``: (hit blocks, last
        hit's hash, full blocks looked up)."""
        B = self.block_size
        ids, parent = [], None
        for i in range(n):
            chunk = tuple(token_ids[i * B:(i + 1) * B])
            digest = _hash(parent, chunk, tenant)
            b = self._block.get(digest)
            if b is None:
                break
            e = self._entry[b]
            if not self._valid(b, e):
                self._drop(b)
                break
            if e.tokens != chunk:  # a hash collision: never serve another prefix's K/V
                break
            ids.append(b)
            parent = digest
        return ids, parent, n

    def store(self, block_id: int, token_ids: Sequence[int], parent: bytes | None,
              tenant: str | None = None) -> bytes | None:
        """Register full, referenced block ``block_id`` holding ``token_ids`` under parent hash ``parent``; marks
        it reusable. Returns its hash, or None when another live block already caches this exact prefix."""
        b = self.pool.check_id(block_id)
        chunk = tuple(check_token_ids(token_ids, f"block {b}"))
        parent, tenant = _check_parent(parent), check_tenant(tenant)
        if len(chunk) != self.block_size:
            raise KVDataError(f"block {b}: only full blocks of {self.block_size} tokens are cached, got "
                              f"{len(chunk)}: {list(chunk)}")
        if self.pool.fields.status[b] != BlockStatus.ALLOCATED or not self.pool.fields.refcount[b]:
            raise IllegalTransitionError(f"block {b} is {BlockStatus(self.pool.fields.status[b]).name} with refcount "
                                         f"{self.pool.fields.refcount[b]}: only a held block can be registered")
        if parent is not None and parent not in self._block:
            raise IllegalTransitionError(f"block {b}: its parent hash {parent.hex()} is not cached")
        digest = _hash(parent, chunk, tenant)
        other = self._block.get(digest)
        if other is not None:
            if other == b:
                return digest
            if self._valid(other, self._entry[other]):
                return None
            self._drop(other)
        if b in self._entry:
            raise IllegalTransitionError(f"block {b} is already cached under hash {self._entry[b].digest.hex()}")
        self.pool.mark_reusable([b])
        self._entry[b] = _Entry(digest, parent, chunk, self.pool.fields.created[b])
        self._block[digest] = b
        if parent is not None:
            self._children.setdefault(parent, set()).add(b)
        self.stores += 1
        if self.pool.events:
            self.pool.events.publish(PrefixStored(self.pool.clock.now(), b, digest.hex()))
        return digest

    # ------------------------------------------------------------------ pool hooks
    def _drop(self, b: int) -> None:
        e = self._entry.pop(b)
        if self._block.get(e.digest) == b:
            del self._block[e.digest]
        if e.parent is not None and (kids := self._children.get(e.parent)) is not None:
            kids.discard(b)
            if not kids:
                del self._children[e.parent]
        self.evictions += 1
        if self.pool.events:
            self.pool.events.publish(PrefixEvicted(self.pool.clock.now(), b, e.digest.hex()))

    def _may_evict(self, b: int) -> bool:
        """Veto evicting a registered block while a child of it is still cached (tails go before heads)."""
        e = self._entry.get(b)
        if e is None:
            return True
        kids = self._children.get(e.digest, ())
        return not any(self._valid(c, self._entry[c]) for c in kids)

    def _on_evict(self, b: int) -> None:
        if b in self._entry:
            self._drop(b)

    def _on_relocate(self, src: np.ndarray, dst: np.ndarray) -> None:
        for a, b in zip(src.tolist(), dst.tolist()):
            e = self._entry.pop(a, None)
            if e is None:
                continue
            self._entry[b] = e
            self._block[e.digest] = b
            kids = self._children.get(e.parent) if e.parent is not None else None
            if kids is not None:
                kids.discard(a)
                kids.add(b)

    # ------------------------------------------------------------------ reporting
    def get_stats(self) -> dict[str, float]:
        """``requests`` (prompts looked up), ``queries`` (full blocks looked up), ``hits``, ``hit_rate``,
        ``tokens_saved``, ``stores``, ``evictions`` and ``cached_blocks`` (registered now)."""
        return {"requests": self.requests, "queries": self.queries, "hits": self.hits,
                "hit_rate": self.hits / self.queries if self.queries else 0.0,
                "tokens_saved": self.hits * self.block_size, "stores": self.stores, "evictions": self.evictions,
                "cached_blocks": len(self._entry)}
