"""Disaggregated prefill and decode: one rank computes prompts, another generates from the shipped KV cache.

The prefill rank (rank 0) runs the tiny decoder over each batch of prompts in its own pool, takes each prompt's
first token from the prefill logits, and ships the prompt's KV blocks with a :class:`KVSender`. The decode rank
(rank 1) has its own pool (other physical block ids, possibly another block size): for every request it looks
up its prefix cache, allocates blocks for the rest of the prompt, receives them with a :class:`KVReceiver`,
registers them in its prefix cache and decodes greedily. :func:`reference` runs the same batches in one
process; :class:`DisaggResult.compare` says how far the two runs are apart (tokens equal, logits within 1e-4).

Here every layer is saved after the prefill step has finished; a real engine calls ``save_kv_layer`` inside the
forward pass, right after each layer's attention, so the transfer of layer ``l`` overlaps layer ``l + 1``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.core.errors import ConfigError, KVLabError
from kvlab.core.interrupts import atomic
from kvlab.core.checks import check_count, check_device, check_positive, check_real, check_seed, check_token_ids
from kvlab.serve.model import TinyConfig, TinyLlama, check_pool, greedy
from kvlab.core.pool import BlockPool
from kvlab.core.sequence import Sequence, SequenceManager
from kvlab.distributed.connector import KVReceiver, KVSender, RemoteRequest, TransferReport
from kvlab.distributed.launch import DEFAULT_TIMEOUT, Link, from_env, run_threads, spawn

Batches = Seq[Seq[Seq[int]]]
PREFILL, DECODE = 0, 1


def make_manager(cfg: TinyConfig, block_size: int, num_blocks: int,
                 device: torch.device | str = "cpu") -> SequenceManager:
    """A pool of ``num_blocks`` blocks for ``cfg``'s K/V (fp32, on ``device``) with a prefix cache."""
    if not isinstance(cfg, TinyConfig):
        raise ConfigError(f"make_manager needs a TinyConfig, got {cfg!r}")
    return SequenceManager(BlockPool(num_blocks, spec=cfg.kv_spec(block_size, device=device)), prefix_cache=True)


def _check_batches(batches: Any, cfg: TinyConfig) -> list[list[list[int]]]:
    if not isinstance(batches, (list, tuple)) or not batches:
        raise ConfigError(f"batches must be a non-empty list of batches of prompts, got {batches!r}")
    out = []
    for i, batch in enumerate(batches):
        if not isinstance(batch, (list, tuple)) or not batch:
            raise ConfigError(f"batch {i} must be a non-empty list of prompts, got {batch!r}")
        out.append([check_token_ids(p, f"batch {i}, prompt {j}", cfg.vocab_size) for j, p in enumerate(batch)])
    return out


def _check_cfg(cfg: Any) -> TinyConfig:
    """``cfg``, or the default config for None."""
    if cfg is None:
        return TinyConfig()
    if not isinstance(cfg, TinyConfig):
        raise ConfigError(f"cfg must be a TinyConfig or None, got {cfg!r}")
    return cfg


def _check_pace(pace: Any) -> float:
    """Seconds of pause between layers: a finite number >= 0."""
    return check_real(pace, "pace", lo=0, unit=" of seconds")


def prefill_rank(link: Link, batches: Batches, *, cfg: TinyConfig | None = None, block_size: int = 16,
                 num_blocks: int = 512, peer: int = DECODE, manager: SequenceManager | None = None,
                 pace: float = 0.0) -> dict[str, Any]:
    """The prefill rank: compute each batch's prompts, ship their KV, free them once sent. Returns the first
    tokens, the prefill logits and the sender's :class:`TransferReport` (as a dict). ``pace`` seconds of pause
    between layers let a live view keep up (the notebook; 0 elsewhere)."""
    cfg = _check_cfg(cfg)
    batches, pace = _check_batches(batches, cfg), _check_pace(pace)
    model = TinyLlama(cfg, device=link.device)
    manager = manager if manager is not None else make_manager(cfg, block_size, num_blocks, link.device)
    conn = KVSender(link, manager, peer)
    first: list[list[int]] = []
    logits: list[list[list[float]]] = []
    rid = 0
    seqs: list[Sequence] = []
    try:
        for batch in batches:
            seqs = []
            _open(manager, batch, seqs)
            out = model.step(manager, seqs, [p[s.num_tokens:] for s, p in zip(seqs, batch)])
            tokens = out.argmax(-1).tolist()
            by_id = {}
            for s, p, t in zip(seqs, batch, tokens):
                conn.request_finished(RemoteRequest(rid, tuple(p), int(t)), s)
                by_id[rid] = s
                rid += 1
            conn.start_save(conn.build_connector_meta())
            for layer in range(cfg.num_layers):
                conn.save_kv_layer(layer)
                if pace:
                    time.sleep(pace)
            conn.wait_for_save()
            for r in conn.get_finished():
                manager.free(by_id[r])
            first.append(tokens)
            logits.append(out.tolist())
    except KeyboardInterrupt:  # stopped between calls: no send still posted may read a block once it is reused
        conn.cancel(seqs)
        raise
    conn.finish()
    manager.check_invariants()
    return {"first_tokens": first, "logits": logits, "report": conn.report.as_dict()}


