"""Pool operations against vLLM's own ``BlockPool`` and against two peer-style pools written here, each the whole
pool and the whole per-call path, not just its queue:

* the baseline, vLLM v1's real ``BlockPool`` (``vllm.v1.core.block_pool``), imported when vLLM is installed — a
  benchmark-only dependency, never kvlab's: ``pip install --no-deps --target .venv-bench -r
  benchmarks/requirements-vllm.txt``, then run with ``PYTHONPATH=.venv-bench`` (docs/benchmarks.md, "Pool
  table"). Built as vLLM's KV cache coordinator builds it, ``BlockPool(num_gpu_blocks, enable_caching=True,
  hash_block_size=16, enable_kv_cache_events=False, metrics_collector=None)``: prefix caching on, block 0 held back
  as the null block, KV events off, no metrics collector (vLLM's defaults); timed as its scheduler calls it,
  ``get_new_blocks(n)`` then ``free_blocks(blocks)``. Its rows name the version (``vllm.__version__``).
* :class:`VllmStylePool`, a model of vLLM v1's ``BlockPool`` as of vLLM **0.33.0** (calibrated within a few per
  cent of that release's pool, docs/benchmarks.md, "Calibration"; vLLM 0.34.0's pool is 1.4-2x faster at n=1,
  2-3x at n = 16 and 256).
  It is the baseline when vLLM cannot be imported, and the rows and a line on stderr say so; beside the real pool
  it is an informational row. One object per block (id, refcount, owning pool, hash key behind a property,
  prev/next pointers, null flag) on a doubly linked free queue with a fake head and tail, block 0 held back as the
  null block, and a hash map from key to cached block. ``get_new_blocks(n)`` checks that n are free, pops n off
  the head (one-block fast path), checks for reuse watchers and, per block, calls the cached-hash removal helper
  (which builds the block's list of keys from its hash property and the extra-hash dict), asserts refcount 0,
  takes a reference and checks for a metrics collector. ``free_blocks`` checks each block for the null block and
  for another pool's ownership, drops a reference, and splits those at 0 by whether they carry a hash: uncached
  to the head (reused first), cached to the tail (evicted last).
* :class:`NanoStyleBlockManager`, a model of nano-vllm's ``BlockManager``: a deque of free ids, a set of used
  ids, a hash -> id dict and plain per-block objects (refcount, hash, token ids). Allocating asks whether n are
  free, then per block fetches its tokens (none: nothing is hashed), looks the hash up, takes the id at the deque's
  left end and allocates it (assert, reset, ``deque.remove``, add to the used set); freeing walks the table from
  its end, drops a reference and, at 0, moves the id from the used set back to the deque, then empties the table.

Rows, in ns per block for ``free(allocate(n))``: :class:`FastBlockPool` (compiled where kvlab was built with a C
compiler) and :class:`PyFastBlockPool` (its Python twin, the same fast paths without the C; shown when the C is
built, else ``FastBlockPool`` is it) at n = 1, 16, 256, each on a fresh pool and on a shuffled free list (every
block allocated, then freed in a random order, so no batch is a run of consecutive ids: a long-running server's
case), each with no event subscriber and with one no-op subscriber (the pool then builds and publishes its events,
as under a live view); and the reference :class:`BlockPool` at n=1 (pure Python, one validated path). Each ratio
is to the vLLM baseline in the same state (fresh or shuffled the same way), with the ratio to the
nano-vllm-style manager beside it, measured in the same run with all variants of one n timed in turn within each
round; the figure is the **best** of the rounds (the least disturbed by a noisy machine), with the garbage
collector off while timing. Also: the metadata cost of creating a 1,000,000-block pool against creating the vLLM
baseline's million block objects and linked queue, and block-copy bandwidth. Informational *floor* rows beside
the reference bound what any rewrite of it could reach: two empty methods that take a lock
(:class:`LockedNothing`: what every thread-safe n=1 call pair pays before doing any work, against a baseline that
takes no lock); the reference's own work with every helper inlined and the lock taken by ``acquire``/``release``
(:class:`InlinedReference`), with the fields in lists and in arrays. The goal column says met or not met (a quick
run, which the tests use, judges nothing): every FastBlockPool and PyFastBlockPool row <= 0.5x the vLLM baseline,
each pool of 1,000,000 blocks created in < 0.5 s; the reference has no goal.

Run: ``python benchmarks/bench_pool.py [--quick]`` (or ``kvlab bench bench_pool``).
"""
from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from kvlab import BlockPool, FastBlockPool, KVSpec, PyFastBlockPool, default_device
from kvlab.core import events as ev
from kvlab.core.block import BlockStatus
from kvlab.core.clock import LogicalClock
from kvlab.core.events import EventBus
from kvlab.fast.pool import COMPILED
from kvlab.app.bench import ns_per_item_together

