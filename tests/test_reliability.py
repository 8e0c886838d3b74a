"""System-wide reliability: one state machine over pool + sequences + allocator + prefix cache +
defragmentation, threads hammering one pool, a catalogue of bad input, and resource limits.

Quick profile by default; ``KVLAB_LONG=1`` (``make test-long``) runs the long profile (>= 1,000 examples).
"""
from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvlab
from _util import assert_same_state, pool_state, small_spec
from kvlab import (BlockPool, BlockStatus, ConfigError, DefragmentationStrategy, DoubleFreeError, DynamicAllocator,
                   IllegalTransitionError, KVDataError, KVLabError, OutOfBlocksError, RefcountUnderflowError,
                   UnknownBlockError)
from kvlab.fast.pool import FastBlockPool, PyFastBlockPool
from kvlab.core.sequence import SequenceManager
from kvlab.textbook.pool import KVBlock, TextbookPool

LONG = os.environ.get("KVLAB_LONG") == "1"
SPEC = small_spec(block_size=4)


def kv_of(token_ids: list[int], start: int = 0) -> torch.Tensor:
    """K/V as a pure function of (token id, position, layer, k/v, head, dim): ``[layers, 2, n, heads, dim]``.
    Equal prefixes give equal K/V, so a prefix-cache hit must read back exactly what it would have computed."""
    n = len(token_ids)
    tok = torch.tensor(token_ids, dtype=torch.float32).view(1, 1, n, 1, 1) * 1000
    pos = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1, 1)
    lay = torch.arange(SPEC.num_layers, dtype=torch.float32).view(-1, 1, 1, 1, 1) * 1e5
    kv = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1) * 5e5
    hd = torch.arange(SPEC.num_kv_heads * SPEC.head_dim, dtype=torch.float32).view(SPEC.num_kv_heads, SPEC.head_dim)
    return (tok + pos + lay + kv + hd / 64).to(SPEC.device)