def decode_rank(link: Link, *, max_new_tokens: int = 8, cfg: TinyConfig | None = None, block_size: int = 16,
                num_blocks: int = 512, peer: int = PREFILL, manager: SequenceManager | None = None,
                pace: float = 0.0) -> dict[str, Any]:
    """The decode rank: receive each batch's prompt KV into its own blocks (skipping what its prefix cache
    holds), decode ``max_new_tokens`` tokens per request (the first comes from the prefill rank), free them.
    Returns the generated tokens, the logits of each decode step and the receiver's report (as a dict)."""
    cfg = _check_cfg(cfg)
    max_new_tokens, pace = check_positive(max_new_tokens, "max_new_tokens"), _check_pace(pace)
    model = TinyLlama(cfg, device=link.device)
    manager = manager if manager is not None else make_manager(cfg, block_size, num_blocks, link.device)
    conn = KVReceiver(link, manager, peer)
    tokens: list[list[list[int]]] = []
    logits: list[list[list[list[float]]]] = []
    seqs: list[Sequence] = []
    try:
        while (requests := conn.poll_requests()) is not None:
            seqs = []
            _open(manager, [r.prompt for r in requests], seqs, (conn, requests))
            conn.start_load_kv(conn.build_connector_meta())
            for layer in range(cfg.num_layers):
                conn.wait_for_layer_load(layer)
                if pace:
                    time.sleep(pace)
            conn.get_finished()
            for s in seqs:
                manager.cache_full_blocks(s)  # the received blocks serve later prompts with the same prefix
            rest, steps = greedy(model.step, manager, seqs, [[r.first_token] for r in requests], max_new_tokens - 1)
            for s in seqs:
                manager.free(s)
            tokens.append([[r.first_token, *more] for r, more in zip(requests, rest)])
            logits.append([lg.tolist() for lg in steps])
    except KeyboardInterrupt:  # stopped between calls: no receive still posted may land in a block once reused
        conn.cancel(seqs)
        raise
    manager.check_invariants()
    return {"tokens": tokens, "logits": logits, "report": conn.report.as_dict()}


@atomic()
def _open(manager: SequenceManager, prompts: Seq[Seq[int]], seqs: list[Sequence],
          receiving: tuple[KVReceiver, Seq[RemoteRequest]] | None = None) -> None:
    """A sequence per prompt into ``seqs``, all or none (out of blocks: what was made is given back, then the
    error raised). Into the caller's list, not returned: an interrupt is raised as this returns, and a sequence
    made but never listed would leak. ``receiving`` (the connector and the prompts' requests): each sequence
    also takes blocks for what will arrive, beyond its local prefix hit, and is handed to the connector."""
    try:
        for i, p in enumerate(prompts):
            seq = manager.create(list(p), tenant=receiving[1][i].tenant if receiving else None)
            seqs.append(seq)
            if receiving:
                manager.append_tokens([seq], [list(p[seq.num_tokens:])])
                receiving[0].update_state_after_alloc(receiving[1][i], seq)
    except KVLabError:
        for s in seqs:
            manager.free(s)
        raise


