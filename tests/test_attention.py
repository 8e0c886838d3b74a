"""paged_attention against the contiguous reference: block sizes, dtypes, GQA, mixed batches, shuffled blocks,
stale tail slots, and after fork / copy-on-write, swap round trips and prefix-cache hits. The compiled CPU decode
kernel (kvlab/fast/_paged_attention.c) is held equal to the float64 reference and to the torch gather + SDPA path."""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
import kvlab.fast.attention as attention
from kvlab import BlockPool, ConfigError, KVDataError, KVLabError, KVSpec, torch_threads
from kvlab.core.attention import AttentionWorkspace, contiguous_attention
from kvlab.core.attention import paged_attention as reference_attention
from kvlab.fast.attention import DECODE_KERNEL_COMPILED, paged_attention
from kvlab.core.sequence import SequenceManager

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def scattered_cache(lens, block_size, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", seed=0,
                    layers=1, layer=0, stale=float("nan")):
    """A pool whose blocks are handed out in a shuffled order; every slot (of every layer) starts as ``stale``
    (NaN: any read past a sequence's length, or of another layer, poisons the result). Returns the pool, the
    tables and the K/V written to ``layer`` for each sequence."""
    g = torch.Generator().manual_seed(seed)
    nb = [-(-n // block_size) for n in lens]
    pool = BlockPool(sum(nb) + 3, spec=KVSpec(layers, kv_heads, head_dim, block_size, dtype, torch.device(device)))
    pool.storage.kv.fill_(stale)
    perm = torch.randperm(pool.num_blocks, generator=g).tolist()
    tables, keys, values = [], [], []
    for n, k in zip(lens, nb):
        table, perm = perm[:k], perm[k:]
        tables.append(table)
        kv = torch.randn(2, n, kv_heads, head_dim, generator=g).to(device, dtype)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        pool.storage.write_slots(layer, slots, kv[0], kv[1])
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
    lens = [40, 7, 129, 300, 20]
    qlens = [40, 1, 100, 3, 2]  # full prefill, decode, prefill after a cached prefix, a few new tokens, two
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
    first = paged_attention(q, pool, 0, tables, lens, workspace=ws, impl="torch")
    ptr = ws.buf.data_ptr()
    second = paged_attention(q.flip(0), pool, 0, [tables[1], tables[0]], [20, 100], workspace=ws, impl="torch")
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
    with pytest.raises(ConfigError, match="'fast'"):
        paged_attention(q, pool, 0, tables, [10], impl="fast")


def small_pool():
    return BlockPool(8, spec=KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, device="cpu"))


@pytest.mark.parametrize("layer", [False, True, 1.0, np.float64(1), np.bool_(True), None, "1", [1]], ids=repr)
def test_layer_must_be_an_int(layer):
    """``0 <= layer < num_layers`` let bools through, and ``kv[0, False]`` is a temporary copy, not a layer (the
    compiled kernel read freed memory through it: see the subprocess test below); floats gave an IndexError."""
    with pytest.raises(ConfigError, match=re.escape(repr(layer))):
        paged_attention(torch.randn(1, 2, 4), small_pool(), layer, [[0, 1]], [5], impl="torch")


BAD_ARGS = {  # keyword -> value: paged_attention must refuse it with a typed error naming it
    "seq_lens=[1.5]": ({"seq_lens": [1.5]}, "1.5"),
    "seq_lens=[5.9]": ({"seq_lens": [5.9]}, "5.9"),
    "seq_lens=['5']": ({"seq_lens": ["5"]}, "'5'"),
    "seq_lens=[True]": ({"seq_lens": [True]}, "True"),
    "seq_lens=[nan]": ({"seq_lens": [math.nan]}, "nan"),
    "seq_lens=[inf]": ({"seq_lens": [math.inf]}, "inf"),
    "query_lens=[1.5]": ({"query_lens": [1.5]}, "1.5"),
    "query_lens='1'": ({"query_lens": "1"}, "'1'"),
    "table [[0.5, 1]]": ({"block_tables": [[0.5, 1]]}, "0.5"),
    "table [[True, 1]]": ({"block_tables": [[True, 1]]}, "True"),
    "float table tensor": ({"block_tables": torch.tensor([[0.0, 1.0]])}, re.escape("tensor([[0., 1.]])")),
    "table [[0, 2**63]]": ({"block_tables": [[0, 2**63]]}, str(2**63)),
    "q=None": ({"q": None}, "None"),
    "kv=None": ({"kv": None}, "None"),
    "workspace='x'": ({"workspace": "x"}, "'x'"),
    "q with 0 heads": ({"q": torch.randn(1, 0, 4)}, re.escape("[1, 0, 4]")),
    **{f"scale={v!r}": ({"scale": v}, re.escape(repr(v))) for v in (math.nan, math.inf, True, 0, -1.0)},
}


@pytest.mark.parametrize("impl", ["reference", "torch", "auto"])
@pytest.mark.parametrize("kwargs, named", BAD_ARGS.values(), ids=BAD_ARGS)
def test_arguments_are_never_coerced(kwargs, named, impl):
    """Floats were truncated, bools counted as ints, a NaN scale gave NaN on the kernel and 0 on torch. The
    reference (kvlab.core.attention) and the fast twin (kvlab.fast.attention) share one check."""
    pool = small_pool()
    before = pool.storage.kv.clone()
    args = {"q": torch.randn(1, 2, 4), "kv": pool, "layer": 0, "block_tables": [[0, 1]], "seq_lens": [5], **kwargs}
    with pytest.raises(KVLabError, match=named):
        reference_attention(**args) if impl == "reference" else paged_attention(**args, impl=impl)
    assert torch.equal(pool.storage.kv, before)


def test_numpy_ints_int_tensors_and_numpy_scales_are_accepted():
    pool, tables, _, _ = scattered_cache([5, 9], 4, kv_heads=2, head_dim=4, layers=2, layer=1)
    q = torch.randn(2, 2, 4)
    want = paged_attention(q, pool, 1, tables, [5, 9], scale=0.5)
    got = paged_attention(q, pool, np.int64(1), [np.array(t) for t in tables], np.array([5, 9]),
                          torch.tensor([1, 1], dtype=torch.int32), scale=np.float32(0.5))
    assert torch.equal(got, want)


BAD_REFERENCE_ARGS = {  # contiguous_attention(q [1, 2, 4], keys, values, ...) with one of these changed
    "values=[]": ({"values": []}, ConfigError, "0 values"),
    "keys=None": ({"keys": None}, ConfigError, "None"),
    "query_lens=[1.5]": ({"query_lens": [1.5]}, ConfigError, "1.5"),
    "query_lens=[2] for 1 row": ({"query_lens": [2]}, ConfigError, re.escape("[2]")),
    "4 queries over 3 keys": ({"q": torch.randn(4, 2, 4), "query_lens": [4]}, ConfigError, "4 queries over 3"),
    "3 q heads over 2": ({"q": torch.randn(1, 3, 4)}, KVDataError, "3 heads"),
    "keys of dim 2": ({"keys": [torch.randn(3, 2, 2)]}, KVDataError, re.escape("[3, 2, 2]")),
    "q=None": ({"q": None}, KVDataError, "None"),
    "scale=nan": ({"scale": math.nan}, ConfigError, "nan"),
}


@pytest.mark.parametrize("kwargs, error, named", BAD_REFERENCE_ARGS.values(), ids=BAD_REFERENCE_ARGS)
def test_reference_refuses_bad_input(kwargs, error, named):
    k = torch.randn(3, 2, 4)
    with pytest.raises(error, match=named):
        contiguous_attention(**{"q": torch.randn(1, 2, 4), "keys": [k], "values": [k], **kwargs})


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
    calls = []
    real = attention._batched_decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "_batched_decode", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
        out = paged_attention(q, pool, 0, tables, lens, qlens)
    assert calls == [1]  # the decode row, by the batched path
    ref = contiguous_attention(q, keys, values, qlens)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out, paged_attention(q, pool, 0, tables, lens, qlens, impl="torch"),
                               atol=TOL[dtype], rtol=TOL[dtype])


