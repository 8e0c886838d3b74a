"""Prefix cache: storing a 2,000-token prompt (block size 16: 125 full blocks) and a full hit on it, against a
vLLM-style hash chain + dict written here, each the whole path of the call.

* **vLLM-style** (the peer's v1 design: ``kv_cache_utils.hash_block_tokens`` and ``BlockPool.cache_full_blocks``
  / ``find_longest_cache_hit`` / ``touch``, built on the block objects, linked free queue and hash map of
  ``bench_pool.VllmStylePool``, which are calibrated against the real pool): a block's hash is
  ``sha256(pickle.dumps((parent_hash, tuple(token_ids), extra_keys)))`` (the peer's default hash, no extra keys);
  *store* hashes every block of the prompt (the request's block hasher) and, per block, makes the key with the
  group id, sets it on the block and inserts it in the hash map; a *hit* hashes the prompt (a new request does),
  looks the keys up until the first miss, and touches the blocks found (refcount +1, taken off the free queue
  when it was 0).
* **kvlab**: its public API on what the engine uses (``FastBlockPool``, metadata only, and ``FastPrefixCache``,
  the prefix cache whose token-id check runs in C where kvlab is compiled): *store* is
  ``PrefixCache.store_blocks(blocks, token_ids)`` (validation, blake2b chain, one ``mark_reusable``, entries),
  a *hit* is ``PrefixCache.match(token_ids)`` (validation, chain walk comparing each block's tokens, one
  ``incref``, counters and reuse gaps).

Each variant runs on a fresh structure built before the clock starts (a store needs unregistered blocks, a hit
cached ones), the variants alternate call by call, the garbage collector is off while timing and the figure is
the best of the rounds. Goal: each ratio <= 1.0. ``python benchmarks/bench_prefix.py [--quick]``.
"""
from __future__ import annotations

import gc
import hashlib
import pickle
import random
import time
from collections.abc import Callable

from kvlab import FastBlockPool, KVSpec
from kvlab.app.bench import load
from kvlab.fast.pool import FastPrefixCache

PROMPT, B = 2000, 16
_pool_bench = load("bench_pool")
VllmStylePool, VllmBlock = _pool_bench.VllmStylePool, _pool_bench.VllmBlock


# ---------------------------------------------------------------- the vLLM-style hash chain
def sha256_block_hash(parent: bytes | None, token_ids: tuple[int, ...], extra_keys: object = None) -> bytes:
    """The peer's default block hash: sha256 of the pickled (parent hash, token ids, extra keys)."""
    return hashlib.sha256(pickle.dumps((parent, token_ids, extra_keys), protocol=pickle.HIGHEST_PROTOCOL)).digest()


def request_block_hashes(token_ids: list[int], block_size: int = B) -> list[bytes]:
    """The hashes of a request's full blocks, each chained on the one before (the peer's block hasher)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = sha256_block_hash(parent, tuple(token_ids[start:start + block_size]), None)
        hashes.append(parent)
    return hashes


def with_group(block_hash: bytes, group: int = 0) -> bytes:
    """The peer's hash-map key: the block hash and the KV-cache group id."""
    return block_hash + group.to_bytes(4, "big")


def remove_from_free_queue(pool: VllmStylePool, block: VllmBlock) -> None:
    """The peer's O(1) removal of a block from the middle of the linked free queue (a hit on a cached block)."""
    block.prev_free.next_free = block.next_free
    block.next_free.prev_free = block.prev_free
    block.prev_free = block.next_free = None
    pool.free_block_queue.num_free_blocks -= 1


def vllm_store(pool: VllmStylePool, blocks: list[VllmBlock], token_ids: list[int]) -> None:
    """A request's full blocks become cached: its block hashes, then per block the key, the block's hash field
    and the hash map (the peer's ``cache_full_blocks``)."""
    hashes = request_block_hashes(token_ids)
    for blk, block_hash in zip(blocks, hashes):
        if blk.is_null:
            continue
        key = with_group(block_hash)
        blk.set_block_hash(key)
        pool.cached_block_hash_to_block.insert(key, blk)