POOL_BLOCKS = 4096  # blocks in every timed pool
CREATE_BLOCKS = 1_000_000
GOAL_FAST, GOAL_CREATE_S = 0.5, 0.5
HASH_BLOCK_SIZE = 16  # tokens per block hash in the real pool (it never hashes here: no block is cached)
MODELLED_VLLM = "0.33.0"  # the release VllmStylePool was calibrated against


# ---------------------------------------------------------------- the baseline: vLLM's own BlockPool
class Peer(NamedTuple):
    """The vLLM pool the ratios are taken to: ``make(num_blocks)`` builds one (``get_new_blocks``,
    ``free_blocks``, ``get_num_free_blocks``); ``label`` names it in the rows; ``real`` says whether it is vLLM's
    own code; ``why`` says why not."""

    label: str
    make: Callable[[int], Any]
    real: bool
    why: str = ""


MODEL = Peer(f"vLLM-style pool, a model of vLLM {MODELLED_VLLM}", lambda n: VllmStylePool(n), False)


def vllm_peer() -> Peer:
    """vLLM's own ``BlockPool`` where vLLM can be imported (benchmarks/requirements-vllm.txt says how to install
    it for the benchmark alone), built as its KV cache coordinator builds it with prefix caching on and vLLM's
    defaults: KV events off, no metrics collector. Otherwise :data:`MODEL`, with the reason."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's own log handler would write to stdout
    try:
        version = importlib.import_module("vllm").__version__
        VllmBlockPool = importlib.import_module("vllm.v1.core.block_pool").BlockPool
    except Exception as e:  # not installed, or installed without a module its import needs
        return MODEL._replace(why=f"{type(e).__name__}: {e}")

    def make(num_blocks: int) -> Any:
        return VllmBlockPool(num_blocks, enable_caching=True, hash_block_size=HASH_BLOCK_SIZE,
                             enable_kv_cache_events=False, metrics_collector=None)

    return Peer(f"vLLM {version} BlockPool", make, True)


# ---------------------------------------------------------------- the vLLM-v1-style pool
# A model of vLLM v1's BlockPool (vllm/v1/core/block_pool.py and kv_cache_utils.py) as of vLLM 0.33.0, with prefix
# caching on, no metrics collector and KV events off (the peer's defaults), written here from the peer's design: the
# same objects, method calls, attribute and property reads and per-block checks per call, so that it costs what the
# peer's pool cost. Calibrated against that release's pool in one process (docs/benchmarks.md, "Calibration"); the
# baseline where vLLM is not installed (vLLM is not a dependency of kvlab).
class VllmBlock:
    """One block's metadata as the peer keeps it (there a slotted dataclass: the same slots and one ``__init__``
    setting every field, ``pool`` by keyword), its hash key behind a property."""

    __slots__ = ("block_id", "ref_cnt", "pool", "_hash", "_hash_tokens", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int, ref_cnt: int = 0, _hash: bytes | None = None, _hash_tokens: int | None = None,
                 prev_free: VllmBlock | None = None, next_free: VllmBlock | None = None, is_null: bool = False, *,
                 pool: VllmStylePool | None = None) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.pool = pool
        self._hash = _hash  # block hash + group id, set while the block is cached
        self._hash_tokens = _hash_tokens
        self.prev_free = prev_free
        self.next_free = next_free
        self.is_null = is_null  # the placeholder block the pool keeps out of the free queue

    @property
    def block_hash(self) -> bytes | None:
        return self._hash

    def set_block_hash(self, key: bytes, num_tokens: int | None = None) -> None:
        assert self.block_hash is None and self._hash_tokens is None
        self._hash, self._hash_tokens = key, num_tokens

    def reset_hash(self) -> None:
        self._hash = self._hash_tokens = None


class VllmFreeQueue:
    """Free blocks on a doubly linked list between a fake head and tail, the pointers living in the blocks (no
    allocation per operation): pop at the head (a one-block fast path), put back at the head or at the tail."""

    def __init__(self, blocks: list[VllmBlock]) -> None:
        n = self.num_free_blocks = len(blocks)
        for i in range(n):  # link neighbours by index, as the peer builds its queue
            if i > 0:
                blocks[i].prev_free = blocks[i - 1]
            if i < n - 1:
                blocks[i].next_free = blocks[i + 1]
        self.head, self.tail = VllmBlock(-1), VllmBlock(-1)
        if n:
            self.head.next_free, blocks[0].prev_free = blocks[0], self.head
            self.tail.prev_free, blocks[-1].next_free = blocks[-1], self.tail
        else:
            self.head.next_free, self.tail.prev_free = self.tail, self.head

    def popleft_n(self, n: int) -> list[VllmBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        cur = self.head.next_free
        if n == 1:
            assert cur is not None
            after = cur.next_free
            cur.prev_free = None
            cur.next_free = None
            if after is not None:
                self.head.next_free = after
                after.prev_free = self.head
            return [cur]
        out = []
        for _ in range(n):
            assert cur is not None
            out.append(cur)
            taken = cur
            cur = cur.next_free
            taken.prev_free = None
            taken.next_free = None
        if cur is not None:
            self.head.next_free = cur
            cur.prev_free = self.head
        return out

    def prepend_n(self, blocks: list[VllmBlock]) -> None:
        """Put ``blocks`` at the head, in their order: they are handed out next."""
        if len(blocks) == 0:
            return
        first = self.head.next_free
        assert first is not None
        prev = self.head
        for b in blocks:
            b.prev_free = prev
            prev.next_free = b
            prev = b
        prev.next_free = first
        first.prev_free = prev
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[VllmBlock]) -> None:
        """Put ``blocks`` at the tail, in their order: they are handed out last."""
        if not blocks:
            return
        last = self.tail.prev_free
        assert last is not None
        for b in blocks:
            b.prev_free = last
            last.next_free = b
            last = b
        last.next_free = self.tail
        self.tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def ids(self) -> list[int]:
        """Free block ids head to tail, checking the back links and the count (for tests)."""
        out, prev, cur = [], self.head, self.head.next_free
        while cur is not self.tail:
            assert cur is not None and cur.prev_free is prev
            out.append(cur.block_id)
            prev, cur = cur, cur.next_free
        assert self.tail.prev_free is prev and len(out) == self.num_free_blocks
        return out


class VllmHashMap:
    """Hash key -> the one block cached under it, or a dict of block id -> block when several are (the peer keeps
    a bare block for the common single case, to spare the collector an inner dict per key)."""

    def __init__(self) -> None:
        self._cache: dict[bytes, VllmBlock | dict[int, VllmBlock]] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def contain(self, key: bytes, block_id: int) -> bool:
        got = self._cache.get(key)
        if got is None:
            return False
        return got.block_id == block_id if isinstance(got, VllmBlock) else block_id in got

    def insert(self, key: bytes, block: VllmBlock) -> None:
        got = self._cache.get(key)
        if got is None:
            self._cache[key] = block
        elif isinstance(got, VllmBlock):
            self._cache[key] = {got.block_id: got, block.block_id: block}
        elif isinstance(got, dict):
            got[block.block_id] = block
        else:
            raise AssertionError(f"unexpected entry {type(got)}")

    def pop(self, key: bytes, block_id: int) -> VllmBlock | None:
        """Take block ``block_id`` out from under ``key``; None if it was not there."""
        got = self._cache.pop(key, None)
        if got is None:
            return None
        if isinstance(got, VllmBlock):
            if got.block_id == block_id:
                return got
            self._cache[key] = got  # another block's entry: put it back
            return None
        if isinstance(got, dict):
            block = got.pop(block_id, None)
            if len(got) > 0:
                self._cache[key] = got
            return block
        raise AssertionError(f"unexpected entry {type(got)}")


class VllmStylePool:
    """vLLM v1's block pool with prefix caching on: block objects (block 0 held back as the null block), the
    linked free queue, the hash map and the per-block extra-hash dict. ``get_new_blocks(n)`` checks that n are
    free, pops n off the head, checks for reuse watchers and, per block, drops any cached hash (a helper call that
    builds the block's list of hashes and, when there are none, returns an empty one), asserts refcount 0, takes a
    reference and checks for a metrics collector. ``free_blocks`` skips the null block, sends blocks of another
    pool back to it, drops a reference and splits those reaching 0 by whether they carry a hash: uncached ones go to
    the head (reused first), cached ones to the tail (evicted last)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert isinstance(num_blocks, int) and num_blocks > 0
        self.num_blocks, self.enable_caching = num_blocks, enable_caching
        self.blocks = [VllmBlock(i, pool=self) for i in range(num_blocks)]
        self.free_block_queue = VllmFreeQueue(self.blocks)
        self.cached_block_hash_to_block = VllmHashMap()
        self.extra_hashes_by_block: dict[int, set[bytes]] = {}  # a block cached under more than one key
        self.null_block = self.free_block_queue.popleft_n(1)[0]
        self.null_block.is_null = True
        self.enable_kv_cache_events = False
        self.kv_event_queue: list[tuple[str, bytes]] = []
        self.metrics_collector = None
        self._reuse_watchers: dict[int, Callable[[VllmBlock], None]] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[VllmBlock]:
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot get {n} free blocks from the pool")
        out = self.free_block_queue.popleft_n(n)
        if self._reuse_watchers:
            self._notify_reuse(out)
        if self.enable_caching:
            for block in out:
                self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
        else:
            for block in out:
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
        return out

    def _notify_reuse(self, blocks: list[VllmBlock]) -> None:
        for block in blocks:
            watcher = self._reuse_watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def cache_block(self, block: VllmBlock, key: bytes, num_tokens: int | None = None) -> None:
        """Cache ``block`` under ``key``, as the peer does once a block is full (here for tests): its first key on
        the block, any further ones in the extra-hash dict."""
        if block.block_hash == key or self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens)
        else:
            self.extra_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)

    def _maybe_evict_cached_block(self, block: VllmBlock) -> bool:
        """A free block may still hold a cached prefix: reusing it drops every key it is cached under."""
        if self.metrics_collector:
            self.metrics_collector.on_block_evicted(block)
        removed = self._remove_cached_block_hashes(block)
        if not removed:
            return False
        self._emit_block_removed_events(removed)
        return True

    def _remove_cached_block_hashes(self, block: VllmBlock) -> list[bytes]:
        keys: list[bytes] = []
        if block.block_hash is not None:
            keys.append(block.block_hash)
        keys.extend(self.extra_hashes_by_block.pop(block.block_id, ()))
        if not keys:
            return []
        removed = []
        for key in keys:
            if self.cached_block_hash_to_block.pop(key, block.block_id) is not None:
                removed.append(key)
        block.reset_hash()
        return removed

    def _emit_block_removed_events(self, keys: list[bytes]) -> None:
        if not self.enable_kv_cache_events:
            return
        self.kv_event_queue.extend(("removed", key) for key in keys)

    def free_blocks(self, ordered_blocks: Iterable[VllmBlock]) -> None:
        reuse_first: list[VllmBlock] = []  # no hash: cannot serve a prefix hit, so reused first (LIFO)
        reuse_last: list[VllmBlock] = []  # cached: kept for hits as long as possible (FIFO, LRU eviction)
        other_pools: dict[VllmStylePool, list[VllmBlock]] = {}
        for block in ordered_blocks:
            if block.is_null:  # never in the queue, its refcount not kept
                continue
            if block.pool is not None and block.pool is not self:
                other_pools.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    reuse_first.append(block)
                else:
                    reuse_last.append(block)
        self.free_block_queue.prepend_n(reuse_first)
        self.free_block_queue.append_n(reuse_last)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)


