"""Tensor-parallel KV: ``tp`` ranks each hold ``num_kv_heads / tp`` KV heads of every block.

Attention heads are independent, so a rank that owns some query heads needs only the K/V heads they read. Rank
``r`` of ``tp`` keeps query heads ``r * (H / tp) ..`` and their KV heads in a pool whose blocks are ``1 / tp`` of
the single-process block (same block ids, same tables: every rank runs the same manager operations). Each rank
attends over its heads, multiplies by its slice of the output projection (a row-parallel linear layer), and one
all-reduce per layer sums the slices; the MLP is computed whole on every rank (kept simple here; Megatron-style
engines split it too, with one more all-reduce).

When ``tp > num_kv_heads`` a KV head cannot be split, so, as vLLM does, each KV head is *replicated* on
``tp / num_kv_heads`` ranks (each rank still holds one head, and its blocks are ``1 / num_kv_heads`` of the full
block); ``tp`` must then be a multiple of ``num_kv_heads``. Anything that does not divide is refused with a
:class:`ConfigError` naming the numbers.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.core.attention import AttentionWorkspace
from kvlab.core.errors import ConfigError
from kvlab.serve.model import (LlamaConfig, TinyConfig, TinyLlama, check_prompts, generate as generate_seqs, rms_norm,
                               rope)
from kvlab.core.checks import check_count, is_int
from kvlab.core.pool import BlockPool
from kvlab.core.sequence import Sequence, SequenceManager
from kvlab.core.spec import KVSpec
from kvlab.distributed.launch import DEFAULT_TIMEOUT, Link, run_threads, spawn


def head_split(cfg: LlamaConfig, tp: int, rank: int) -> tuple[range, range]:
    """``(query heads, kv heads)`` rank ``rank`` of ``tp`` holds; :class:`ConfigError` when ``tp`` does not fit."""
    if not isinstance(cfg, LlamaConfig):
        raise ConfigError(f"head_split needs a LlamaConfig, got {cfg!r}")
    if not is_int(tp) or tp < 1:
        raise ConfigError(f"tp must be a positive int, got {tp!r}")
    if not is_int(rank) or not 0 <= rank < tp:
        raise ConfigError(f"rank must be in 0..{tp - 1}, got {rank!r}")
    h, kv = cfg.num_heads, cfg.num_kv_heads
    if h % tp:
        raise ConfigError(f"tp={tp} does not divide the {h} query heads")
    if tp <= kv and kv % tp:
        raise ConfigError(f"tp={tp} does not divide the {kv} kv heads")
    if tp > kv and tp % kv:
        raise ConfigError(f"tp={tp} > {kv} kv heads replicates each kv head, so tp must be a multiple of {kv}")
    q = h // tp
    if tp <= kv:
        n = kv // tp
        return range(rank * q, (rank + 1) * q), range(rank * n, (rank + 1) * n)
    head = rank // (tp // kv)  # tp / kv ranks share (replicate) this kv head
    return range(rank * q, (rank + 1) * q), range(head, head + 1)


class TPShard:
    """Rank ``rank``'s slice of a :class:`TinyLlama`: its query and KV heads' projections, its columns of the
    output projection, the rest whole."""

    def __init__(self, model: TinyLlama, tp: int, rank: int) -> None:
        if not isinstance(model, TinyLlama):
            raise ConfigError(f"TPShard needs a TinyLlama, got {model!r}")
        c = model.cfg
        self.model, self.tp, self.rank = model, tp, rank
        self.q_heads, self.kv_heads = head_split(c, tp, rank)
        d = c.head_dim
        qs = slice(self.q_heads.start * d, self.q_heads.stop * d)
        ks = slice(self.kv_heads.start * d, self.kv_heads.stop * d)
        self.layers = [{**p, "wq": p["wq"][qs], "wk": p["wk"][ks], "wv": p["wv"][ks], "wo": p["wo"][:, qs]}
                       for p in model.layers]
        self.workspace = AttentionWorkspace()

    def kv_spec(self, block_size: int = 16) -> KVSpec:
        """The spec of this rank's pool: ``len(kv_heads)`` heads per block."""
        c = self.model.cfg
        return KVSpec(c.num_layers, len(self.kv_heads), c.head_dim, block_size, self.model.dtype,
                                 self.model.device)

    @torch.no_grad()
    def step(self, link: Link, manager: SequenceManager, seqs: Seq[Sequence], new_tokens: Seq[Seq[int]]
             ) -> torch.Tensor:
        """:meth:`TinyLlama.step` on this rank's heads; one all-reduce per layer combines the ranks. Returns
        the logits of each sequence's last new token (the same on every rank; an empty batch, the same on
        every rank too, changes nothing and returns ``[0, vocab]``)."""
        c, m = self.model.cfg, self.model
        storage, flat = m.check_step(manager, seqs, new_tokens, len(self.kv_heads))
        if not flat:
            return m.embed.new_empty(0, c.vocab_size)
        x = m.embed[torch.tensor(flat, dtype=torch.long)]
        batch = manager.append_batch(seqs, new_tokens)
        hq, hk = len(self.q_heads), len(self.kv_heads)
        for layer, p in enumerate(self.layers):
            h = rms_norm(x, p["attn_norm"], c.eps)
            q = rope((h @ p["wq"].T).view(-1, hq, c.head_dim), batch.positions, c.rope_theta)
            k = rope((h @ p["wk"].T).view(-1, hk, c.head_dim), batch.positions, c.rope_theta)
            v = (h @ p["wv"].T).view(-1, hk, c.head_dim)
            storage.write_slots(layer, batch.slots, k, v)
            attn = m.attention(q, storage, layer, batch.block_tables, batch.seq_lens, batch.query_lens,
                               workspace=self.workspace)
            part = (attn.reshape(x.shape[0], -1) @ p["wo"].T).contiguous()
            link.all_reduce(part)  # the row-parallel output projection: sum of every rank's heads
            x = x + part
            h = rms_norm(x, p["mlp_norm"], c.eps)
            x = x + (F.silu(h @ p["w_gate"].T) * (h @ p["w_up"].T)) @ p["w_down"].T
        for seq in seqs:
            manager.cache_full_blocks(seq)
        last = torch.tensor(batch.query_lens).cumsum(0) - 1
        return rms_norm(x[last], m.norm, c.eps) @ m.lm_head.T


