"""Decode attention on the paged pool vs contiguous SDPA, in one run (ratios, not absolute times).

8 sequences of 100..2000 tokens, 8 heads x 64, fp32, block sizes 16 / 64 / 256, physical blocks shuffled (the
worst layout: no two logical neighbours are physical neighbours). Rows:

* ``padded``: one SDPA over K/V padded to the longest sequence with a length mask (the baseline);
* ``per-seq contiguous``: one SDPA per sequence on its own contiguous K/V;
* ``naive gather``: gather every sequence into a padded workspace, then the padded SDPA (what paging costs done
  plainly);
* ``paged``: :func:`kvlab.fast.attention.paged_attention`, what the model runs (on the CPU in fp32: the compiled
  decode kernel, which reads blocks in place; on a GPU: one gather of every sequence's blocks into a padded batch
  and one masked SDPA; on the CPU in other dtypes: the reference);
* ``paged (torch path)``: the same call with ``impl="torch"``, the gather + SDPA reference path.

On the CPU, with 1 and 2 torch threads, in two timings:

* *alternating*: one call of each variant in turn, median over rounds; each call finds its K/V evicted from the
  cache by the other variants' (K/V out of cache);
* *runs of 8*: 8 calls of one variant back to back, variants in turn within each round, best round (K/V warm in
  the cache after the first call);

and a *floor* in runs of 8 beside the latter: copying the same K/V bytes once into a preallocated buffer
(``copy_``; also shown: reading them once, a ``sum``).

Goals: paged <= 1.5x padded at every block size in both timings; paged <= 2.5x the copy floor. With CUDA the
alternating rows run on the GPU and paged also reports effective GB/s (K/V bytes read per step / time) and its
share of the memory-bandwidth roofline (the peak from the device's memory clock and bus width when torch exposes
them, else a measured device-to-device copy).
Run: ``python benchmarks/bench_attention.py [--quick]`` (it sets the thread counts itself).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from kvlab import KVSpec, KVStorage, torch_threads
from kvlab.core.attention import AttentionWorkspace
from kvlab.fast.attention import paged_attention
from kvlab.app.bench import ns_per_item_together

HEADS, DIM, BATCH = 8, 64, 8
LENS = [round(100 + i * (2000 - 100) / (BATCH - 1)) for i in range(BATCH)]


def _measure(fns: list, device: torch.device, reps: int) -> list[float]:
    """Median milliseconds of each function, run round-robin so that load from other processes hits all alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 3):
        for fn, ts in zip(fns, times):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if rep >= 3:  # warm-up rounds are not counted
                ts.append(time.perf_counter() - t)
    return [statistics.median(ts) * 1e3 for ts in times]


def _peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """Bytes/s the GPU's memory can move: from its clock and bus width, else a measured copy."""
    p = torch.cuda.get_device_properties(device)
    clock, bus = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8, "spec"
    x = torch.empty(1 << 28, dtype=torch.float32, device=device)
    ms, = _measure([lambda: x.clone()], device, 10)
    return 2 * x.numel() * 4 / (ms / 1e3), "measured copy"