# ---------------------------------------------------------------- the nano-vllm-style block manager
# A model of nano-vllm's BlockManager (nanovllm/engine/block_manager.py): the same structures and per-block steps.
# Its allocate takes a Sequence and, per block, fetches the block's tokens and hashes them (xxhash) if the block is
# full. This model takes a count and its blocks hold no tokens, so nothing is hashed (h = -1, the peer's path for
# a block that is not full): kvlab's pool is given no tokens and vLLM hashes outside its pool, so the benchmark
# times the pools, not the hashing.
_NO_TOKENS: list[int] = []


class NanoBlock:
    """A plain object per block (no slots), as the peer's."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash, self.token_ids = h, token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class NanoStyleBlockManager:
    """nano-vllm's block manager: a deque of free ids, a set of used ids, a hash -> id dict, block objects.
    ``allocate(n)`` asks whether n are free, then runs the peer's per-block loop on a cache miss: fetch the
    block's tokens (none) and test whether it is full, look the (absent) hash up, take the id at the deque's left
    end and allocate it (assert, reset, remove it from the deque, add it to the used set), append it to the block
    table it returns. ``free(table)`` walks the table from its end, drops a reference and, at 0,
    moves the id from the used set to the deque's right end; then empties the table, as the peer empties the
    sequence's."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.block_size = block_size
        self.blocks = [NanoBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def can_allocate(self, n: int) -> bool:
        return len(self.free_block_ids) >= n

    def _block_tokens(self, i: int) -> list[int]:
        """Block i's tokens: the peer slices them from the sequence; here there are none."""
        return _NO_TOKENS

    def _allocate_block(self, block_id: int) -> NanoBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return self.blocks[block_id]

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):  # the peer's scheduler asks before allocating
            raise ValueError(f"cannot allocate {n} blocks")
        table: list[int] = []
        h, cache_miss = -1, False
        for i in range(n):
            token_ids = self._block_tokens(i)
            h = hash((h, *token_ids)) if len(token_ids) == self.block_size else -1  # never full here
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                cache_miss = True
            if cache_miss:
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            elif block_id in self.used_block_ids:  # a hit (never, with nothing hashed): share the block
                block = self.blocks[block_id]
                block.ref_count += 1
            else:  # a hit on a free block: take it back
                block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, token_ids)
                self.hash_to_block_id[h] = block_id
            table.append(block_id)
        return table

    def free(self, table: list[int]) -> None:
        for b in reversed(table):  # a sequence's block table, released from its end
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(b)
        table.clear()