def generate(step: Any, manager: SequenceManager, prompts: Seq[Seq[int]], max_new_tokens: int,
             cfg: TinyConfig | None = None) -> tuple[list[list[int]], list[list[list[float]]]]:
    """Greedy generation with ``step(manager, seqs, new_tokens) -> logits`` (:func:`kvlab.serve.model.generate`, for
    ``cfg``'s vocabulary): the tokens and every step's logits. The sequences are freed at the end."""
    seqs, out, logits = generate_seqs(step, manager, prompts, max_new_tokens, (cfg or TinyConfig()).vocab_size)
    for s in seqs:
        manager.free(s)
    return out, [lg.tolist() for lg in logits]


def tp_rank(link: Link, prompts: Seq[Seq[int]], *, max_new_tokens: int = 8, cfg: TinyConfig | None = None,
            block_size: int = 16, num_blocks: int = 256) -> dict[str, Any]:
    """One rank of a tensor-parallel run: its own pool of ``num_kv_heads / tp`` heads, greedy generation."""
    cfg = cfg or TinyConfig()
    shard = TPShard(TinyLlama(cfg), link.world_size, link.rank)
    pool = BlockPool(num_blocks, spec=shard.kv_spec(block_size))
    manager = SequenceManager(pool, prefix_cache=True)
    tokens, logits = generate(lambda mg, s, t: shard.step(link, mg, s, t), manager, prompts, max_new_tokens, cfg)
    manager.check_invariants()
    return {"tokens": tokens, "logits": logits, "kv_heads": list(shard.kv_heads),
            "bytes_per_block": pool.bytes_per_block}


def single_process(prompts: Seq[Seq[int]], max_new_tokens: int, *, cfg: TinyConfig | None = None,
                   block_size: int = 16, num_blocks: int = 256) -> dict[str, Any]:
    """The reference: the whole model in one pool."""
    cfg = cfg or TinyConfig()
    model = TinyLlama(cfg)
    pool = BlockPool(num_blocks, spec=cfg.kv_spec(block_size))
    tokens, logits = generate(model.step, SequenceManager(pool, prefix_cache=True), prompts, max_new_tokens, cfg)
    return {"tokens": tokens, "logits": logits, "bytes_per_block": pool.bytes_per_block}


def run_tp(prompts: Seq[Seq[int]], max_new_tokens: int = 8, *, tp: int = 2, cfg: TinyConfig | None = None,
           block_size: int = 16, num_blocks: int = 256, timeout: float = DEFAULT_TIMEOUT,
           threads: bool = False) -> list[dict[str, Any]]:
    """Run ``tp`` ranks (processes on 127.0.0.1, or threads) and return each rank's result. The head split, the
    prompts and ``max_new_tokens`` are checked here first, so they are refused before any process starts."""
    cfg = cfg or TinyConfig()
    for r in range(tp if is_int(tp) and tp > 0 else 1):
        head_split(cfg, tp, r)
    kw = {"prompts": check_prompts(prompts, cfg.vocab_size),
          "max_new_tokens": check_count(max_new_tokens, "max_new_tokens"), "cfg": cfg,
          "block_size": block_size, "num_blocks": num_blocks}
    return (run_threads if threads else spawn)([tp_rank] * tp, [kw] * tp, timeout=timeout)