def vllm_hit(pool: VllmStylePool, token_ids: list[int]) -> list[VllmBlock]:
    """A new request's prefix lookup: its block hashes, the longest run of cached keys, each block touched."""
    hit: list[VllmBlock] = []
    for block_hash in request_block_hashes(token_ids):
        got = pool.cached_block_hash_to_block._cache.get(with_group(block_hash))
        if got is None:
            break
        hit.append(got if isinstance(got, VllmBlock) else next(iter(got.values())))
    for block in hit:  # touch
        if block.ref_cnt == 0 and not block.is_null:
            remove_from_free_queue(pool, block)
        block.ref_cnt += 1
    return hit


# ---------------------------------------------------------------- the two sides, each on a fresh structure
def prompt_ids(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(PROMPT)]


def vllm_store_case(tokens: list[int]) -> Callable[[], None]:
    pool = VllmStylePool(PROMPT // B + 8)
    blocks = pool.get_new_blocks(PROMPT // B)
    return lambda: vllm_store(pool, blocks, tokens)


def vllm_hit_case(tokens: list[int]) -> Callable[[], None]:
    pool = VllmStylePool(PROMPT // B + 8)
    blocks = pool.get_new_blocks(PROMPT // B)
    vllm_store(pool, blocks, tokens)
    pool.free_blocks(reversed(blocks))  # cached at refcount 0, on the free queue
    return lambda: vllm_hit(pool, tokens)


def kvlab_store_case(tokens: list[int]) -> Callable[[], None]:
    pool = FastBlockPool(PROMPT // B + 8, spec=KVSpec(block_size=B), with_storage=False)
    cache = FastPrefixCache(pool)
    blocks = pool.allocate(PROMPT // B)
    return lambda: cache.store_blocks(blocks, tokens)


def kvlab_hit_case(tokens: list[int]) -> Callable[[], None]:
    pool = FastBlockPool(PROMPT // B + 8, spec=KVSpec(block_size=B), with_storage=False)
    cache = FastPrefixCache(pool)
    blocks = pool.allocate(PROMPT // B)
    cache.store_blocks(blocks, tokens)
    pool.free(blocks[::-1])  # cached at refcount 0
    return lambda: cache.match(tokens)


def best_of(cases: dict[str, Callable[[list[int]], Callable[[], None]]], rounds: int, reps: int) -> dict[str, float]:
    """Best time in seconds of one call per variant: each call on a structure built before the clock starts,
    the variants alternating call by call, the collector off while timing."""
    tokens = prompt_ids()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for _ in range(reps):
            for name, make in cases.items():
                call = make(tokens)
                gc.disable()
                try:
                    t = time.perf_counter()
                    call()
                    best[name] = min(best[name], time.perf_counter() - t)
                finally:
                    gc.enable()
    return best


def run(quick: bool = False) -> list[dict]:
    rounds, reps = (2, 3) if quick else (7, 20)
    rows = []
    for what, cases, goal in (
            ("store", {"kvlab": kvlab_store_case, "vllm": vllm_store_case}, 1.0),
            ("full hit", {"kvlab": kvlab_hit_case, "vllm": vllm_hit_case}, 1.0)):
        t = best_of(cases, rounds, reps)
        ratio = t["kvlab"] / t["vllm"]
        verdict = "" if quick else (" (met)" if ratio <= goal else " (not met)")
        rows.append({"name": f"prefix {what}, {PROMPT}-token prompt, B={B} ({PROMPT // B} blocks)",
                     "value": t["kvlab"] * 1e6, "unit": "us", "baseline": t["vllm"] * 1e6, "ratio": ratio,
                     "goal": f"<= {goal}x vLLM-style{verdict}"})
    return rows


if __name__ == "__main__":
    from kvlab.app.bench import run_script

    run_script(run)