class LockedNothing:
    """The floor under any thread-safe pool's n=1 call pair: two methods that take a lock, as ``allocate`` and
    ``free`` must, and do no pool work. Not a pool; its row says how much of a ratio no bookkeeping can remove."""

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def allocate(self, n: int = 1) -> list[int]:
        with self.lock:
            return [0]

    def free(self, ids: list[int]) -> None:
        with self.lock:
            return None


class InlinedReference:
    """The floor under the reference itself: :class:`BlockPool`'s own ``allocate(n)`` and ``free(ids)`` on a pool
    of base blocks, doing all of their work — the checks of count, size class, owner, status and ids; the
    all-or-nothing test against free plus cached blocks; the counted mutation and the clock object's tick; the
    stamps, counters and served counts; PENDING blocks aborted by ``free``; blocks marked reusable kept as cached
    (here a set stands for the policy); the events behind the same guard — as one function each, every helper
    inlined, the lock taken by ``acquire`` and ``release``. ``fields`` is ``list`` (cheapest to index) or
    ``array`` (what :class:`kvlab.core.meta.BlockMeta` keeps, so that numpy views of the fields cost no copy).
    Not a pool to use: its rows say how near the goal the reference's work can come in CPython at best."""

    def __init__(self, num_blocks: int, fields: type = list) -> None:
        def field(code: str, value: int = 0) -> list[int] | array:
            return [value] * num_blocks if fields is list else array(code, [value]) * num_blocks

        self.num_blocks, self.lock, self.clock, self.events = num_blocks, threading.RLock(), LogicalClock(), EventBus()
        top_down = range(num_blocks - 1, -1, -1)  # the lowest id on top, as in a fresh BlockPool
        self.stacks = [list(top_down) if fields is list else array("i", top_down)]
        self.max_order, self.cached = 0, set[int]()
        self.status, self.size_class, self.refcount, self.hits = field("B"), field("B"), field("i"), field("q")
        self.last_access, self.created, self.owner = field("q"), field("q"), field("i", -1)
        self.tokens, self.reusable = field("i"), field("B")
        self.counts = dict.fromkeys(("allocations", "frees", "served_free"), 0)
        self.lock_acquisitions = 0

    def allocate(self, n: int = 1, *, size_class: int = 0, owner: int = -1, status: int = 2) -> list[int]:
        lock = self.lock
        lock.acquire()
        try:
            if not (type(n) is int or isinstance(n, np.integer)) or n < 0:
                raise ValueError(f"bad count {n!r}")
            if not (type(size_class) is int or isinstance(size_class, np.integer)) \
                    or not 0 <= size_class <= self.max_order:
                raise ValueError(f"bad size class {size_class!r}")
            if not (type(owner) is int or isinstance(owner, np.integer)) or not -1 <= owner < 2**31:
                raise ValueError(f"bad owner {owner!r}")
            if type(status) not in (int, BlockStatus) or status not in (2, 1):  # ALLOCATED, PENDING
                raise ValueError(f"bad status {status!r}")
            stack = self.stacks[size_class]
            if n > len(stack) and n - len(stack) > len(self.cached):
                raise ValueError(f"cannot allocate {n} blocks")
            if not n:
                return []
            self.lock_acquisitions += 1
            t, out = self.clock.tick(), []
            for _ in range(n):
                if not stack:  # the reference evicts here; this floor never caches enough to need it
                    raise NotImplementedError("eviction")
                b = stack.pop()
                self.counts["served_free"] += 1
                self.status[b] = status
                self.refcount[b] = self.hits[b] = 1
                self.last_access[b] = self.created[b] = t
                self.owner[b] = owner
                out.append(b)
            self.counts["allocations"] += n
            if self.events:
                self.events.publish(ev.Allocated(t, tuple(out), size_class, owner, BlockStatus(status).name, "free"))
            return out
        finally:
            lock.release()

    def free(self, ids: list[int]) -> None:
        lock = self.lock
        lock.acquire()
        try:
            want: dict[int, int] = {}  # {id: occurrences}: a repeat drops one reference per occurrence
            for b in ids:
                if not (type(b) is int or isinstance(b, np.integer)) or not 0 <= b < self.num_blocks:
                    raise ValueError(f"bad block id {b!r}")
                if self.max_order and b & ~((1 << self.size_class[b]) - 1) != b:
                    raise ValueError(f"block {b} is inside a larger block")
                want[b] = want.get(b, 0) + 1
            for b, c in want.items():
                s, r = self.status[b], self.refcount[b]
                if not (s == 2 and r >= c or s == 1 and c == 1):
                    raise ValueError(f"block {b} cannot be released {c} time(s)")
            if not want:
                return
            self.lock_acquisitions += 1
            t = self.clock.tick()
            self.counts["frees"] += sum(want.values())
            left, kept, gone = [], [], []
            for b, c in want.items():
                r = self.refcount[b] = self.refcount[b] - c
                if r:
                    left.append(b)
                elif self.status[b] == 2 and self.reusable[b]:
                    kept.append(b)
                else:
                    gone.append(b)
            for b in left + kept:
                self.last_access[b] = t
            self.cached.update(kept)
            for b in reversed(gone):
                self.status[b] = self.refcount[b] = self.tokens[b] = self.reusable[b] = 0
                self.owner[b] = -1
                self.stacks[self.size_class[b]].append(b)
            if self.events:
                if left:
                    self.events.publish(ev.RefChanged(t, tuple(left), tuple(-want[b] for b in left),
                                                      tuple(self.refcount[b] for b in left)))
                if kept:
                    self.events.publish(ev.Cached(t, tuple(kept)))
                if gone:
                    self.events.publish(ev.Freed(t, tuple(gone)))
        finally:
            lock.release()


