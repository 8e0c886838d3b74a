"""Prefix cache: chained hashes, hits with references and verification, tenants, stats and events, cached blocks
at refcount 0, tail-first eviction without orphans, stale entries, migration, and a property test."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from kvlab import BlockPool, BlockStatus, EventRecorder, IllegalTransitionError, KVDataError, KVSpec, OutOfBlocksError
import kvlab.core.prefix as prefix_mod
from kvlab.core.prefix import PrefixCache, PrefixEvicted, PrefixHit, PrefixStored
from kvlab.core.sequence import SequenceManager
from kvlab.textbook.pool import KVBlock

from _util import pool_state, same_state

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, device="cpu")


def make(num_blocks=32):
    pool = BlockPool(num_blocks, spec=SPEC)
    return pool, SequenceManager(pool, prefix_cache=True)


def run(mgr, prompt, tenant=None):
    """Create a sequence for ``prompt``, append the uncached part, write K/V that encode the token ids, and
    register its full blocks (what a model step does)."""
    s = mgr.create(prompt, tenant=tenant)
    rest = prompt[s.num_tokens:]
    slots = s.append(rest)
    kv = torch.tensor(rest, dtype=torch.float32)[:, None, None].expand(-1, 1, 4).contiguous()
    mgr.pool.storage.write_slots(0, slots, kv, -kv)
    mgr.cache_full_blocks(s)
    return s


def test_hash_chains_through_parent_and_tenant():
    h = PrefixCache.block_hash
    a = h(None, [1, 2, 3, 4])
    assert a == h(None, [1, 2, 3, 4]) and len(a) == 16
    assert h(a, [5, 6, 7, 8]) != h(h(None, [0, 2, 3, 4]), [5, 6, 7, 8])  # same block, other prefix
    assert h(None, [1, 2, 3, 4], "alice") not in {a, h(None, [1, 2, 3, 4], "bob")}


def test_hit_reuses_blocks_with_references_and_stats():
    pool, mgr = make()
    rec = EventRecorder(pool.events)
    a = run(mgr, list(range(10)))
    assert a.cached_blocks == 2 and [e.block_id for e in rec.of(PrefixStored)] == a.block_table[:2]
    b = run(mgr, list(range(8)) + [50, 51, 52])
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert [pool.fields.refcount[x] for x in a.block_table[:2]] == [2, 2]
    stats = mgr.prefix_cache.get_stats()
    assert stats["requests"] == 2 and stats["queries"] == 4 and stats["hits"] == 2
    assert stats["hit_rate"] == 0.5 and stats["tokens_saved"] == 8
    hit = rec.of(PrefixHit)[0]
    assert hit.block_ids == tuple(a.block_table[:2]) and hit.tokens == 8
    mgr.check_invariants()


def test_a_prompt_never_fully_matches():
    pool, mgr = make()
    run(mgr, list(range(8)))
    s = mgr.create(list(range(8)))
    assert s.num_tokens == 4  # one token of the prompt is always left to compute (its logits are needed)


def test_cached_blocks_survive_refcount_zero_and_serve_hits():
    pool, mgr = make()
    a = run(mgr, list(range(13)))
    head, partial = a.block_table[:3], a.block_table[3]
    a.free()
    assert all(KVBlock(pool, b).is_cached for b in head) and pool.fields.status[partial] == BlockStatus.FREE
    b = mgr.create(list(range(13)))
    assert b.block_table == head
    assert torch.equal(pool.storage.read_slots(0, b.slots())[0][:, 0, 0], torch.arange(12.0))


def test_tenants_do_not_share():
    pool, mgr = make()
    run(mgr, list(range(9)), tenant="alice")
    assert mgr.create(list(range(9)), tenant="bob").num_tokens == 0
    assert mgr.create(list(range(9)), tenant="alice").num_tokens == 8


def route_hashes(monkeypatch, fake):
    """Make every hash the prefix cache computes ``fake(parent, token_ids, tenant)``: the public
    ``PrefixCache.block_hash`` and the module's inner-loop helper. Each test then checks, through
    the PrefixStored events, that the cache really stored under the fake hashes."""
    monkeypatch.setattr(PrefixCache, "block_hash",
                        staticmethod(lambda parent, toks, tenant=None: fake(parent, list(toks), tenant)))
    monkeypatch.setattr(prefix_mod, "_hash",  # the inner loop's: token ids as int64 bytes (no tenant in these tests)
                        lambda parent, chunk, salted: fake(parent, np.frombuffer(chunk, dtype=np.int64).tolist(), None))


def blind_to_last_token(parent, toks, tenant):
    """A chained hash that ignores each block's last token: blocks differing only there collide."""
    return hashlib.blake2b((parent or b"") + repr((tenant, toks[:-1])).encode(), digest_size=16).digest()


