"""Pool operations against a baseline written here: a doubly linked free queue of per-block objects, the way
vLLM v1 keeps its free blocks (``FreeKVCacheBlockQueue``). Reports ns per block for alloc+free of n blocks and
the ratio to the baseline measured in the same run, plus the metadata cost of building a 1,000,000-block pool.

``pool`` is the pool as installed: at n=1 its single-block paths run in C (``kvlab/_hotpath.c``) when kvlab
was built with a C compiler, and the row says so; ``Python paths`` times the same pool answering through its
Python methods only, as it does without a compiler.

Extra rows explain the ratios. ``scattered`` repeats n=256 on a pool whose free stack was shuffled first, so no
batch is a run of consecutive ids and every metadata write is fancy indexing (a long-running server's case; the
plain rows start from a fresh pool, as the baseline does). At n=1, ``floor`` is two empty functions called under
a lock, as ``allocate`` and ``free`` must; the row against the baseline with a lock per call gives the queue the
same lock and idiom as the pool, so what remains of the ratio is the per-block metadata work. The two ``bound``
rows time :class:`LeanPool`, that per-block work with nothing else around it, once in Python lists and once in
the pool's numpy-viewable buffers: what any pure-Python pool with this bookkeeping pays at n=1, and why the
pool's n=1 path is compiled.

Run: ``python benchmarks/bench_pool.py`` (or ``kvlab bench``).
"""
from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable

import numpy as np
import torch

from kvlab import BlockPool, KVSpec, default_device
from kvlab.bench import ns_per_item_together
from kvlab.pool import ALLOCATED, FREE, _zeros


