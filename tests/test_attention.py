"""paged_attention against the contiguous reference: block sizes, dtypes, GQA, mixed batches, shuffled blocks,
stale tail slots, and after fork / copy-on-write, swap round trips and prefix-cache hits."""
from __future__ import annotations

import pytest
import torch

from kvlab import BlockPool, ConfigError, KVDataError, KVSpec
from kvlab.attention import AttentionWorkspace, contiguous_attention, paged_attention
from kvlab.sequence import SequenceManager

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def scattered_cache(lens, block_size, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", seed=0):
    """A pool whose blocks are handed out in a shuffled order; every slot starts as NaN so that any read past a
    sequence's length poisons the result. Returns the pool, the tables and the K/V written for each sequence."""
    g = torch.Generator().manual_seed(seed)
    nb = [-(-n // block_size) for n in lens]
    pool = BlockPool(sum(nb) + 3, spec=KVSpec(1, kv_heads, head_dim, block_size, dtype, torch.device(device)))
    pool.storage.kv.fill_(float("nan"))
    perm = torch.randperm(pool.num_blocks, generator=g).tolist()
    tables, keys, values = [], [], []
    for n, k in zip(lens, nb):
        table, perm = perm[:k], perm[k:]
        tables.append(table)
        kv = torch.randn(2, n, kv_heads, head_dim, generator=g).to(device, dtype)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        pool.storage.write_slots(0, slots, kv[0], kv[1])
        keys.append(kv[0])
        values.append(kv[1])
    return pool, tables, keys, values


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(block_size, dtype):
    lens = [1, 17, 300, 64, 255, 513]
    pool, tables, keys, values = scattered_cache(lens, block_size, dtype=dtype)
    q = torch.randn(len(lens), 4, 16).to(dtype)  # 4 query heads over 2 kv heads: GQA
    out = paged_attention(q, pool, 0, tables, lens)
    ref = contiguous_attention(q, keys, values)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 16, 24, 64, 256])
def test_mixed_prefill_and_decode_batch(block_size):
    lens = [40, 7, 129, 300]
    qlens = [40, 1, 100, 3]  # full prefill, decode, prefill after a cached prefix, a few new tokens
    pool, tables, keys, values = scattered_cache(lens, block_size, kv_heads=1, head_dim=32)
    q = torch.randn(sum(qlens), 8, 32)
    out = paged_attention(q, pool.storage, 0, tables, torch.tensor(lens), qlens)
    torch.testing.assert_close(out, contiguous_attention(q, keys, values, qlens), atol=1e-5, rtol=1e-5)


def test_padded_table_tensor_and_custom_scale():
    lens = [5, 33]
    pool, tables, keys, values = scattered_cache(lens, 16)
    padded = torch.tensor([tables[0] + [0] * (len(tables[1]) - len(tables[0])), tables[1]])
    q = torch.randn(2, 2, 16)
    out = paged_attention(q, pool, 0, padded, lens, scale=0.3)
    torch.testing.assert_close(out, contiguous_attention(q, keys, values, scale=0.3), atol=1e-5, rtol=1e-5)


def test_reference_is_softmax_attention():
    q, k, v = torch.randn(1, 1, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    w = (k[:, 0] @ q[0, 0] / 2).softmax(0)
    torch.testing.assert_close(contiguous_attention(q, [k], [v])[0, 0], w @ v[:, 0])


def test_workspace_is_reused():
    lens = [100, 20]
    pool, tables, keys, values = scattered_cache(lens, 16)
    ws = AttentionWorkspace()
    q = torch.randn(2, 2, 16)
    first = paged_attention(q, pool, 0, tables, lens, workspace=ws)
    ptr = ws.buf.data_ptr()
    second = paged_attention(q.flip(0), pool, 0, [tables[1], tables[0]], [20, 100], workspace=ws)
    assert ws.buf.data_ptr() == ptr
    assert torch.equal(first, second.flip(0))


def test_bad_input_raises_typed_errors():
    pool, tables, _, _ = scattered_cache([10], 4)
    q = torch.randn(1, 2, 16)
    with pytest.raises(KVDataError, match="shape"):
        paged_attention(torch.randn(1, 3, 16), pool, 0, tables, [10])
    with pytest.raises(KVDataError, match="dtype|float64"):
        paged_attention(q.double(), pool, 0, tables, [10])
    with pytest.raises(ConfigError, match="table of 3 blocks"):
        paged_attention(q, pool, 0, tables, [13])
    with pytest.raises(ConfigError, match="outside"):
        paged_attention(q, pool, 0, [[0, 1, pool.num_blocks]], [10])
    with pytest.raises(ConfigError, match="layer 1"):
        paged_attention(q, pool, 1, tables, [10])
    with pytest.raises(KVDataError, match="query_lens sum"):
        paged_attention(q, pool, 0, tables, [10], [2])


def _shadow_attention(mgr, seqs, shadow, q):
    out = paged_attention(q, mgr.pool, 0, mgr.block_tables(seqs), [s.num_tokens for s in seqs])
    ref = contiguous_attention(q, [shadow[s.seq_id][0] for s in seqs], [shadow[s.seq_id][1] for s in seqs])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _append(mgr, seq, n, shadow, g):
    kv = torch.randn(2, n, 2, 16, generator=g)
    mgr.pool.storage.write_slots(0, mgr.append(seq, n), kv[0], kv[1])
    old = shadow.get(seq.seq_id, torch.empty(2, 0, 2, 16))
    shadow[seq.seq_id] = torch.cat((old, kv), 1)


@pytest.mark.parametrize("block_size", [1, 16])
def test_after_fork_cow_swap_and_migration(block_size):
    g = torch.Generator().manual_seed(1)
    pool = BlockPool(80, spec=KVSpec(1, 2, 16, block_size, device="cpu"))
    mgr = SequenceManager(pool)
    shadow: dict[int, torch.Tensor] = {}
    a = mgr.create()
    _append(mgr, a, 37, shadow, g)
    b = a.fork()
    shadow[b.seq_id] = shadow[a.seq_id].clone()
    _append(mgr, a, 5, shadow, g)   # copy-on-write of the shared tail (if partly filled)
    _append(mgr, b, 2, shadow, g)
    c = mgr.create()
    _append(mgr, c, 20, shadow, g)
    c.swap_out()
    _append(mgr, a, 9, shadow, g)   # may reuse c's old blocks
    c.swap_in()
    src = [x for x in a.block_table if pool.fields.refcount[x] == 1][:3]
    free = [x for x in range(pool.num_blocks) if pool.fields.status[x] == 0][-len(src):]
    pool.migrate(src, free)
    q = torch.randn(3, 2, 16, generator=g)
    _shadow_attention(mgr, [a, b, c], shadow, q)
    mgr.check_invariants()


def test_after_prefix_cache_hit():
    g = torch.Generator().manual_seed(2)
    pool = BlockPool(40, spec=KVSpec(1, 2, 16, 8, device="cpu"))
    mgr = SequenceManager(pool, prefix_cache=True)
    prompt = list(range(30))
    a = mgr.create(prompt)
    kv = torch.randn(2, 30, 2, 16, generator=g)
    pool.storage.write_slots(0, mgr.append(a, prompt), kv[0], kv[1])
    assert mgr.cache_full_blocks(a) == 3
    head = a.block_table[:3]
    a.free()
    b = mgr.create(prompt[:24] + [99, 98])
    assert b.num_cached_tokens == 24 and b.block_table == head
    tail = torch.randn(2, 2, 2, 16, generator=g)
    pool.storage.write_slots(0, mgr.append(b, [99, 98]), tail[0], tail[1])
    want = torch.cat((kv[:, :24], tail), 1)
    q = torch.randn(1, 2, 16, generator=g)
    out = paged_attention(q, pool, 0, mgr.block_tables([b]), [b.num_tokens])
    torch.testing.assert_close(out, contiguous_attention(q, [want[0]], [want[1]]), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(dtype):
    lens = [3, 130, 999]
    pool, tables, keys, values = scattered_cache(lens, 16, dtype=dtype, device="cuda")
    qlens = [3, 1, 7]
    q = torch.randn(sum(qlens), 4, 16, device="cuda").to(dtype)
    out = paged_attention(q, pool, 0, tables, lens, qlens)
    ref = contiguous_attention(q, keys, values, qlens)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