class SystemMachine(RuleBasedStateMachine):
    """Sequences with a prefix cache, raw blocks served by the DynamicAllocator (with a wait queue), evictions
    and defragmentation, all on one pool. After every step: the invariants of the pool and the sequence manager,
    every token's K/V of every live sequence, and every raw block's pattern, bitwise."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(20, spec=SPEC)
        self.mgr = SequenceManager(self.pool, prefix_cache=True)
        self.alloc = DynamicAllocator(self.pool)
        self.defrag = DefragmentationStrategy(self.pool)
        self.raw: dict[int, float] = {}  # raw block -> pattern value
        self.waiting: list = []
        self.stamp = 0.0
        self.pool.relocation_hooks.append(self._moved)

    def _moved(self, src, dst) -> None:
        for a, b in zip(src.tolist(), dst.tolist()):
            if a in self.raw:
                self.raw[b] = self.raw.pop(a)

    def _fill(self, ticket) -> None:
        self.stamp += 1
        ticket.block.kv_data.fill_(self.stamp)
        self.raw[ticket.block.block_id] = self.stamp

    def _served(self, tickets) -> None:
        for t in tickets:
            if t.served:
                self.waiting.remove(t)
                self._fill(t)

    def resident(self):
        return [s for s in self.mgr.seqs.values() if s.swapped is None]

    def _append(self, seq, ids: list[int]) -> bool:
        try:
            slots = seq.append(ids)
        except OutOfBlocksError:
            return False
        kv = kv_of(ids, seq.num_tokens - len(ids))
        for layer in range(SPEC.num_layers):
            self.pool.storage.write_slots(layer, slots, kv[layer, 0], kv[layer, 1])
        return True

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5]]),
          tail=st.lists(st.integers(1, 9), max_size=5), tenant=st.sampled_from([None, "b"]))
    def create(self, prefix, tail, tenant) -> None:
        prompt = prefix + tail
        seq = self.mgr.create(prompt, tenant=tenant)
        if not self._append(seq, prompt[seq.num_tokens:]):
            seq.free()
            return
        self.mgr.cache_full_blocks(seq)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), ids=st.lists(st.integers(1, 9), min_size=1, max_size=6))
    def append(self, data, ids) -> None:
        self._append(data.draw(st.sampled_from(self.resident())), ids)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data) -> None:
        data.draw(st.sampled_from(self.resident())).fork()

    @precondition(lambda self: self.mgr.seqs)
    @rule(data=st.data())
    def free_seq(self, data) -> None:
        data.draw(st.sampled_from(list(self.mgr.seqs.values()))).free()
        self._served(self.alloc.handle_wait_queue())

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        data.draw(st.sampled_from(self.resident())).swap_out()

    @precondition(lambda self: any(s.swapped for s in self.mgr.seqs.values()))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        seq = data.draw(st.sampled_from([s for s in self.mgr.seqs.values() if s.swapped]))
        try:
            seq.swap_in()
        except OutOfBlocksError:
            assert seq.swapped is not None

    @rule()
    def request_raw(self) -> None:
        t = self.alloc.allocate_optimal_block(owner=999)
        self._served(list(self.waiting))  # older waiters are served first, when a free through the pool made room
        if t.served:
            self._fill(t)
        else:
            self.waiting.append(t)

    @precondition(lambda self: self.raw)
    @rule(data=st.data())
    def free_raw(self, data) -> None:
        b = data.draw(st.sampled_from(sorted(self.raw)))
        del self.raw[b]
        self._served(self.alloc.deallocate_block(b))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        t = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(t)
        self._served(self.alloc.cancel(t))

    @rule()
    def evict(self) -> None:
        self.pool.evict()

    @rule(cap=st.one_of(st.none(), st.integers(1, 4)))
    def defragment(self, cap) -> None:
        self.defrag.defragment(force=True, max_moves=cap)

    @invariant()
    def everything_holds(self) -> None:
        self.pool.check_invariants()
        self.mgr.check_invariants(exclusive=False)  # raw blocks hold references too
        for seq in self.resident():
            slots = seq.slots()
            want = kv_of(seq.token_ids)
            for layer in range(SPEC.num_layers):
                k, v = self.pool.storage.read_slots(layer, slots)
                assert torch.equal(k, want[layer, 0]) and torch.equal(v, want[layer, 1]), seq.seq_id
        for b, value in self.raw.items():
            assert self.pool.fields.status[b] == BlockStatus.ALLOCATED and self.pool.fields.owner[b] == 999
            assert bool((KVBlock(self.pool, b).kv_data == value).all()), b


TestSystem = SystemMachine.TestCase
TestSystem.settings = settings(max_examples=1000 if LONG else 40, stateful_step_count=60 if LONG else 30,
                               deadline=None, suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------------------------------- concurrency
@pytest.mark.parametrize("cls, listen", [(BlockPool, False), (PyFastBlockPool, False), (FastBlockPool, False),
                                         (FastBlockPool, True)])
def test_eight_threads_ten_thousand_operations_each(cls, listen):
    """8 threads x 10,000 mixed operations on one pool; a watchdog fails the test instead of hanging. With a
    subscriber, every event must arrive in clock order (one lock covers a change and its event)."""
    pool = cls(512, spec=SPEC, with_storage=False)
    errors: list[BaseException] = []
    steps: list[int] = []
    if listen:
        pool.events.subscribe(lambda e: steps.append(e.step))

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []  # one entry per reference this thread holds
        try:
            for _ in range(10_000):
                r = rng.random()
                if r < 0.3:
                    try:
                        got = pool.allocate(rng.randint(1, 8) if rng.random() < 0.8 else rng.randint(9, 40))
                    except OutOfBlocksError:
                        continue
                    mine.extend(got)
                    if rng.random() < 0.3:
                        pool.mark_reusable(got)
                elif r < 0.5 and mine:
                    b = rng.choice(mine)
                    pool.incref([b])
                    mine.append(b)
                elif r < 0.9 and mine:
                    batch = [mine.pop(rng.randrange(len(mine))) for _ in range(min(rng.randint(1, 40), len(mine)))]
                    pool.free(batch)  # repeats drop several of this thread's references in one call
                elif r < 0.95:
                    pool.evict()
                else:
                    pool.snapshot()
            if mine:
                pool.free(mine)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "deadlock: a worker did not finish within the watchdog"
    assert not errors, errors[:3]
    pool.check_invariants()
    assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks  # every reference came back
    assert steps == sorted(steps) and (not listen or len(steps) > 10_000)


# ---------------------------------------------------------------------------------------------- bad input
def _populated() -> tuple[BlockPool, list[int]]:
    pool = BlockPool(16, spec=SPEC)
    ids = pool.allocate(6)
    KVBlock(pool, ids[0]).kv_data.fill_(3.0)
    pool.mark_reusable(ids[4:5])
    pool.free(ids[4:])  # ids[4] cached, ids[5] FREE
    return pool, ids


GOOD_KV = torch.zeros(2, SPEC.num_layers, 2, SPEC.num_kv_heads, SPEC.head_dim)
CATALOGUE = [
    # (label, call(pool, ids), error)
    ("allocate n<0", lambda p, i: p.allocate(-1), ConfigError),
    ("allocate n not int", lambda p, i: p.allocate("3"), ConfigError),
    ("allocate too many", lambda p, i: p.allocate(99), OutOfBlocksError),
    ("allocate bad size class", lambda p, i: p.allocate(2, size_class=3), ConfigError),
    ("free unknown id", lambda p, i: p.free([16]), UnknownBlockError),
    ("free negative id", lambda p, i: p.free([-1]), UnknownBlockError),
    ("free float id", lambda p, i: p.free([1.0]), UnknownBlockError),
    ("free str id", lambda p, i: p.free(["1"]), UnknownBlockError),
    ("free 2-D ids", lambda p, i: p.free([[1]]), UnknownBlockError),
    ("double free", lambda p, i: p.free([i[5]]), DoubleFreeError),
    ("free cached block", lambda p, i: p.free([i[4]]), DoubleFreeError),
    ("free twice in one batch", lambda p, i: p.free([i[1], i[1]]), DoubleFreeError),
    ("free batch with a freed block", lambda p, i: p.free(i[:2] + [i[5]]), DoubleFreeError),
    ("decref a cached block", lambda p, i: p.decref([i[4]]), RefcountUnderflowError),
    ("decref a FREE block", lambda p, i: p.decref([i[5]]), IllegalTransitionError),
    ("decref batch past zero", lambda p, i: p.decref([i[2]] * 2), RefcountUnderflowError),
    ("incref a FREE block", lambda p, i: p.incref([i[5]]), IllegalTransitionError),
    ("incref unknown", lambda p, i: p.incref([1 << 40]), UnknownBlockError),
    ("commit an ALLOCATED block", lambda p, i: p.commit([i[0]]), IllegalTransitionError),
    ("evicting a FREE block", lambda p, i: p.begin_eviction([i[5]]), IllegalTransitionError),
    ("finish eviction not started", lambda p, i: p.finish_eviction([i[0]]), IllegalTransitionError),
    ("release a referenced block", lambda p, i: p.release_cached(i[0]), IllegalTransitionError),
    ("release a FREE block", lambda p, i: p.release_cached(i[5]), IllegalTransitionError),
    ("split a uniform block", lambda p, i: p.split_block(i[5]), IllegalTransitionError),
    ("migrate into a used block", lambda p, i: p.migrate([i[0]], [i[1]]), IllegalTransitionError),
    ("migrate a FREE block", lambda p, i: p.migrate([i[5]], [10]), IllegalTransitionError),
    ("migrate uneven lists", lambda p, i: p.migrate([i[0]], [10, 11]), ConfigError),
    ("token count too large", lambda p, i: p.set_token_count(i[0], 5), KVDataError),
    ("token count on FREE", lambda p, i: p.set_token_count(i[5], 1), IllegalTransitionError),
    ("mark a FREE block reusable", lambda p, i: p.mark_reusable([i[5]]), IllegalTransitionError),
    ("allocate_block a used block", lambda p, i: TextbookPool(p).allocate_block(i[0]), IllegalTransitionError),
    ("allocate_block wrong shape", lambda p, i: TextbookPool(p).allocate_block(10, torch.zeros(2, 2, 2, 3, 4)),
     KVDataError),
    ("allocate_block wrong dtype", lambda p, i: TextbookPool(p).allocate_block(10, GOOD_KV.double()), KVDataError),
    ("allocate_block too many tokens", lambda p, i: TextbookPool(p).allocate_block(10, torch.zeros(2, 2, 5, 2, 4)),
     KVDataError),
    ("allocate_block not a tensor", lambda p, i: TextbookPool(p).allocate_block(10, [[0.0]]), KVDataError),
    ("get_best_block negative", lambda p, i: TextbookPool(p).get_best_block(-5), ConfigError),
    ("KVBlock of an inner id", lambda p, i: KVBlock(p, 99), UnknownBlockError),
    ("write_slots mismatched k/v", lambda p, i: p.storage.write_slots(0, [0, 1], torch.zeros(2, 2, 4),
                                                                       torch.zeros(3, 2, 4)), KVDataError),
    ("write_slots wrong heads", lambda p, i: p.storage.write_slots(0, [0], torch.zeros(1, 1, 4),
                                                                    torch.zeros(1, 1, 4)), KVDataError),
    ("copy_blocks uneven", lambda p, i: p.storage.copy_blocks([0], [1, 2]), KVDataError),
    ("scatter_blocks wrong shape", lambda p, i: p.storage.scatter_blocks([0], torch.zeros(2, 2, 2, 4, 2, 4)),
     KVDataError),
    ("allocator bad size class", lambda p, i: DynamicAllocator(p).allocate_optimal_block(size_class=7), ConfigError),
    ("allocator tokens too many", lambda p, i: DynamicAllocator(p).allocate_optimal_block(tokens=99), KVDataError),
    ("allocator negative timeout", lambda p, i: DynamicAllocator(p).allocate_optimal_block(timeout=-1), ConfigError),
    ("allocator two sizes", lambda p, i: DynamicAllocator(p).allocate_optimal_block(tokens=1, size_class=0),
     ConfigError),
    ("allocator deallocate FREE", lambda p, i: DynamicAllocator(p).deallocate_block(i[5]), DoubleFreeError),
    ("sequence on a freed sequence", lambda p, i: _freed_seq(p).append(1), IllegalTransitionError),
    ("sequence append bad K/V tokens", lambda p, i: SequenceManager(p).create().append(-1), KVLabError),
]


def _freed_seq(pool: BlockPool):
    seq = SequenceManager(pool).create()
    seq.free()
    return seq


@pytest.mark.parametrize("label,call,error", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_gets_typed_error_and_changes_nothing(label, call, error):
    pool, ids = _populated()
    before = pool_state(pool)
    with pytest.raises(error) as info:
        call(pool, ids)
    assert isinstance(info.value, KVLabError)
    assert str(info.value), "the message must say what is wrong"
    assert_same_state(before, pool_state(pool))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_blocks=0), ConfigError, r"an int in 1\.\."),
    (dict(num_blocks=4, total_memory=1 << 20), ConfigError, "exactly one"),
    (dict(total_memory=3), ConfigError, "holds no block"),
    (dict(num_blocks=8, block_sizes=[4, 6]), ConfigError, "power-of-two"),
    (dict(num_blocks=8, block_sizes=[]), ConfigError, "positive ints"),
    (dict(num_blocks=8, eviction_policy="mru"), ConfigError, "unknown eviction policy"),
    (dict(num_blocks=10**9), ConfigError, "blocks fit"),
])
def test_bad_pool_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        BlockPool(spec=small_spec(head_dim=4096, num_layers=64), **kwargs)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("head_dim", -1), ("block_size", 2.5),
                                         ("num_kv_heads", True), ("dtype", "float32")])
def test_bad_spec(field, value):
    with pytest.raises(ConfigError, match=field if field != "dtype" else "dtype"):
        small_spec(**{field: value})


@pytest.mark.parametrize("suffix,text,line", [
    (".jsonl", '{"id": 0, "arrival": 0.0, "prompt_len": 5, "output_len": 3}\n{"id": 1, "arrival": \n', 2),
    (".jsonl", '{"id": 0, "arrival": 0.0, "prompt_len": -5, "output_len": 3}\n', 1),
    (".csv", "id,arrival,prompt_len,output_len\n0,0.0,5,3\n1,0.5,five,3\n", 3),
])
def test_malformed_trace_names_the_line(tmp_path: Path, suffix, text, line):
    path = tmp_path / f"trace{suffix}"
    path.write_text(text)
    with pytest.raises(kvlab.TraceFormatError) as info:
        kvlab.read_trace(path)
    assert info.value.line == line and f"line {line}" in str(info.value)


def test_unknown_names_are_typed_errors():
    with pytest.raises(ConfigError, match="mru"):
        kvlab.make_policy("mru")
    with pytest.raises(KVLabError):
        kvlab.make_workload("poetry", 10)
    with pytest.raises(KVLabError):
        kvlab.ChunkSizeOptimizer().recommend_chunk_size("fastest")
