"""Engine benchmark: metadata-only simulation of dialogue requests (goal: 10,000 in <= 10 s on 2 cores), steps/s,
requests/s, growth from 1k to 10k (and 100k with ``--full``: one run, a few minutes), the contiguous baseline's
throughput on the same workload, prefetch's effect on swap-in stalls, and two comparisons:

* **Replay against nano-vllm** (goal: <= 1.0x). One engine run of 10,000 chat requests is recorded as the
  operations its block manager saw (admit a prompt, append n tokens per sequence per step, free), then replayed
  through kvlab (what the engine uses, :func:`kvlab.fast.choose`: ``FastSequenceManager`` + ``FastPrefixCache``
  on ``FastBlockPool``, metadata mode, registering as the engine does: a prefill's full blocks at once, a
  request's generated ones when it is freed) and through :class:`NanoReplayManager`, on the same pool size,
  interleaved, best of several rounds. :class:`NanoReplayManager` and :class:`NanoSeq` are a model of nano-vllm's
  ``nanovllm/engine/block_manager.py`` and ``sequence.py`` at commit ``bb823b3`` (GeeeekExplorer/nano-vllm,
  MIT), written here because nano-vllm is not on the package registries this project installs from: the same
  data structures, hashing (xxhash64 over the prefix hash and the token ids as numpy bytes), checks, deque and
  set operations and call order, method by method, and :func:`replay_nano` calls them where nano-vllm's
  ``Scheduler`` does (``can_allocate`` / ``allocate`` at admission, ``can_append`` / ``may_append`` per decoded
  token, ``hash_blocks`` after every chunk and token, ``deallocate`` at the end). xxhash is a benchmark-only
  dependency (``pip install xxhash``); without it the model hashes with blake2b-64 behind the same calls, which
  is slower, and the row says so.
* **The Mooncake conversation trace** (``--mooncake``, also in ``--full``; about two minutes): all 12,031
  requests at block size 16 through the engine with prefix caching, once with a pool that keeps every block and
  once with a quarter of it; seconds (goal <= 120 s each) and hit rates against the unbounded bound
  (``kvlab.prefix_hit_bound``).

Wall times depend on what else runs on the machine; the growth ratios (time per request at n vs at the first n)
are the figures to read. ``python benchmarks/bench_engine.py [--quick | --full | --mooncake]``.
"""
from __future__ import annotations

import gc
import hashlib
import time
from collections import deque
from copy import copy
from enum import Enum, auto
from itertools import count
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvlab import Engine, EngineConfig, KVSpec
from kvlab.app.bench import load
from kvlab.serve.claims import prefetch_effect
from kvlab.fast import choose
from kvlab.workloads.traces import load_trace, prefix_hit_bound
from kvlab.workloads.mixes import make_workload

NanoBlock = load("bench_pool").NanoBlock  # nano-vllm's Block: id, ref count, hash, token ids; update, reset


def _time(n: int, memory: str = "paged") -> tuple[float, dict]:
    w = make_workload("chat", n, 0, rate=200.0)
    t = time.perf_counter()
    s = Engine(w, EngineConfig(memory=memory)).run()
    return time.perf_counter() - t, s


# ---------------------------------------------------------------- one engine run, recorded
Ops = list[tuple[Any, ...]]


def record(n: int, seed: int = 0, rate: float = 200.0) -> tuple[Ops, EngineConfig]:
    """The block-manager operations of one engine run of ``n`` chat requests, in order: ``("admit", key,
    prompt, tenant, cached)``, ``("step", [(key, token ids), ...])``, ``("free", key)``."""
    cfg = EngineConfig()
    engine = Engine(make_workload("chat", n, seed, rate=rate), cfg)
    mgr, ops = engine.memory.manager, []
    create, append_tokens, free = mgr.create, mgr.append_tokens, mgr.free

    def admit(prompt: Any = None, *, tenant: str | None = None) -> Any:
        seq = create(prompt, tenant=tenant)
        ops.append(("admit", seq.seq_id, list(prompt), tenant, seq.num_tokens))
        return seq

    def step(seqs: list, new: list) -> list[int]:
        ops.append(("step", [(s.seq_id, list(x)) for s, x in zip(seqs, new)]))
        return append_tokens(seqs, new)

    def release(seq: Any) -> None:
        ops.append(("free", seq.seq_id))
        free(seq)

    mgr.create, mgr.append_tokens, mgr.free = admit, step, release  # type: ignore[method-assign]
    engine.run()
    return ops, cfg