# ---------------------------------------------------------------- pools in a known state
def shuffled_order(num_blocks: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).permutation(num_blocks).tolist()


def vllm_pool(num_blocks: int, shuffled: bool, make: Callable[[int], Any] = VllmStylePool) -> Any:
    """A vLLM pool (the model, or ``make``'s: vLLM's own), fresh or with its free queue permuted: every free block
    taken, then freed in a random order (uncached blocks go back to the head in the order freed, so the queue is
    that order). Block 0 is the null block."""
    p = make(num_blocks)
    if shuffled:
        got = p.get_new_blocks(p.get_num_free_blocks())
        p.free_blocks([got[i] for i in shuffled_order(len(got))])
    return p


def nano_pool(num_blocks: int, shuffled: bool) -> NanoStyleBlockManager:
    p = NanoStyleBlockManager(num_blocks)
    if shuffled:
        p.allocate(num_blocks)
        p.free(shuffled_order(num_blocks))
    return p


def kvlab_pool(cls: type[BlockPool], num_blocks: int, shuffled: bool, subscriber: bool) -> BlockPool:
    """A metadata-only pool, fresh or with its free stack permuted the same way; optionally one no-op
    subscriber, so every call builds and publishes its events."""
    p = cls(num_blocks, with_storage=False)
    if shuffled:
        p.allocate(num_blocks)
        p.free(shuffled_order(num_blocks))
    if subscriber:
        p.events.subscribe(lambda e: None)
    return p