def test_token_ids_are_verified_on_hit(monkeypatch):
    # every block hashes alike from the start, so the stored block and the new prompt collide
    route_hashes(monkeypatch, lambda parent, toks, tenant: b"x" * 16)
    pool, mgr = make()
    rec = EventRecorder(pool.events)
    a = run(mgr, [1, 2, 3, 4, 5])
    assert [e.digest for e in rec.of(PrefixStored)] == [(b"x" * 16).hex()]  # stored under the colliding hash
    assert mgr.prefix_cache.holds(a.block_table[0])
    s = mgr.create([9, 9, 9, 9, 9])
    assert s.num_tokens == 0 and s.block_table == []  # same hash, other tokens: a miss, not wrong data
    assert mgr.prefix_cache.peek([9, 9, 9, 9, 9]) == []
    assert mgr.create([1, 2, 3, 4, 5]).block_table == a.block_table[:1]  # the same tokens still hit
    mgr.check_invariants()


def test_a_collision_inside_a_chain_stops_the_hit_there(monkeypatch):
    """The second block of the new prompt collides with the cached one (it differs only in its last token). The
    hit must stop after the first block, and every token's K/V must be the prompt's own."""
    route_hashes(monkeypatch, blind_to_last_token)
    pool, mgr = make()
    rec = EventRecorder(pool.events)
    a = run(mgr, list(range(13)))  # 3 full blocks registered
    h0 = blind_to_last_token(None, [0, 1, 2, 3], None)
    assert [e.digest for e in rec.of(PrefixStored)][:2] == [h0.hex(), blind_to_last_token(h0, [4, 5, 6, 7], None).hex()]
    prompt = list(range(7)) + [99] + list(range(8, 13))  # block 1 ends in 99 instead of 7: the same hash
    assert mgr.prefix_cache.peek(prompt) == a.block_table[:1]
    s = run(mgr, prompt)
    assert s.num_cached_tokens == 4 and s.block_table[0] == a.block_table[0]
    assert s.block_table[1] != a.block_table[1]
    assert torch.equal(pool.storage.read_slots(0, s.slots())[0][:, 0, 0], torch.tensor(prompt, dtype=torch.float32))
    assert [e.block_ids for e in rec.of(PrefixHit)] == [tuple(a.block_table[:1])]
    assert mgr.prefix_cache.get_stats()["hits"] == 1
    mgr.check_invariants()


def test_eviction_takes_tails_before_heads():
    pool, mgr = make(8)
    rec = EventRecorder(pool.events)
    a = run(mgr, list(range(17)))  # 4 full blocks cached + 1 partial
    chain = a.block_table[:4]
    a.free()
    b = mgr.create()
    b.append(4 * 7)  # 7 blocks: 4 free (3 + the partial tail) + 3 evicted from the cached chain of 4
    evicted = [e.block_id for e in rec.of(PrefixEvicted)]
    assert evicted == chain[::-1][:3]
    assert mgr.prefix_cache.holds(chain[0]) and len(mgr.prefix_cache) == 1
    assert mgr.create(list(range(17))).num_tokens == 4  # the head still serves
    mgr.check_invariants()