def replay_kvlab(ops: Ops, num_blocks: int, block_size: int) -> int:
    """The operations through what the engine uses, registering as it does: a prefill's full blocks at once, a
    request's generated ones when it is freed. Returns the prompt tokens served from the cache."""
    fast = choose()  # what the engine runs (KVLAB_REFERENCE may name parts to run on the reference)
    pool = fast.pool(num_blocks, spec=KVSpec(block_size=block_size), with_storage=False)
    mgr = fast.manager(pool, prefix_cache=fast.prefix_cache(pool))
    seqs, prompt_left = {}, {}
    append, cache_full = mgr.append_tokens, mgr.cache_full_blocks
    for op in ops:
        if op[0] == "step":
            batch = [seqs[k] for k, _ in op[1]]
            append(batch, [x for _, x in op[1]])
            for seq, (k, x) in zip(batch, op[1]):
                if prompt_left[k] > 0:  # a prefill chunk
                    prompt_left[k] -= len(x)
                    if seq.cacheable and seq.num_tokens // block_size > seq.cached_blocks:
                        cache_full(seq)
        elif op[0] == "admit":
            seq = seqs[op[1]] = mgr.create(op[2], tenant=op[3])
            prompt_left[op[1]] = len(op[2]) - seq.num_tokens
        else:
            seq = seqs.pop(op[1])
            del prompt_left[op[1]]
            if seq.cacheable and seq.num_tokens // block_size > seq.cached_blocks:
                cache_full(seq)
            mgr.free(seq)
    return mgr.prefix_cache.hit_tokens


# ---------------------------------------------------------------- nano-vllm's block manager, as of bb823b3
class _Blake2b64:
    """Stands in for ``xxhash.xxh64`` where xxhash is not installed: the same calls (``update``, ``intdigest``)
    over blake2b with an 8-byte digest, hashlib's nearest equivalent. Slower than xxh64; the row says so."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=8)

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def intdigest(self) -> int:
        return int.from_bytes(self._h.digest(), "little")


try:
    import xxhash  # nano-vllm's hash; a benchmark-only dependency (`pip install xxhash`)
    XXHASH = True
except ImportError:
    xxhash = SimpleNamespace(xxh64=_Blake2b64)  # type: ignore[assignment]
    XXHASH = False


class NanoStatus(Enum):
    """nano-vllm's SequenceStatus."""

    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class NanoSeq:
    """nano-vllm's ``Sequence`` (bb823b3): the same fields set at creation, ``block(i)`` with its range assert
    over the ``num_blocks`` property, ``append_token``. The sampling fields are fixed (no ``SamplingParams``)."""

    block_size = 256  # a class attribute, which nano-vllm's engine sets to the pool's block size
    counter = count()

    def __init__(self, token_ids: list[int]) -> None:
        self.seq_id = next(NanoSeq.counter)
        self.status = NanoStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.is_prefill = True
        self.block_table: list[int] = []
        self.temperature = 1.0
        self.max_tokens = 64
        self.ignore_eos = False

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