def bench(block_size: int, device: torch.device, reps: int, seed: int = 0) -> list[dict]:
    """The rows of one block size on one device (on the CPU at the current torch thread count)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in LENS]
    storage = KVStorage(KVSpec(1, HEADS, DIM, block_size, torch.float32, device), sum(nbs))
    storage.kv.copy_(torch.randn(storage.kv.shape, generator=g))
    perm = torch.randperm(storage.num_blocks, generator=g)
    tables = list(torch.split(perm, nbs))
    padded_tables = torch.zeros(BATCH, max(nbs), dtype=torch.long)
    for i, t in enumerate(tables):
        padded_tables[i, :len(t)] = t
    q = torch.randn(BATCH, HEADS, DIM, generator=g).to(device)
    longest = max(LENS)
    # Contiguous copies of the same K/V, [batch, heads, longest, dim], as a dense cache would hold them.
    dense = storage.kv[:, 0][:, padded_tables.to(device)].reshape(2, BATCH, -1, HEADS, DIM)[:, :, :longest]
    k_pad, v_pad = (x.transpose(1, 2).contiguous() for x in dense)
    mask = (torch.arange(longest, device=device)[None] < torch.tensor(LENS, device=device)[:, None])[:, None, None]
    k_seq = [k_pad[i:i + 1, :, :n].contiguous() for i, n in enumerate(LENS)]
    v_seq = [v_pad[i:i + 1, :, :n].contiguous() for i, n in enumerate(LENS)]
    q4 = q[:, :, None]
    slots = (padded_tables[:, :, None] * block_size + torch.arange(block_size)).reshape(BATCH, -1)[:, :longest]
    slots = slots.to(device).reshape(-1)
    ws_pad = torch.empty(2, BATCH * longest, HEADS, DIM, device=device)
    ws = AttentionWorkspace()
    flat_k, flat_v = storage.slots[0, 0], storage.slots[1, 0]

    def padded():
        return F.scaled_dot_product_attention(q4, k_pad, v_pad, attn_mask=mask)[:, :, 0]

    def per_seq():
        return torch.cat([F.scaled_dot_product_attention(q4[i:i + 1], k_seq[i], v_seq[i])[:, :, 0]
                          for i in range(BATCH)])

    def naive():
        k, v = (torch.index_select(src, 0, slots, out=dst).view(BATCH, longest, HEADS, DIM).transpose(1, 2)
                for src, dst in ((flat_k, ws_pad[0]), (flat_v, ws_pad[1])))
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask)[:, :, 0]

    def paged():
        return paged_attention(q, storage, 0, padded_tables, LENS, workspace=ws)

    def paged_torch():
        return paged_attention(q, storage, 0, padded_tables, LENS, workspace=ws, impl="torch")

    ref = padded()
    for fn in (per_seq, naive, paged, paged_torch):
        torch.testing.assert_close(fn(), ref, atol=1e-4, rtol=1e-4)
    cases = (("padded SDPA", padded, None), ("per-seq contiguous SDPA", per_seq, None),
             ("naive gather + padded SDPA", naive, None), ("paged_attention (torch path)", paged_torch, None),
             ("paged_attention", paged, 1.5))
    times = _measure([fn for _, fn, _ in cases], device, reps)
    where = f"B={block_size}, {device.type}" + (f", {torch.get_num_threads()} threads" if device.type == "cpu" else "")
    rows = [{"name": f"{name}, {where}", "value": ms, "unit": "ms", "baseline": times[0],
             "ratio": ms / times[0], "goal": goal} for (name, _, goal), ms in zip(cases, times)]
    if device.type == "cpu":
        rows += _warm_rows(padded, paged, torch.cat([x.reshape(-1) for x in k_seq + v_seq]), where, reps)
    if device.type == "cuda":
        ms = times[-1]  # paged_attention's
        kv_bytes = 2 * sum(LENS) * HEADS * DIM * 4
        peak, how = _peak_bandwidth(device)
        gbs = kv_bytes / (ms / 1e3) / 1e9
        rows.append({"name": f"paged_attention effective bandwidth, B={block_size}", "value": gbs, "unit": "GB/s",
                     "baseline": peak / 1e9, "ratio": gbs / (peak / 1e9), "goal": None, "peak_from": how})
    return rows


def _warm_rows(padded, paged, kv: torch.Tensor, where: str, reps: int) -> list[dict]:
    """Runs of 8 calls (K/V warm in the cache), best of the rounds, with the floor timed in the same rounds:
    copying the bytes of ``kv`` (the K/V attention reads) once, and reading them once."""
    dst = torch.empty_like(kv)
    ms = {name: ns / 1e6 for name, ns in ns_per_item_together(
        {"padded": padded, "paged": paged, "copy": lambda: dst.copy_(kv), "read": kv.sum},
        items=1, reps=8, rounds=max(5, reps // 2)).items()}
    return [
        {"name": f"padded SDPA, runs of 8, {where}", "value": ms["padded"], "unit": "ms",
         "baseline": ms["padded"], "ratio": 1.0, "goal": None},
        {"name": f"paged_attention, runs of 8, {where}", "value": ms["paged"], "unit": "ms",
         "baseline": ms["padded"], "ratio": ms["paged"] / ms["padded"], "goal": 1.5},
        {"name": f"floor: copy the K/V once, runs of 8, {where}", "value": ms["copy"], "unit": "ms",
         "baseline": ms["copy"], "ratio": 1.0, "goal": None, "ratios": {"read once (sum)": ms["read"] / ms["copy"]}},
        {"name": f"paged_attention vs the copy floor, runs of 8, {where}", "value": ms["paged"], "unit": "ms",
         "baseline": ms["copy"], "ratio": ms["paged"] / ms["copy"], "goal": 2.5,
         "ratios": {"vs read once": ms["paged"] / ms["read"], "padded vs copy": ms["padded"] / ms["copy"]}},
    ]


def run(quick: bool = False) -> list[dict]:
    reps = 10 if quick else 50
    rows = []
    for n in (1, 2):
        with torch_threads(n):
            rows += [row for b in (16, 64, 256) for row in bench(b, torch.device("cpu"), reps)]
    if torch.cuda.is_available():
        rows += [row for b in (16, 64, 256) for row in bench(b, torch.device("cuda"), reps)]
    return rows


if __name__ == "__main__":
    from kvlab.app.bench import run_script

    run_script(run)