def test_guard_vetoes_a_head_whose_child_is_cached():
    pool, mgr = make(8)
    a = run(mgr, list(range(9)))
    head, child = a.block_table[:2]
    a.free()
    pool.policy.discard(child)  # re-queue the child so that LRU would pick the head first ...
    pool.policy.add(child)
    assert [b for b, _ in pool.policy.order()][0] == head
    assert pool.evict() == child  # ... but the guard makes it take the tail


def test_stale_entry_is_not_served():
    pool, mgr = make()
    a = run(mgr, list(range(9)))
    head = a.block_table[0]
    a.free()
    pool.release_cached(head)  # dropped behind the cache's back
    other = mgr.create()
    other.append(4 * pool.num_free_blocks)
    s = mgr.create(list(range(9)))
    assert s.num_tokens == 0 and not mgr.prefix_cache.holds(head)


def test_migration_keeps_entries_pointing_at_the_data():
    pool, mgr = make(16)
    a = run(mgr, list(range(9)))
    old = a.block_table[:2]
    a.free()
    free = [b for b in range(16) if pool.fields.status[b] == BlockStatus.FREE][-2:]
    pool.migrate(old, free)
    s = mgr.create(list(range(9)))
    assert s.block_table == free
    assert torch.equal(pool.storage.read_slots(0, s.slots())[0][:, 0, 0], torch.arange(8.0))


def test_swap_keeps_prefix_blocks_resident():
    pool, mgr = make()
    a = run(mgr, list(range(10)))
    cached = a.block_table[:2]
    a.append(list(range(10, 15)))  # private blocks 2 and 3 holding 4 and 3 tokens
    private = a.block_table[2:]
    a.swap_out()
    assert a.block_table[:2] == cached and a.block_table[2:] == [-1, -1]
    assert a.swapped.positions == [2, 3] and a.swapped.tokens == [4, 3]
    mgr.check_invariants()
    a.swap_in()
    assert a.block_table[:2] == cached
    assert a.block_table[2:] == private[::-1]  # the free stack hands the blocks back in the other order
    assert [pool.fields.tokens[b] for b in a.block_table] == [4, 4, 4, 3]  # each count back at its position
    mgr.check_invariants()
    assert mgr.create(list(range(10))).block_table == cached


def test_store_rejects_bad_blocks():
    pool, mgr = make()
    cache = mgr.prefix_cache
    with pytest.raises(IllegalTransitionError, match="FREE"):
        cache.store(0, [1, 2, 3, 4], None)
    b = pool.allocate()[0]
    with pytest.raises(KVDataError, match="full blocks"):
        cache.store(b, [1, 2], None)
    with pytest.raises(IllegalTransitionError, match="parent hash"):
        cache.store(b, [1, 2, 3, 4], b"y" * 16)
    assert len(cache) == 0 and not pool.fields.reusable[b]


def write_kv(mgr, seq, new_tokens):
    """Append ``new_tokens`` to ``seq`` and write K/V that encode the token ids (as :func:`run` does)."""
    slots = seq.append(new_tokens)
    kv = torch.tensor(new_tokens, dtype=torch.float32)[:, None, None].expand(-1, 1, 4).contiguous()
    mgr.pool.storage.write_slots(0, slots, kv, -kv)