class NanoReplayManager:
    """nano-vllm's ``BlockManager`` at commit bb823b3 (``nanovllm/engine/block_manager.py``), method by method:
    block objects, a hash -> block id dict, a deque of free ids, a set of used ids.

    * ``compute_hash`` (a classmethod): a fresh xxh64, the prefix hash as 8 little-endian bytes unless it is -1,
      then ``np.array(token_ids).tobytes()``; ``intdigest()``.
    * ``_allocate_block()``: pops the deque's left end, asserts the block is unreferenced, drops its old hash
      from the dict if the dict still maps it to this block, resets it (ref count 1) and adds it to the used set.
    * ``can_allocate(seq)``: hashes the prompt's blocks but the last, chained, until the first one not in the
      dict or holding other tokens; counts the hits and the new blocks needed (a hit on a used block needs
      none); -1 if the deque is too short, else the hits.
    * ``allocate(seq, hits)``: hashes the hit blocks again and takes each (a used one gains a reference, a free
      one is removed from the deque and added to the used set), then ``_allocate_block()`` for every other
      block; the sequence's cached tokens are the hits' tokens.
    * ``may_append(seq)``: one ``_allocate_block()`` when the sequence's length is 1 past a block boundary.
    * ``hash_blocks(seq)`` (after every forward pass, for every scheduled sequence): hashes the blocks that the
      step's tokens filled, chained on the previous block's stored hash, and registers each.
    * ``deallocate(seq)``: from the table's end, drops a reference and returns a block at 0 to the deque's
      right end (its hash and tokens stay, so a later prompt can hit it)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[Any] = [NanoBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = dict()
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids).tobytes())
        return h.intdigest()

    def _allocate_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: NanoSeq) -> int:
        h, hits, needed = -1, 0, seq.num_blocks
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            hits += 1
            if block_id in self.used_block_ids:
                needed -= 1
        if len(self.free_block_ids) < needed:
            return -1
        return hits

    def allocate(self, seq: NanoSeq, num_cached_blocks: int) -> None:
        assert not seq.block_table
        h = -1
        for i in range(num_cached_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id[h]
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                block.ref_count = 1
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        for _i in range(num_cached_blocks, seq.num_blocks):
            seq.block_table.append(self._allocate_block())
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq: NanoSeq) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: NanoSeq) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: NanoSeq) -> None:
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._allocate_block())

    def hash_blocks(self, seq: NanoSeq) -> None:
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        if start == end:
            return
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id


def replay_nano(ops: Ops, num_blocks: int, block_size: int) -> int:
    """The same operations through :class:`NanoReplayManager`, called as nano-vllm's ``Scheduler`` (bb823b3)
    calls it, with the sequence fields its ``schedule`` and ``postprocess`` set around the calls (no queues,
    statuses or model). Admission: ``can_allocate``, then ``allocate`` with its hits. A prefill chunk: the
    chunk's tokens scheduled, then ``hash_blocks`` and the cached count advanced; the chunk that ends kvlab's
    prefill schedules all nano-vllm has left (its hits can differ from kvlab's). A decoded token: it is appended
    (the previous step's ``postprocess`` appends what it sampled), then ``can_append``, one token scheduled,
    ``may_append``, ``hash_blocks`` and the count advanced. A finished request: the last sampled token appended,
    then ``deallocate``. Returns the prompt tokens found cached."""
    mgr = NanoReplayManager(num_blocks, block_size)
    NanoSeq.block_size = block_size
    seqs, prompt_left, hits = {}, {}, 0
    can_append, may_append, hash_blocks = mgr.can_append, mgr.may_append, mgr.hash_blocks
    for op in ops:
        if op[0] == "step":
            for k, x in op[1]:
                seq = seqs[k]
                left = prompt_left[k]
                if left:  # a prefill chunk
                    left -= len(x)
                    prompt_left[k] = left
                    rest = seq.num_tokens - seq.num_cached_tokens
                    if not rest:
                        continue  # nano-vllm's prefill already ended: it would not schedule this one
                    seq.num_scheduled_tokens = rest if not left else min(len(x), rest)
                    hash_blocks(seq)
                    seq.num_cached_tokens += seq.num_scheduled_tokens
                    seq.num_scheduled_tokens = 0
                else:  # decode: one token a step
                    (token,) = x
                    seq.append_token(token)
                    assert can_append(seq)
                    seq.num_scheduled_tokens = 1
                    seq.is_prefill = False
                    may_append(seq)
                    hash_blocks(seq)
                    seq.num_cached_tokens += seq.num_scheduled_tokens
                    seq.num_scheduled_tokens = 0
        elif op[0] == "admit":
            seq = seqs[op[1]] = NanoSeq(op[2])
            prompt_left[op[1]] = len(op[2]) - op[4]  # kvlab feeds the prompt after what kvlab found cached
            cached = mgr.can_allocate(seq)
            assert cached != -1
            mgr.allocate(seq, cached)
            hits += seq.num_cached_tokens
        else:
            seq = seqs.pop(op[1])
            del prompt_left[op[1]]
            seq.append_token(0)  # the token sampled last, whose id the recording does not hold
            mgr.deallocate(seq)
    return hits


def replay_rows(quick: bool) -> list[dict]:
    n, rounds = (500, 2) if quick else (10_000, 5)
    ops, cfg = record(n)
    best = {"kvlab": float("inf"), "nano": float("inf")}
    hits = {}
    for r in range(rounds):
        for side in (("kvlab", "nano") if r % 2 == 0 else ("nano", "kvlab")):
            replay = replay_kvlab if side == "kvlab" else replay_nano
            gc.collect()
            gc.disable()
            try:
                t = time.perf_counter()
                hits[side] = replay(ops, cfg.num_blocks, cfg.block_size)
                best[side] = min(best[side], time.perf_counter() - t)
            finally:
                gc.enable()
    ratio = best["kvlab"] / best["nano"]
    verdict = "" if quick else (" (met)" if ratio <= 1.0 else " (not met)")
    hashing = "xxhash64" if XXHASH else "blake2b-64: xxhash not installed"
    steps = sum(op[0] == "step" for op in ops)
    return [{"name": f"replay {n} chat requests ({steps} steps), kvlab vs nano-vllm bb823b3 model ({hashing})",
             "value": best["kvlab"], "unit": "s", "baseline": best["nano"], "ratio": ratio,
             "goal": f"<= 1.0x{verdict}"},
            {"name": "  prompt tokens served from cache, kvlab / nano-vllm model", "value": hits["kvlab"],
             "unit": "tokens", "baseline": hits["nano"], "ratio": hits["kvlab"] / max(hits["nano"], 1),
             "goal": None}]


# ---------------------------------------------------------------- the Mooncake conversation trace
def mooncake_rows() -> list[dict]:
    """The whole trace at block size 16, prefix caching on, max_batched_tokens 8192 (vLLM's default) and
    max_model_len the longest request: with a pool that keeps every block, and with a quarter of it."""
    w, B = load_trace("mooncake-conversation"), 16
    prompt = sum(r.prompt_len for r in w.requests)
    bound = prefix_hit_bound(w, B)
    keep = sum(-(-r.total_len // B) for r in w.requests)  # blocks that hold every request at once
    rows = []
    for label, blocks in (("keeps every block", keep), ("a quarter of that", keep // 4)):
        cfg = EngineConfig(num_blocks=blocks, block_size=B, max_model_len=max(r.total_len for r in w.requests),
                           max_batched_tokens=8192)
        t = time.perf_counter()
        s = Engine(w, cfg).run()
        dt = time.perf_counter() - t
        rate = s["prefix_hit_tokens"] / prompt
        rows += [{"name": f"mooncake conversation, {len(w.requests)} requests, pool {label} ({blocks:,} blocks)",
                  "value": dt, "unit": "s", "baseline": None, "ratio": None,
                  "goal": f"<= 120 s ({'met' if dt <= 120 else 'not met'})"},
                 {"name": f"  prefix hit rate (hit / prompt tokens), {s['evictions']:,} evictions",
                  "value": rate, "unit": "", "baseline": bound / prompt, "ratio": s["prefix_hit_tokens"] / bound,
                  "goal": "= the unbounded bound with every block kept" if blocks == keep else None},
                 {"name": "  hit tokens short of the bound", "value": bound - s["prefix_hit_tokens"],
                  "unit": "tokens", "baseline": bound, "ratio": None, "goal": None}]
    return rows


def run(quick: bool, full: bool = False, mooncake: bool = False) -> list[dict]:
    sizes = [500, 2000] if quick else [1000, 10_000, 100_000] if full else [1000, 10_000]
    rows, first, runs = [], None, {}
    for n in sizes:
        dt, s = _time(n)
        runs[n] = s
        first = first or (n, dt)
        rows.append({"name": f"paged {n} chat requests", "value": dt, "unit": "s", "baseline": None, "ratio": None,
                     "goal": "<= 10 s" if n == 10_000 else None})
        rows.append({"name": f"  steps/s ({n})", "value": s["steps"] / dt, "unit": "steps/s", "baseline": None,
                     "ratio": None, "goal": None})
        rows.append({"name": f"  requests/s ({n})", "value": n / dt, "unit": "req/s", "baseline": None,
                     "ratio": None, "goal": None})
        if n != first[0]:
            rows.append({"name": f"  time growth {first[0]} -> {n}", "value": dt / first[1], "unit": "x",
                         "baseline": n / first[0], "ratio": (dt / first[1]) / (n / first[0]),
                         "goal": "ratio ~1 (linear)"})
    n = sizes[0]
    _, base = _time(n, "contiguous")
    paged = runs[n]
    rows.append({"name": f"throughput paged vs contiguous ({n})", "value": paged["throughput_tok_s"],
                 "unit": "tok/sim-s", "baseline": base["throughput_tok_s"],
                 "ratio": paged["throughput_tok_s"] / base["throughput_tok_s"], "goal": "text claims 3x"})
    pf = prefetch_effect(requests=20 if quick else 40)
    on, off = pf["prefetch"], pf["no prefetch"]
    rows.append({"name": "swap-in stall with vs without prefetch", "value": on["swap_in_stall_s"],
                 "unit": "sim-s", "baseline": off["swap_in_stall_s"],
                 "ratio": on["swap_in_stall_s"] / off["swap_in_stall_s"], "goal": "< 1"})
    rows += replay_rows(quick)
    if full or mooncake:
        rows += mooncake_rows()
    return rows


if __name__ == "__main__":
    import sys

    from kvlab.app.bench import run_script

    run_script(lambda quick: run(quick, full="--full" in sys.argv, mooncake="--mooncake" in sys.argv))