def reference(batches: Batches, max_new_tokens: int, *, cfg: TinyConfig | None = None,
              block_size: int = 16, num_blocks: int = 512) -> dict[str, Any]:
    """The same batches in one process and one pool: tokens, prefill logits and decode-step logits."""
    cfg = _check_cfg(cfg)
    batches, max_new_tokens = _check_batches(batches, cfg), check_positive(max_new_tokens, "max_new_tokens")
    model, manager = TinyLlama(cfg), make_manager(cfg, block_size, num_blocks)
    tokens, prefill, decode = [], [], []
    for batch in batches:
        seqs = [manager.create(p) for p in batch]
        lg = model.step(manager, seqs, [p[s.num_tokens:] for s, p in zip(seqs, batch)])
        prefill.append(lg.tolist())
        out = [[int(t)] for t in lg.argmax(-1).tolist()]
        steps = []
        for _ in range(max_new_tokens - 1):
            lg = model.step(manager, seqs, [[o[-1]] for o in out])
            steps.append(lg.tolist())
            for o, t in zip(out, lg.argmax(-1).tolist()):
                o.append(int(t))
        for s in seqs:
            manager.free(s)
        tokens.append(out)
        decode.append(steps)
    return {"tokens": tokens, "prefill_logits": prefill, "logits": decode}


@dataclass
class DisaggResult:
    """Both ranks' results: tokens generated on the decode rank, logits of both, and the two reports."""
    tokens: list[list[list[int]]]
    prefill_logits: list[list[list[float]]]
    decode_logits: list[list[list[list[float]]]]
    sent: TransferReport
    received: TransferReport
    seconds: float

    def compare(self, ref: dict[str, Any]) -> dict[str, Any]:
        """``{"tokens_equal": bool, "max_logit_diff": float}`` against :func:`reference`'s result."""
        diff = 0.0
        for mine, theirs in ((self.prefill_logits, ref["prefill_logits"]), (self.decode_logits, ref["logits"])):
            a, b = torch.tensor(_flat(mine)), torch.tensor(_flat(theirs))
            if a.shape != b.shape:
                return {"tokens_equal": False, "max_logit_diff": float("inf")}
            if a.numel():
                diff = max(diff, float((a - b).abs().max()))
        return {"tokens_equal": self.tokens == ref["tokens"], "max_logit_diff": diff}


def _flat(x: Any) -> list[float]:
    return [v for item in x for v in (_flat(item) if isinstance(item, list) else [item])]


def _report(d: dict[str, Any]) -> TransferReport:
    return TransferReport(**{k: v for k, v in d.items() if k != "gb_per_s"})


def run_disagg(batches: Batches, max_new_tokens: int = 8, *, cfg: TinyConfig | None = None,
               block_size: int = 16, decode_block_size: int | None = None, num_blocks: int = 512,
               timeout: float = DEFAULT_TIMEOUT, threads: bool = False,
               managers: tuple[SequenceManager, SequenceManager] | None = None,
               pace: float = 0.0) -> DisaggResult:
    """Run prefill (rank 0) and decode (rank 1) as two processes on 127.0.0.1 (gloo), or as two threads of
    this process (``threads=True``; ``managers`` then lets the caller watch both pools). Every argument is
    checked here, before any rank starts (a rank refusing one would leave its peer waiting for the timeout)."""
    cfg, pace = _check_cfg(cfg), _check_pace(pace)
    dbs = block_size if decode_block_size is None else decode_block_size
    for name, value in (("block_size", block_size), ("decode_block_size", dbs), ("num_blocks", num_blocks)):
        check_positive(value, name)
    pre: dict[str, Any] = {"batches": _check_batches(batches, cfg), "cfg": cfg, "block_size": block_size,
                           "num_blocks": num_blocks, "pace": pace}
    dec: dict[str, Any] = {"max_new_tokens": check_positive(max_new_tokens, "max_new_tokens"), "cfg": cfg,
                           "block_size": dbs, "num_blocks": num_blocks, "pace": pace}
    if managers is not None:
        if not threads:
            raise ConfigError("managers can only be shared with ranks that are threads (threads=True)")
        if not isinstance(managers, (list, tuple)) or len(managers) != 2:
            raise ConfigError(f"managers must be a pair (prefill, decode), got {managers!r}")
        for m in managers:  # the ranks are threads here: their models live on the CPU
            check_pool(m, cfg, torch.float32, torch.device("cpu"))
        pre["manager"], dec["manager"] = managers
    t0 = time.perf_counter()
    runner = run_threads if threads else spawn
    p, d = runner([prefill_rank, decode_rank], [pre, dec], timeout=timeout)
    return DisaggResult(d["tokens"], p["logits"], d["logits"], _report(p["report"]), _report(d["report"]),
                        time.perf_counter() - t0)