class _Block:
    __slots__ = ("block_id", "ref_cnt", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id, self.ref_cnt, self.prev, self.next = block_id, 0, None, None


class LinkedFreeQueue:
    """Baseline: per-block objects on a doubly linked list with fake head/tail, popleft to allocate, append to
    free; refcounts on the objects."""

    def __init__(self, n: int) -> None:
        self.blocks = [_Block(i) for i in range(n)]
        self.head, self.tail = _Block(-1), _Block(-1)
        prev = self.head
        for b in self.blocks:
            prev.next, b.prev, prev = b, prev, b
        prev.next, self.tail.prev = self.tail, prev

    def popleft_n(self, n: int) -> list[_Block]:
        out, cur = [], self.head.next
        for _ in range(n):
            out.append(cur)
            cur.ref_cnt += 1
            cur = cur.next
        self.head.next, cur.prev = cur, self.head
        for b in out:
            b.prev = b.next = None
        return out

    def append_n(self, blocks: list[_Block]) -> None:
        last = self.tail.prev
        for b in blocks:
            b.ref_cnt -= 1
            last.next, b.prev, last = b, last, b
        last.next, self.tail.prev = self.tail, last


def locked_pair(allocate: Callable[[int], list], free: Callable[[list], None], n: int) -> Callable[[], None]:
    """``free(allocate(n))`` taking a lock around each call, with the pool's lock type and idiom."""
    lock = threading.RLock()

    def run() -> None:
        lock.acquire()  # as BlockPool's hot paths do: cheaper than `with` here
        try:
            got = allocate(n)
        finally:
            lock.release()
        lock.acquire()
        try:
            free(got)
        finally:
            lock.release()
    return run


class LeanPool:
    """A bound, not a design: the least a thread-safe pool with :class:`BlockPool`'s per-block bookkeeping does
    to allocate and free one block in Python. It keeps the pool's lock, logical step, event check, counters and
    stamps (status, refcount, hit count, access and creation time on allocation; status, refcount and reusable
    checks, then status, refcount, tokens and owner resets on free), and drops everything else: no size classes,
    no clock object, ids as plain ints, no error messages. ``lists=True`` keeps the metadata in Python lists,
    whose element access CPython 3.11 specialises; ``lists=False`` uses the pool's own ``bytearray``/``array``
    buffers and free stack, the ones numpy can view for batch calls and snapshots."""

    def __init__(self, n: int, lists: bool) -> None:
        def field(code: str) -> list | array | bytearray:
            return [0] * n if lists else _zeros(code, n)[0]
        self.status, self.reusable = field("B"), field("B")
        self.refs, self.tokens, self.owner = field("i"), field("i"), field("i")
        self.last, self.created, self.hits = field("q"), field("q"), field("q")
        for b in range(n):
            self.owner[b] = -1
        stack = range(n - 1, -1, -1)
        self.stack = list(stack) if lists else array("i", stack)  # the pool's free stack is an array('i')
        self.n, self.step, self.allocs, self.frees = n, 0, 0, 0
        self.lock, self.subscribers = threading.RLock(), []

    def allocate_one(self) -> int:
        lock = self.lock
        lock.acquire()
        try:
            b = self.stack.pop()
            self.step = t = self.step + 1
            self.status[b] = ALLOCATED  # chained stores: a tuple assignment would build a tuple
            self.refs[b] = self.hits[b] = 1
            self.last[b] = self.created[b] = t
            self.allocs += 1
            if self.subscribers:
                raise NotImplementedError("the bound publishes no events")
            return b
        finally:
            lock.release()

    def free_one(self, b: int) -> None:
        lock = self.lock
        lock.acquire()
        try:
            if not (type(b) is int and 0 <= b < self.n and self.status[b] == ALLOCATED and self.refs[b] == 1
                    and not self.reusable[b]):
                raise ValueError(f"the bound frees only a block holding its one reference, not {b!r}")
            self.status[b] = FREE
            self.refs[b] = self.tokens[b] = 0
            self.owner[b] = -1
            self.stack.append(b)
            self.step += 1
            self.frees += 1
            if self.subscribers:
                raise NotImplementedError("the bound publishes no events")
        finally:
            lock.release()


def python_paths(pool: BlockPool) -> BlockPool:
    """``pool`` answering through its Python methods only: drops the compiled methods it was given."""
    vars(pool).pop("allocate", None)
    vars(pool).pop("free", None)
    return pool


def _empty_allocate(n: int) -> list[int]:
    return [0]


def _empty_free(ids: list[int]) -> None:
    return None


def scattered_pool(num_blocks: int, seed: int = 0) -> BlockPool:
    """A metadata-only pool whose free stack holds every block in a random order."""
    pool = BlockPool(num_blocks, with_storage=False)
    ids = pool.allocate(num_blocks)
    pool.free(np.random.default_rng(seed).permutation(ids).tolist())
    return pool


def run(quick: bool = False) -> list[dict]:
    rows = []
    goals = {1: 1.5, 16: None, 256: 0.5}
    for n in (1, 16, 256):
        q, pool = LinkedFreeQueue(4096), BlockPool(4096, with_storage=False)
        fns = {"baseline": lambda: q.append_n(q.popleft_n(n)),
               "locked": locked_pair(q.popleft_n, q.append_n, n),  # the baseline paying for thread safety
               "ours": lambda: pool.free(pool.allocate(n))}
        if n == 1:
            py = python_paths(BlockPool(4096, with_storage=False))
            fns["python"] = lambda: py.free(py.allocate(n))
            fns["floor"] = locked_pair(_empty_allocate, _empty_free, 1)
            in_lists, in_buffers = LeanPool(4096, lists=True), LeanPool(4096, lists=False)
            fns["bound lists"] = lambda: in_lists.free_one(in_lists.allocate_one())
            fns["bound buffers"] = lambda: in_buffers.free_one(in_buffers.allocate_one())
        if n == 256:
            sp = scattered_pool(4096)
            fns["scattered"] = lambda: sp.free(sp.allocate(n))
        ns = ns_per_item_together(fns, n, reps=max(20, (2000 if quick else 20000) // n), rounds=5 if quick else 15)
        base = ns["baseline"]

        def row(name: str, value: float, baseline: float, goal: float | None = None) -> dict:
            return {"name": name, "value": round(value, 1), "unit": "ns/block", "baseline": round(baseline, 1),
                    "ratio": round(value / baseline, 2), "goal": goal}
        how = " (compiled hot path)" if n == 1 and pool._hot is not None else ""
        rows.append(row(f"pool alloc+free{how}, n={n}", ns["ours"], base, goals[n]))
        rows.append(row(f"  vs baseline with a lock per call, n={n}", ns["ours"], ns["locked"]))
        if n == 1:
            rows.append(row("  the pool's Python paths alone, n=1", ns["python"], base))
            rows.append(row("  floor: two empty locked calls, n=1", ns["floor"], base))
            rows.append(row("  bound: the pool's per-block work alone, list metadata, n=1", ns["bound lists"], base))
            rows.append(row("  bound: the pool's per-block work alone, its array metadata, n=1", ns["bound buffers"],
                            base))
        if n == 256:
            rows.append(row("  scattered ids (shuffled free stack), n=256", ns["scattered"], base))
    rows.extend(copy_bandwidth(quick))
    t = time.perf_counter()
    BlockPool(1_000_000, with_storage=False)
    rows.append({"name": "create 1,000,000-block pool (metadata)", "value": round(time.perf_counter() - t, 3),
                 "unit": "s", "baseline": None, "ratio": None, "goal": 1.0})
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
    for name, fn in (("block copy (migration)", lambda: pool.storage.copy_blocks(src, dst)),
                     ("swap-out to host", lambda: pool.storage.gather_blocks(src, out=host))):
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


if __name__ == "__main__":
    from kvlab.bench import run_script

    run_script(run)