def test_a_prefix_computed_twice_is_kept_once_and_what_follows_is_registered():
    """Two requests with the same 8-token document computed it at once (both missed). The second to register
    takes the first's blocks, as a hit would have given them, frees its own copies, and registers its later
    blocks behind them (vLLM registers them too), so a third request continuing the second's prompt hits all
    of it, reading the K/V the second wrote."""
    pool, mgr = make()
    doc = list(range(8))
    a, b = mgr.create(doc + [20] * 5), mgr.create(doc + [30] * 4 + [40] * 4 + [1])
    write_kv(mgr, a, doc + [20] * 5)
    write_kv(mgr, b, doc + [30] * 4 + [40] * 4 + [1])
    copies = b.block_table[:2]
    assert mgr.cache_full_blocks(a) == 3
    rec = EventRecorder(pool.events)
    assert mgr.cache_full_blocks(b) == 2  # its blocks 2 and 3; blocks 0 and 1 are a's now
    assert b.block_table[:2] == a.block_table[:2] and b.cached_blocks == 4 and b.cacheable
    assert [pool.fields.status[c] for c in copies] == [BlockStatus.FREE] * 2
    assert [pool.fields.refcount[x] for x in a.block_table[:2]] == [2, 2]
    assert [type(e).__name__ for e in rec.events][:4] == ["RefChanged", "Freed", "RefChanged", "Freed"]
    pool.check_invariants()
    mgr.check_invariants()
    c = mgr.create(b.token_ids + [2])
    assert c.block_table == b.block_table[:4] and c.num_cached_tokens == 16
    k = pool.storage.read_slots(0, c.slots())[0][:, 0, 0]
    assert torch.equal(k, torch.tensor(b.token_ids[:16], dtype=torch.float32))


def test_a_hash_collision_stops_registration_for_good(monkeypatch):
    """Both requests missed; the second's first block collides with the first's (it differs only in its last
    token). Nothing is taken from the colliding block, and the second registers nothing more, now or later."""
    route_hashes(monkeypatch, blind_to_last_token)
    pool, mgr = make()
    a, b = mgr.create(list(range(8))), mgr.create([0, 1, 2, 99, 4, 5, 6, 7])
    write_kv(mgr, a, list(range(8)))
    write_kv(mgr, b, [0, 1, 2, 99, 4, 5, 6, 7])
    assert mgr.cache_full_blocks(a) == 2
    table = list(b.block_table)
    assert mgr.cache_full_blocks(b) == 0 and not b.cacheable and b.block_table == table
    write_kv(mgr, b, [8, 9, 10, 11])
    assert mgr.cache_full_blocks(b) == 0  # not retried: its chain cannot be registered behind a collision
    assert torch.equal(pool.storage.read_slots(0, b.slots())[0][:, 0, 0],
                       torch.tensor(b.token_ids, dtype=torch.float32))
    mgr.check_invariants()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=14), st.booleans()), max_size=12),
       st.sampled_from([None, "t"]))
def test_no_cached_child_is_ever_orphaned(ops, tenant):
    """Random prompts from a tiny alphabet (many shared prefixes) in a small pool: after every step each
    registered block's parent is registered too, hits equal a fresh recomputation, and invariants hold."""
    pool, mgr = make(10)
    live = []
    for prompt, finish in ops:
        try:
            s = run(mgr, prompt, tenant)
        except OutOfBlocksError:  # a full pool refuses the append: finish everything and go on
            for s in list(mgr.seqs.values()):
                s.free()
            live = []
            continue
        cached = pool.storage.read_slots(0, s.slots())[0][:, 0, 0]
        assert torch.equal(cached, torch.tensor(prompt, dtype=torch.float32))
        (s.free() if finish else live.append(s))
        entries = mgr.prefix_cache.entries()
        digests = {d for d, _, _ in entries.values()}
        for b, (_, parent, _) in entries.items():
            assert parent is None or parent in digests, f"block {b} orphaned"
        mgr.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=3),
                max_size=6), st.sampled_from([None, "t"]))