def demo_batches(prompts: int = 4, prompt_len: int = 200, shared: int = 128, seed: int = 0,
                 vocab: int = TinyConfig().vocab_size) -> list[list[list[int]]]:
    """Two batches of ``prompts`` prompts each: every prompt starts with the same ``shared`` tokens (a system
    prompt), so the second batch finds that prefix already cached on the decode rank."""
    check_positive(prompts, "prompts")
    check_positive(vocab, "vocab")
    if check_count(shared, "shared") >= check_positive(prompt_len, "prompt_len"):
        raise ConfigError(f"shared prefix {shared} must be in 0..prompt_len-1 ({prompt_len - 1})")
    g = torch.Generator().manual_seed(check_seed(seed))
    head = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [[head + torch.randint(0, vocab, (prompt_len - shared,), generator=g).tolist()
             for _ in range(prompts)] for _ in range(2)]


# ------------------------------------------------------------------------------------------------ command line
def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of ``kvlab disagg``."""
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch (two batches; default 4)")
    p.add_argument("--prompt-len", type=int, default=200, help="tokens per prompt (default 200)")
    p.add_argument("--shared", type=int, default=128, help="tokens every prompt shares (default 128)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens to generate per prompt (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="prefill rank's block size (default 16)")
    p.add_argument("--decode-block-size", type=int, default=None, help="decode rank's (default: the same)")
    p.add_argument("--blocks", type=int, default=512, help="blocks per pool (default 512)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds any wait on a peer may take")
    p.add_argument("--device", default="cpu", help="under torchrun: 'cuda' puts each rank's pool on its GPU "
                                                   "(LOCAL_RANK) and uses NCCL; default cpu and gloo")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


def main(args: argparse.Namespace) -> int:
    """``kvlab disagg``: two processes here, or this rank of a ``torchrun`` group (``RANK`` set)."""
    if args.decode_block_size is None:
        args.decode_block_size = args.block_size
    for name in ("prompts", "prompt_len", "new_tokens", "block_size", "decode_block_size", "blocks"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    device = check_device(args.device, "--device")  # one this machine has: not cuda without a GPU, not meta
    if "RANK" not in os.environ and device.type != "cpu":
        raise ConfigError(f"--device {args.device} is for ranks started by torchrun (NCCL); the two local ranks "
                          "run on the CPU over gloo: leave --device out, or start kvlab disagg with torchrun")
    batches = demo_batches(args.prompts, args.prompt_len, args.shared)
    cfg = TinyConfig()
    dbs = args.decode_block_size
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        link = from_env(args.timeout, device)
        if link.world_size != 2:
            raise ConfigError(f"kvlab disagg runs on 2 ranks, torchrun started {link.world_size}")
        if link.rank == PREFILL:
            out = prefill_rank(link, batches, cfg=cfg, block_size=args.block_size, num_blocks=args.blocks)
            print(f"rank 0 (prefill): {_report(out['report'])}")
        else:
            out = decode_rank(link, max_new_tokens=args.new_tokens, cfg=cfg, block_size=dbs,
                              num_blocks=args.blocks)
            print(f"rank 1 (decode): {_report(out['report'])}")
        return 0
    print(f"kvlab disagg: prefill rank 0 and decode rank 1 on 127.0.0.1 (gloo), {len(batches)} batches of "
          f"{args.prompts} prompts x {args.prompt_len} tokens ({args.shared} shared), block sizes "
          f"{args.block_size} -> {dbs}", file=sys.stderr)
    res = run_disagg(batches, args.new_tokens, cfg=cfg, block_size=args.block_size, decode_block_size=dbs,
                     num_blocks=args.blocks, timeout=args.timeout)
    check = res.compare(reference(batches, args.new_tokens, cfg=cfg, block_size=args.block_size,
                                  num_blocks=args.blocks))
    if args.json:
        print(json.dumps({"sent": res.sent.as_dict(), "received": res.received.as_dict(), **check,
                          "seconds": res.seconds}))
    else:
        print(f"rank 0 {res.sent}")
        print(f"rank 1 {res.received}")
        print(f"greedy tokens equal to one process: {check['tokens_equal']}; largest logit difference "
              f"{check['max_logit_diff']:.2e}; wall time {res.seconds:.2f} s (both processes' start included)")
    return 0 if check["tokens_equal"] and check["max_logit_diff"] <= 1e-4 else 1