# --- The batched decode path (a speed trick for GPUs: the torch path above is the reference) -----------------------

@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=6), data=st.data(),
       block_size=st.sampled_from([1, 3, 16, 64]), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), scale=st.sampled_from([None, 0.05]),
       stale=st.sampled_from([float("nan"), float("inf"), 1e4]), seed=st.integers(0, 2**16))
def test_batched_decode_matches_reference(lens, data, block_size, kv_heads, group, dtype, scale, stale, seed):
    """Any lengths (short tables padded), block sizes, grouped heads, bf16, prefill rows beside decode rows, and
    stale slots past each length that would poison a merely masked read (NaN, inf, or large enough to win)."""
    qlens = [data.draw(st.sampled_from([1, 1, min(n, 5)])) for n in lens]
    pool, tables, keys, values = scattered_cache(lens, block_size, kv_heads, 8, dtype, seed=seed, stale=stale)
    q = torch.randn(sum(qlens), kv_heads * group, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = paged_attention(q, pool, 0, tables, lens, qlens, scale=scale, impl="batched")
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), contiguous_attention(q, keys, values, qlens, scale=scale).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_batched_decode_runs_on_the_cpu_only_when_asked(monkeypatch):
    """On the CPU, ``impl="auto"`` leaves decode rows the kernel cannot take (bf16) to the reference, and
    ``impl="batched"`` sends them to the batched path (``test_cuda_matches_reference`` checks that "auto" picks it
    on CUDA)."""
    lens, qlens = [40, 7, 129], [40, 1, 1]
    pool, tables, _, _ = scattered_cache(lens, 16, dtype=torch.bfloat16)
    q = torch.randn(sum(qlens), 4, 16).bfloat16()
    calls = []
    real = attention._batched_decode
    monkeypatch.setattr(attention, "_batched_decode", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    paged_attention(q, pool, 0, tables, lens, qlens)
    assert calls == []  # bf16 on the CPU: the reference
    paged_attention(q, pool, 0, tables, lens, qlens, impl="batched")
    assert calls == [2]


# --- The compiled decode kernel (a speed trick: the torch path above is the reference) ----------------------------

needs_kernel = pytest.mark.skipif(not DECODE_KERNEL_COMPILED, reason="kvlab/fast/_paged_attention.c is not compiled")


def float64_reference(q, keys, values, scale=None):
    """Decode attention in float64 on the contiguous K/V (contiguous_attention computes in float64)."""
    return contiguous_attention(q.double(), [k.double() for k in keys], [v.double() for v in values], scale=scale)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 700), min_size=1, max_size=5),
       block_size=st.sampled_from([1, 2, 3, 8, 16, 24, 64, 256]), kv_heads=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([1, 2, 3, 4]), head_dim=st.sampled_from([1, 5, 8, 16, 20, 64]),
       sharpness=st.sampled_from([0.1, 1.0, 10.0]), scale=st.sampled_from([None, 0.05]),
       stale=st.sampled_from([float("nan"), 1e4]), threads=st.sampled_from([1, 2]),
       layer=st.sampled_from([0, 1]), seed=st.integers(0, 2**16))