def test_requests_computed_at_once_register_every_full_block(groups, tenant):
    """Groups of requests admitted in one step, so none hits another's blocks: once each has registered, every
    full block of every sequence is reachable through the cache, the table reads back the sequence's own K/V,
    no registered block is orphaned, and memory holds each registered prefix once."""
    pool, mgr = make(24)
    for group in groups:
        try:
            seqs = [mgr.create(p, tenant=tenant) for p in group]
            for seq, p in zip(seqs, group):
                write_kv(mgr, seq, p[seq.num_tokens:])
        except OutOfBlocksError:
            for seq in list(mgr.seqs.values()):
                seq.free()
            continue
        for seq in seqs:
            mgr.cache_full_blocks(seq)
        for seq, p in zip(seqs, group):
            full = len(p) // SPEC.block_size
            assert seq.cached_blocks == full and mgr.prefix_cache.peek(p, tenant) == seq.block_table[:full]
            k = pool.storage.read_slots(0, seq.slots())[0][:, 0, 0]
            assert torch.equal(k, torch.tensor(p, dtype=torch.float32))
        entries = mgr.prefix_cache.entries()
        digests = [d for d, _, _ in entries.values()]
        assert len(digests) == len(set(digests))
        assert all(parent is None or parent in digests for _, parent, _ in entries.values())
        mgr.check_invariants()
        for seq in seqs[::2]:
            seq.free()


class Optimistic(BlockPool):
    """The capacity check as it was: every cached block counts, whatever the guard will say. An allocation that
    the guard stops half-way then fails after evicting: the oracle for when the exact check must refuse."""

    def _evictable(self, k: int, need: int) -> int:
        return len(self.policy)


def prefix_state(pool: BlockPool, mgr: SequenceManager) -> tuple:
    """The pool's state (``_util.pool_state``) and its prefix cache's entries and counters."""
    return pool_state(pool), mgr.prefix_cache.entries(), mgr.prefix_cache.get_stats()


def same_prefix_state(a: tuple, b: tuple) -> bool:
    return same_state(a[0], b[0]) and a[1:] == b[1:]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "free", "swap", "unmark", "allocate"]),
                          st.lists(st.integers(0, 1), min_size=1, max_size=30), st.integers(0, 63)),
                max_size=24),
       st.sampled_from([None, 1, 3]))
@example([("run", [0] * 16, 0), ("free", [0], 0), ("swap", [0], 3), ("allocate", [0], 11)], None)  # a stale tail
@example([("run", [0] * 16, 0), ("free", [0], 0), ("allocate", [0], 10)], 1)  # a vetoed block holds its head
def test_an_allocation_is_refused_exactly_when_eviction_would_stop_half_way(ops, vetoed):
    """Random prompts with shared prefixes, finished sequences, stale entries (a cached block swapped out, a held
    one unmarked) and an optional plain guard under the cache's: each allocation is run on the pool and on a twin
    whose check counts every cached block. The pool refuses, with nothing changed, exactly when the twin fails
    after evicting; otherwise both hand out the same blocks."""
    pools, mgrs = [], []
    for cls in (BlockPool, Optimistic):
        pool = cls(12, spec=SPEC, with_storage=False)
        if vetoed is not None:
            pool.evict_guard = lambda b: b != vetoed
        pools.append(pool)
        mgrs.append(SequenceManager(pool, prefix_cache=True))
    live: list[list] = [[], []]
    for op, prompt, x in ops:
        outcome = [step(pool, mgr, held, op, prompt, x) for pool, mgr, held in zip(pools, mgrs, live)]
        mine, theirs = outcome
        if mine is not None and mine[0] == "refused":
            assert mine[1], "a refused allocation changed the pool or the cache"
            assert theirs[0] == "refused", "refused what evicting would have served"
            if not theirs[1]:
                event("refused, where the twin stopped half-way")
                return  # the twin evicted before it failed: from here on the two differ
        assert mine == theirs
        if mine is not None:
            event(f"allocation {mine[0]}")
        mgrs[0].check_invariants()
        if mine == ("full",) and not same_prefix_state(prefix_state(pools[0], mgrs[0]),
                                                       prefix_state(pools[1], mgrs[1])):
            event("a sequence refused, where the twin evicted first")
            return