# ---------------------------------------------------------------- rows
def _goal(text: str, met: bool, quick: bool) -> str:
    """The goal and whether it was met (not judged on a quick run's tiny samples)."""
    if quick:
        return text + " (quick: not judged)"
    return f"{text}: {'met' if met else 'not met'}"


def _row(name: str, value: float, baseline: float | None = None, goal: str | None = None,
         nano: float | None = None) -> dict:
    r = {"name": name, "value": round(value, 1), "unit": "ns/block",
         "baseline": None if baseline is None else round(baseline, 1),
         "ratio": None if baseline is None else round(value / baseline, 3), "goal": goal}
    if nano is not None:
        r["ratios"] = {"nano-style": round(value / nano, 3)}
    return r


def baseline_name(peer: Peer, n: int, state: str) -> str:
    """The row of the vLLM pool that the ratios at n in that state are taken to."""
    return f"{peer.label} (baseline{'' if peer.real else '; vLLM not importable'}), n={n}, {state}"


def timing_rows(quick: bool, peer: Peer = MODEL) -> list[dict]:
    rows = []
    rounds = 3 if quick else 15
    fast_classes: dict[str, type[BlockPool]] = {"FastBlockPool": FastBlockPool}
    if COMPILED:  # else FastBlockPool is PyFastBlockPool
        fast_classes["PyFastBlockPool"] = PyFastBlockPool
    for n in (1, 16, 256):
        fns: dict[str, Callable[..., object]] = {}
        for state in ("fresh", "shuffled"):
            shuf = state == "shuffled"
            v, nm = vllm_pool(POOL_BLOCKS, shuf, peer.make), nano_pool(POOL_BLOCKS, shuf)
            fns[f"vllm {state}"] = lambda v=v: v.free_blocks(v.get_new_blocks(n))
            if peer.real:  # the model beside vLLM's own pool, for comparison
                m = vllm_pool(POOL_BLOCKS, shuf)
                fns[f"model {state}"] = lambda m=m: m.free_blocks(m.get_new_blocks(n))
            fns[f"nano {state}"] = lambda nm=nm: nm.free(nm.allocate(n))
            for cname, cls in fast_classes.items():
                for sub in (False, True):
                    p = kvlab_pool(cls, POOL_BLOCKS, shuf, sub)
                    fns[f"{cname} {state} {sub}"] = lambda p=p: p.free(p.allocate(n))
        if n == 1:
            ref, floor = kvlab_pool(BlockPool, POOL_BLOCKS, False, False), LockedNothing()
            fns["reference"] = lambda: ref.free(ref.allocate(1))
            fns["floor"] = lambda: floor.free(floor.allocate(1))
            for name, pool in (("inlined list", InlinedReference(POOL_BLOCKS)),
                               ("inlined array", InlinedReference(POOL_BLOCKS, array))):
                fns[name] = lambda pool=pool: pool.free(pool.allocate(1))
        reps = max(20, (300 if quick else 40_000) // n)
        ns = ns_per_item_together(fns, n, reps=reps, rounds=rounds)
        for state in ("fresh", "shuffled"):
            base = ns[f"vllm {state}"]
            rows.append(_row(baseline_name(peer, n, state), base))
            if peer.real:
                rows.append(_row(f"  {MODEL.label} (informational), n={n}, {state}", ns[f"model {state}"], base))
            rows.append(_row(f"nano-vllm-style BlockManager, n={n}, {state}", ns[f"nano {state}"], base))
        if n == 1:
            base, nano = ns["vllm fresh"], ns["nano fresh"]
            rows.append(_row("BlockPool (reference, pure Python, informational), n=1, fresh", ns["reference"], base,
                             None, nano))
            rows.append(_row("  floor: two empty method calls under a lock, no pool work (informational), n=1",
                             ns["floor"], base))
            for name, what in (("inlined list", "fields in lists"),
                               ("inlined array", "fields in arrays, as BlockMeta keeps them")):
                rows.append(_row(f"  floor: the reference's work, every helper inlined, {what} (InlinedReference, "
                                 f"informational), n=1", ns[name], base))
        for cname in fast_classes:
            for state in ("fresh", "shuffled"):
                base = ns[f"vllm {state}"]
                for sub in (False, True):
                    t = ns[f"{cname} {state} {sub}"]
                    rows.append(_row(f"{cname}, n={n}, {state}, {'1 subscriber' if sub else 'no subscriber'}", t,
                                     base, _goal(f"<= {GOAL_FAST}x", t <= GOAL_FAST * base, quick),
                                     ns[f"nano {state}"]))
    return rows


def best_seconds(fn: Callable[[], object], rounds: int, collect: bool = False) -> float:
    """Best of ``rounds`` timings of ``fn()``, by default with the garbage collector off (which favours the
    object-heavy baseline: with it on, building a million objects also pays for the collections it triggers)."""
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        if not collect:
            gc.disable()
        try:
            t = time.perf_counter()
            kept = fn()  # held until timed: freeing a million objects is not part of creating them
            best = min(best, time.perf_counter() - t)
            del kept
        finally:
            gc.enable()
    return best


def creation_rows(quick: bool, peer: Peer = MODEL) -> list[dict]:
    n = 100_000 if quick else CREATE_BLOCKS
    rounds = 1 if quick else 3
    ts = {}
    makers: list[tuple[str, Callable[[], object]]] = [("vllm", lambda: peer.make(n))]
    if peer.real:
        makers.append(("model", lambda: VllmStylePool(n)))
    makers += [("reference", lambda: BlockPool(n, with_storage=False)),
               ("fast", lambda: FastBlockPool(n, with_storage=False))]
    for name, fn in makers:
        ts[name] = best_seconds(fn, rounds)
    gc_on = best_seconds(lambda: peer.make(n), rounds, collect=True)
    base = round(ts["vllm"], 3)
    rows = [{"name": f"create {peer.label}: {n:,} blocks (objects + linked queue)", "value": base,
             "unit": "s", "baseline": None, "ratio": None, "goal": None},
            {"name": "  the same with the garbage collector on (informational)", "value": round(gc_on, 3),
             "unit": "s", "baseline": base, "ratio": round(gc_on / ts["vllm"], 3), "goal": None}]
    if peer.real:
        rows.append({"name": f"  the same for the {MODEL.label} (informational)", "value": round(ts["model"], 3),
                     "unit": "s", "baseline": base, "ratio": round(ts["model"] / ts["vllm"], 3), "goal": None})
    for name, label in (("reference", "BlockPool"), ("fast", "FastBlockPool")):
        rows.append({"name": f"create {n:,}-block {label} (metadata only)", "value": round(ts[name], 3),
                     "unit": "s", "baseline": base, "ratio": round(ts[name] / ts["vllm"], 3),
                     "goal": _goal(f"< {GOAL_CREATE_S} s", ts[name] < GOAL_CREATE_S, quick)})
    return rows


def copy_bandwidth(quick: bool) -> list[dict]:
    """GB/s of batched block copies inside the KV tensor (migration, copy-on-write) and of swap-out to host
    memory (pinned on CUDA), on the default device."""
    dev = default_device()
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float16, device=dev)
    n = 256 if quick else 1024
    pool = BlockPool(2 * n, spec=spec)
    src, dst = torch.arange(n), torch.arange(n, 2 * n)
    host = torch.empty((2, spec.num_layers, n, spec.block_size, spec.num_kv_heads, spec.head_dim),
                       dtype=spec.dtype, pin_memory=dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    storage = pool.storage_of()
    for name, fn in (("block copy (migration)", lambda: storage.copy_blocks(src, dst)),
                     ("swap-out to host", lambda: storage.gather_blocks(src, out=host))):
        fn()
        sync()
        best = float("inf")
        for _ in range(3 if quick else 10):
            t = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t)
        nbytes = n * spec.bytes_per_block * (2 if name.startswith("block") else 1)  # read + write inside
        out.append({"name": f"{name}, {n} blocks on {dev.type}", "value": round(nbytes / best / 1e9, 2),
                    "unit": "GB/s", "baseline": None, "ratio": None, "goal": None})
    return out


def run(quick: bool = False) -> list[dict]:
    peer = vllm_peer()
    if not peer.real:
        print(f"bench_pool: vLLM cannot be imported ({peer.why}); the baseline is the benchmark's model of vLLM "
              f"{MODELLED_VLLM}'s BlockPool, which vLLM 0.34.0's pool outruns 1.4-2x at n=1, 2-3x at n = 16 and "
              "256. To time vLLM's own: see benchmarks/requirements-vllm.txt", file=sys.stderr)
    return timing_rows(quick, peer) + creation_rows(quick, peer) + copy_bandwidth(quick)


if __name__ == "__main__":
    from kvlab.app.bench import run_script

    run_script(run)
