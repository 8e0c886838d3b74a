"""A tiny llama-style decoder that proves the paged cache end to end (no download, random weights).

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, a few layers, weights drawn from
a fixed seed. Two ways to run it:

* :meth:`TinyLlama.forward_full` recomputes the whole prefix every step with plain tensors and the reference
  :func:`kvlab.attention.contiguous_attention` (no cache at all);
* :meth:`TinyLlama.step` runs only the new tokens of a batch of sequences: it appends them through
  :class:`kvlab.SequenceManager` (blocks on demand, copy-on-write, prefix-cache hits), writes their K/V into the
  pool's slots (one ``index_copy_`` per layer) and attends with :func:`kvlab.paged_attention`.

Greedy generation through :meth:`step` gives exactly the tokens of :meth:`forward_full`: the cache changes
where K/V live, never what attention computes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionWorkspace, contiguous_attention, paged_attention
from .errors import ConfigError
from .sequence import Sequence, SequenceManager
from .spec import KVSpec


@dataclass(frozen=True)
class TinyConfig:
    """Model shape. ``head_dim = dim // num_heads``; ``num_heads`` is a multiple of ``num_kv_heads`` (GQA)."""
    vocab_size: int = 101
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-6
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def kv_spec(self, block_size: int = 16, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> KVSpec:
        """The :class:`KVSpec` a pool needs to hold this model's K/V."""
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype, torch.device(device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, dim]`` by its positions (rotate-half convention)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    ang = positions.to(torch.float32)[:, None] * freqs  # [tokens, half]
    cos, sin = ang.cos()[:, None].to(x.dtype), ang.sin()[:, None].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class TinyLlama:
    """The decoder's weights and its two forward paths (see the module docstring)."""

    def __init__(self, cfg: TinyConfig = TinyConfig(), dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if cfg.dim % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"dim {cfg.dim}, heads {cfg.num_heads}, kv heads {cfg.num_kv_heads} do not divide")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        g = torch.Generator().manual_seed(cfg.seed)
        hd, d = cfg.head_dim, cfg.dim

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(self.device, dtype)

        self.embed = w(cfg.vocab_size, d) * d ** 0.5
        self.layers = [{"attn_norm": torch.ones(d, device=self.device, dtype=dtype),
                        "wq": w(cfg.num_heads * hd, d), "wk": w(cfg.num_kv_heads * hd, d),
                        "wv": w(cfg.num_kv_heads * hd, d), "wo": w(d, cfg.num_heads * hd),
                        "mlp_norm": torch.ones(d, device=self.device, dtype=dtype),
                        "w_gate": w(cfg.ffn_dim, d), "w_up": w(cfg.ffn_dim, d), "w_down": w(d, cfg.ffn_dim)}
                       for _ in range(cfg.num_layers)]
        self.norm = torch.ones(d, device=self.device, dtype=dtype)
        self.lm_head = w(cfg.vocab_size, d)
        self.workspace = AttentionWorkspace()

    def _qkv(self, p: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor):
        c = self.cfg
        h = rms_norm(x, p["attn_norm"], c.eps)
        q = rope((h @ p["wq"].T).view(-1, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = rope((h @ p["wk"].T).view(-1, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        return q, k, (h @ p["wv"].T).view(-1, c.num_kv_heads, c.head_dim)

    def _finish_layer(self, p: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + attn.reshape(x.shape[0], -1) @ p["wo"].T
        h = rms_norm(x, p["mlp_norm"], self.cfg.eps)
        return x + (F.silu(h @ p["w_gate"].T) * (h @ p["w_up"].T)) @ p["w_down"].T

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm, self.cfg.eps) @ self.lm_head.T

    def _embed(self, tokens: Seq[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.cfg.vocab_size:
            raise ConfigError(f"token ids must be in 0..{self.cfg.vocab_size - 1}, got {ids.tolist()}")
        return self.embed[ids]

    @torch.no_grad()
    def forward_full(self, tokens: Seq[int]) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` recomputing everything, no cache."""
        x = self._embed(tokens)
        pos = torch.arange(x.shape[0], device=self.device)
        for p in self.layers:
            q, k, v = self._qkv(p, x, pos)
            x = self._finish_layer(p, x, contiguous_attention(q, [k], [v], [x.shape[0]]))
        return self._logits(x)

    @torch.no_grad()
    def step(self, manager: SequenceManager, seqs: Seq[Sequence], new_tokens: Seq[Seq[int]]) -> torch.Tensor:
        """Feed ``new_tokens[i]`` to ``seqs[i]`` through the paged cache; returns the logits of each sequence's
        last new token ``[batch, vocab]``. Full blocks are then offered to the prefix cache."""
        storage = manager.pool.storage_of()
        if storage.spec.dtype != self.dtype or storage.spec.num_layers != self.cfg.num_layers:
            raise ConfigError(f"the pool holds {storage.spec.num_layers} layers of {storage.spec.dtype}; the model "
                              f"needs {self.cfg.num_layers} of {self.dtype} (use cfg.kv_spec())")
        if any(not len(t) for t in new_tokens):
            raise ConfigError("every sequence in a step needs at least one new token")
        x = self._embed([t for toks in new_tokens for t in toks])
        batch = manager.append_batch(seqs, new_tokens)
        for layer, p in enumerate(self.layers):
            q, k, v = self._qkv(p, x, batch.positions)
            storage.write_slots(layer, batch.slots, k, v)
            attn = paged_attention(q, storage, layer, batch.block_tables, batch.seq_lens, batch.query_lens,
                                   workspace=self.workspace)
            x = self._finish_layer(p, x, attn)
        for seq in seqs:
            manager.cache_full_blocks(seq)
        last = torch.tensor(batch.query_lens, device=self.device).cumsum(0) - 1
        return self._logits(x[last])

    def generate(self, manager: SequenceManager, prompts: Seq[Seq[int]], max_new_tokens: int,
                 tenant: str | None = None) -> tuple[list[Sequence], list[list[int]]]:
        """Greedy generation for a batch of prompts through the paged cache (prompts may hit the prefix cache).
        Returns the sequences (still live; free them when done) and the generated tokens of each."""
        seqs = [manager.create(p, tenant=tenant) for p in prompts]
        feed = [list(p)[s.num_tokens:] for s, p in zip(seqs, prompts)]  # what a prefix hit did not cache
        return seqs, greedy(self.step, manager, seqs, feed, max_new_tokens)[0]

    def generate_full(self, prompt: Seq[int], max_new_tokens: int) -> list[int]:
        """Reference greedy generation recomputing the whole prefix at each step."""
        toks = list(prompt)
        for _ in range(max_new_tokens):
            toks.append(int(self.forward_full(toks)[-1].argmax()))
        return toks[len(prompt):]


Step = Callable[[SequenceManager, Seq[Sequence], Seq[Seq[int]]], torch.Tensor]


def greedy(step: Step, manager: SequenceManager, seqs: Seq[Sequence], feed: Seq[Seq[int]],
           max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding through the paged cache: ``step(manager, seqs, feed)`` appends the tokens fed to each
    sequence and returns one row of logits per sequence (``TinyLlama.step``, or a tensor-parallel one); each
    row's argmax is fed next. Returns each sequence's new tokens and every step's logits."""
    out: list[list[int]] = [[] for _ in seqs]
    logits: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        lg = step(manager, seqs, feed)
        logits.append(lg)
        nxt = [int(t) for t in lg.argmax(-1).tolist()]
        for o, t in zip(out, nxt):
            o.append(t)
        feed = [[t] for t in nxt]
    return out, logits