def step(pool: BlockPool, mgr: SequenceManager, held: list, op: str, prompt: list[int], x: int) -> tuple | None:
    """One operation of the test above; an allocation says whether it was served (and with what) or refused
    (and whether everything stayed as it was)."""
    try:
        if op == "run":
            s = mgr.create(prompt)
            s.append(prompt[s.num_tokens:])
            mgr.cache_full_blocks(s)
            held.append(s)
        elif op == "free" and held:
            held.pop(x % len(held)).free()
        elif op in ("swap", "unmark"):
            reg = sorted(mgr.prefix_cache.entries())
            b = reg[x % len(reg)] if reg else None
            if b is not None and op == "swap" and pool.is_cached(b):
                pool.begin_eviction([b])
                pool.finish_eviction([b])
            elif b is not None and op == "unmark" and pool.fields.refcount[b]:
                pool.mark_reusable([b], False)
        elif op == "allocate":
            before = prefix_state(pool, mgr)
            try:
                got = pool.allocate(x % 12 + 1)
            except OutOfBlocksError:
                return ("refused", same_prefix_state(before, prefix_state(pool, mgr)))
            pool.free(got)
            return ("served", got)
    except OutOfBlocksError:
        return ("full",)
    return None


# ---------------------------------------------------------------- token ids: checked once, in two forms
def _outcome(f, x):
    try:
        return f(x, "here")
    except KVDataError as e:
        return ("KVDataError", str(e))


_ids = st.one_of(st.integers(-3, 2**64), st.booleans(), st.floats(allow_nan=False, width=16), st.none(),
                 st.integers(0, 2**63 - 1).map(np.int64))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(_ids, max_size=80), st.lists(st.integers(0, 2**63 - 1), max_size=200),
                 st.lists(st.integers(0, 2**31), max_size=120).map(lambda v: np.array(v, dtype=np.int64)),
                 st.lists(st.integers(0, 2**31), max_size=20).map(tuple)))
def test_token_ids_is_token_list_and_token_bytes_from_one_check(x):
    """``token_ids`` (what a sequence keeps, and the bytes the cache hashes, from one check) agrees with
    ``token_list`` and ``token_bytes`` on every input: same values, or the same error naming the same id."""
    from kvlab.core.checks import TokenBytes, token_bytes, token_ids, token_list

    got = _outcome(token_ids, x)
    if isinstance(got, tuple) and got[0] == "KVDataError":
        assert got == _outcome(token_list, x) == _outcome(token_bytes, x)
        return
    ids, data = got
    assert type(data) is TokenBytes and data == token_bytes(x, "here")
    assert ids == token_list(x, "here") and all(type(t) is int for t in ids)
    assert np.frombuffer(data, dtype=np.int64).tolist() == ids
    assert token_bytes(data, "again") is data  # checked once: passing it again costs nothing


def test_plain_bytes_are_not_token_ids():
    """Only what ``token_bytes`` made passes unchecked; plain bytes (a str's encoding, say) are refused."""
    pool, mgr = make()
    with pytest.raises(KVDataError, match="token ids are a list of ints"):
        mgr.prefix_cache.match(b"\x01" * 8 * 4)
    with pytest.raises(KVDataError, match="token ids are a list of ints"):
        mgr.create(b"\x01" * 8 * 4)
    assert len(mgr) == 0 and mgr.prefix_cache.get_stats()["requests"] == 0


def test_create_checks_a_prompt_once_and_keeps_python_ints():
    """A prompt given as an array is kept as a list of Python ints, and the lookup counts it as a list would."""
    pool, mgr = make()
    run(mgr, list(range(9)))
    seq = mgr.create(np.arange(9, dtype=np.int32))
    assert seq.num_tokens == 8 and all(type(t) is int for t in seq.token_ids)
    assert mgr.prefix_cache.get_stats()["query_tokens"] == 18
