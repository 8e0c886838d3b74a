"""KV transfer between two processes (gloo over 127.0.0.1): the connector of ``kvlab.distributed`` against one
plain ``torch.distributed`` send of a contiguous tensor of exactly the same bytes, in the same run and the same
process group (the physical limit of the transport here).

Each case moves 4 prompts of 512 tokens (quick: 128) with a Llama-3-8B-shaped KV cache (32 layers, 8 KV
heads of 128, fp16: 128 KiB per token, 256 MiB in all): the connector announces the requests, the receiver
allocates its blocks, and every layer goes as one message per half (K, V) per run of consecutive blocks,
straight from the sender's pool into the receiver's. In the *scattered* case each prompt's blocks are
interleaved with the others' on the sender (as in a busy pool): with 16-token blocks that is 128 runs a layer,
so the sender gathers each layer into one staging message per half; with 256-token blocks it is 8 runs, sent
as 8 messages per half without a copy. The variants alternate round by round and each figure is its best
round, timed on the receiver. Goals (issue 20): >= 0.5x the plain send for 16-token blocks, >= 0.8x for
256-token blocks. ``python benchmarks/bench_transfer.py [--quick]``.
"""
from __future__ import annotations

from kvlab.distributed.measure import TransferCase, measure_transfers

GOALS = {16: 0.5, 256: 0.8}
LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}


def run(quick: bool = False) -> list[dict]:
    tokens, rounds = (128, 2) if quick else (512, 9)
    cases = [TransferCase(block_size, tokens, 4, scattered=scattered, **LLAMA3_8B)
             for scattered in (False, True) for block_size in GOALS]
    rows = []
    for c, t in zip(cases, measure_transfers(cases, rounds)):  # one two-process group for every case
        goal = GOALS[c.block_size]
        layout = "scattered blocks" if c.scattered else "blocks in runs"
        verdict = "" if quick else (" (met)" if t.ratio >= goal else " (not met)")
        name = f"KV transfer, B={c.block_size}, 4 x {tokens} tokens, {layout}"
        rows.append({"name": name + ": throughput", "value": t.gb_per_s, "unit": "GB/s",
                     "baseline": t.plain_gb_per_s, "ratio": t.ratio, "goal": f">= {goal}x one plain send{verdict}"})
        rows.append({"name": name + ": blocks", "value": t.blocks_per_s, "unit": "blocks/s"})
    return rows


if __name__ == "__main__":
    from kvlab.app.bench import run_script

    run_script(run)