def test_kernel_matches_float64_reference_and_torch_path(lens, block_size, kv_heads, group, head_dim, sharpness,
                                                         scale, stale, threads, layer, seed):
    """Any lengths, block sizes, (grouped) heads, head sizes (also not a multiple of 8), shuffled tables, stale
    data in the tail slots and the other layer (NaN, or large enough to win a softmax if it were read), scores
    from flat to sharp (the online softmax rescales often), on 1 or 2 threads with sequences split into spans."""
    pool, tables, keys, values = scattered_cache(lens, block_size, kv_heads, head_dim, seed=seed, layers=2,
                                                 layer=layer, stale=stale)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g) * sharpness
    with pytest.MonkeyPatch.context() as mp, torch_threads(threads):
        mp.setattr(attention, "_THREAD_FLOATS", 1)  # start threads and split spans even for tiny inputs
        out = paged_attention(q, pool, layer, tables, lens, scale=scale, impl="compiled")
    ref = float64_reference(q, keys, values, scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, paged_attention(q, pool, layer, tables, lens, scale=scale, impl="torch"),
                               atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_is_the_cpu_fp32_decode_default_and_splits_long_sequences():
    """At the default thread threshold: 2 threads over 8 sequences up to 3000 tokens (some split into spans),
    a padded tensor table, and the rows of q not contiguous."""
    lens = [3000, 1, 257, 1500, 64, 999, 2048, 5]
    pool, tables, keys, values = scattered_cache(lens, 16, kv_heads=8, head_dim=64, seed=3)
    padded = torch.zeros(len(lens), max(map(len, tables)), dtype=torch.long)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = torch.tensor(t)
    q = torch.randn(8, len(lens), 64).transpose(0, 1)  # [seqs, heads, dim], not contiguous
    with torch_threads(2):
        out = paged_attention(q, pool, 0, padded, torch.tensor(lens))
    torch.testing.assert_close(out.double(), float64_reference(q, keys, values), atol=2e-6, rtol=2e-5)


@needs_kernel
def test_kernel_from_several_python_threads_at_once():
    """The kernel releases the GIL; concurrent calls on one pool each get their own answer."""
    lens = [700, 90, 1200]
    pool, tables, keys, values = scattered_cache(lens, 16, kv_heads=2, head_dim=32, seed=4)
    qs = [torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    outs: list = [None] * len(qs)

    def work(i):
        for _ in range(20):
            outs[i] = paged_attention(qs[i], pool, 0, tables, lens, impl="compiled")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(qs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q, out in zip(qs, outs):
        torch.testing.assert_close(out.double(), float64_reference(q, keys, values), atol=2e-6, rtol=2e-5)


@needs_kernel
def test_compiled_refuses_what_it_does_not_serve():
    lens = [10, 20]
    pool, tables, _, _ = scattered_cache(lens, 8)
    q = torch.randn(2, 2, 16)
    with pytest.raises(ConfigError, match="one query per sequence"):
        paged_attention(torch.randn(3, 2, 16), pool, 0, tables, lens, [2, 1], impl="compiled")
    bf16, tables16, _, _ = scattered_cache(lens, 8, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="bfloat16"):
        paged_attention(q.bfloat16(), bf16, 0, tables16, lens, impl="compiled")
    assert paged_attention(q.bfloat16(), bf16, 0, tables16, lens).dtype == torch.bfloat16  # auto: torch path


@needs_kernel
def test_a_bool_layer_never_reaches_the_kernel():
    """Run apart: before the fix ``layer=False`` crashed the interpreter (SIGSEGV) on the compiled path."""
    code = ("import torch, kvlab, kvlab.fast.attention as a; from kvlab import BlockPool, KVSpec\n"
            "p = BlockPool(8, spec=KVSpec(2, 2, 4, 4, device='cpu'))\n"
            "for layer in (False, True):\n"
            "    try:\n"
            "        a.paged_attention(torch.randn(1, 2, 4), p, layer, [[0, 1]], [5], impl='compiled')\n"
            "    except kvlab.ConfigError as e:\n"
            "        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert [line.split()[:2] for line in out.stdout.splitlines()] == [["layer", "False"], ["layer", "True"]]


@needs_kernel
def test_the_c_entry_point_checks_what_it_reads():
    """Even called directly, the kernel refuses block ids outside the pool and lengths its table cannot hold."""
    pool, tables, _, _ = scattered_cache([10], 4)
    s, kv = pool.storage.spec, pool.storage.kv
    q, out = torch.randn(1, 2, 16), torch.empty(1, 2, 16)
    lens = torch.tensor([10])
    for table, match in ((torch.tensor([[0, 1, pool.num_blocks]]), "outside"), (torch.tensor([[0, 1]]), "holds")):
        with pytest.raises(ValueError, match=match):
            attention._decode(out.data_ptr(), q.data_ptr(), kv[0, 0].data_ptr(), kv[1, 0].data_ptr(),
                              table.data_ptr(), table.shape[1], lens.data_ptr(), 1, 2, s.num_kv_heads, s.head_dim,
                              s.block_size, pool.num_blocks, 0.25, 1, 1)


def test_pure_python_switch_keeps_the_torch_path():
    code = ("import torch, kvlab.fast.attention as a; from kvlab import BlockPool, KVSpec\n"
            "p = BlockPool(4, spec=KVSpec(1, 1, 8, 4, device='cpu')); print(a.DECODE_KERNEL_COMPILED, "
            "a.paged_attention(torch.ones(1, 1, 8), p, 0, [[2]], [3]).shape)")
    env = {**os.environ, "KVLAB_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split()[0] == "False", out.stdout


@needs_kernel
def test_a_kernel_older_than_its_source_is_refused_with_one_warning(tmp_path):
    src = Path(kvlab.__file__).parent
    pkg = tmp_path / "kvlab"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    c_file = pkg / "fast" / "_paged_attention.c"
    c_file.write_text(c_file.read_text() + "\n/* edited */\n")
    code = ("import warnings; warnings.simplefilter('always'); import kvlab.fast.attention as a; "
            "print(a.DECODE_KERNEL_COMPILED)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "False"
    assert out.stderr.count("_paged_attention.c changed after it was compiled") == 1, out.stderr


def test_the_wheel_ships_the_decode_kernel(wheel):
    names = set(wheel.namelist())
    assert "kvlab/fast/_paged_attention.c" in names
    if DECODE_KERNEL_COMPILED:
        assert any(n.startswith("kvlab/fast/_paged_attention") and n.endswith(".so") for n in names), sorted(names)


@needs_kernel
def test_mixed_batch_sends_its_decode_rows_to_the_kernel(monkeypatch):
    """In a step mixing prefill chunks with decode (the engine's chunked prefill), the decode rows still go to the
    compiled kernel, in one call, and the result equals the torch path's."""
    lens, qlens = [40, 7, 129, 300, 20, 1], [40, 1, 100, 1, 2, 1]
    pool, tables, keys, values = scattered_cache(lens, 16, kv_heads=2, head_dim=32)
    q = torch.randn(sum(qlens), 4, 32)
    calls = []
    real = attention._compiled_decode
    monkeypatch.setattr(attention, "_compiled_decode", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    out = paged_attention(q, pool, 0, tables, lens, qlens)
    assert calls == [3]
    torch.testing.assert_close(out, paged_attention(q, pool, 0, tables, lens, qlens, impl="torch"),
                               atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, contiguous_attention(q, keys, values, qlens), atol=1e-5, rtol=1e-5)
