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

import math
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .attention import AttentionWorkspace, contiguous_attention, paged_attention
from .checks import check_count, check_positive, is_int
from .errors import ConfigError, KVLabError
from .sequence import Sequence, SequenceManager
from .spec import KVSpec
from .storage import KVStorage


def check_tokens(tokens: Any, vocab_size: int, what: str) -> list[int]:
    """``tokens`` as a list of ids, else :class:`ConfigError` naming the first bad one: a non-empty list (tuple,
    range) of ints in ``0..vocab_size - 1``."""
    if not isinstance(tokens, (list, tuple, range)) or not tokens:
        raise ConfigError(f"{what} must be a non-empty list of token ids, got {tokens!r}")
    for i, t in enumerate(tokens):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise ConfigError(f"{what}: token {i} is {t!r}, not an id in 0..{vocab_size - 1}")
    return [int(t) for t in tokens]


def check_prompts(prompts: Any, vocab_size: int) -> list[list[int]]:
    """A batch of prompts as lists of ids (see :func:`check_tokens`), else :class:`ConfigError`."""
    if not isinstance(prompts, (list, tuple)):
        raise ConfigError(f"prompts must be a list of prompts, got {prompts!r}")
    return [check_tokens(p, vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]


def check_pool(manager: Any, cfg: TinyConfig, dtype: torch.dtype, device: torch.device,
               kv_heads: int | None = None) -> KVStorage:
    """``manager``'s KV storage, once checked to hold ``cfg``'s K/V (``kv_heads`` heads per block: all of them,
    or a tensor-parallel rank's) in ``dtype`` on ``device``; else :class:`ConfigError` naming both layouts. The
    block size is the pool's own."""
    if not isinstance(manager, SequenceManager):
        raise ConfigError(f"expected a SequenceManager, got {manager!r}")
    storage = manager.pool.storage_of()
    s = storage.spec
    have = (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, storage.kv.device)
    want = (cfg.num_layers, cfg.num_kv_heads if kv_heads is None else kv_heads, cfg.head_dim, dtype, device)
    if have != want:
        layout = "{} layers x {} kv heads x head_dim {} of {} on {}"
        raise ConfigError(f"the pool holds {layout.format(*have)}; the model needs {layout.format(*want)} "
                          f"(use cfg.kv_spec())")
    return storage


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim"):
            object.__setattr__(self, name, check_positive(getattr(self, name), f"TinyConfig.{name}"))
        for name in ("rope_theta", "eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ConfigError(f"TinyConfig.{name} must be a positive finite number, got {value!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 64:  # what torch's generator takes
            raise ConfigError(f"TinyConfig.seed must be an int in 0..2**64-1, got {self.seed!r}")
        if self.dim % self.num_heads or self.head_dim % 2:  # rotary embeddings rotate pairs of a head's dims
            raise ConfigError(f"TinyConfig.dim={self.dim} does not split into num_heads={self.num_heads} heads "
                              f"of an even size")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"TinyConfig.num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")

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
        if not isinstance(cfg, TinyConfig):
            raise ConfigError(f"TinyLlama needs a TinyConfig, got {cfg!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"TinyLlama's dtype must be a floating torch.dtype, got {dtype!r}")
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

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.embed[torch.tensor(ids, dtype=torch.long, device=self.device)]

    def check_step(self, manager: SequenceManager, seqs: Seq[Sequence], new_tokens: Seq[Seq[int]],
                   kv_heads: int | None = None) -> tuple[KVStorage, list[int]]:
        """What :meth:`step` checks before anything changes: the pool's layout (:func:`check_pool`), one list of
        new token ids per sequence. Returns the storage and the new ids, flattened. (The sequences themselves
        are checked by ``append_batch``, which also changes nothing when it refuses.)"""
        storage = check_pool(manager, self.cfg, self.dtype, self.embed.device, kv_heads)
        if not isinstance(seqs, (list, tuple)) or not isinstance(new_tokens, (list, tuple)) \
                or len(seqs) != len(new_tokens):
            raise ConfigError(f"a step needs a list of sequences and a list of new tokens for each, got {seqs!r} "
                              f"and {new_tokens!r}")
        return storage, [t for i, toks in enumerate(new_tokens)
                         for t in check_tokens(toks, self.cfg.vocab_size, f"new tokens of sequence {i}")]

    @torch.no_grad()
    def forward_full(self, tokens: Seq[int]) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` recomputing everything, no cache."""
        x = self._embed(check_tokens(tokens, self.cfg.vocab_size, "tokens"))
        pos = torch.arange(x.shape[0], device=self.device)
        for p in self.layers:
            q, k, v = self._qkv(p, x, pos)
            x = self._finish_layer(p, x, contiguous_attention(q, [k], [v], [x.shape[0]]))
        return self._logits(x)

    @torch.no_grad()
    def step(self, manager: SequenceManager, seqs: Seq[Sequence], new_tokens: Seq[Seq[int]]) -> torch.Tensor:
        """Feed ``new_tokens[i]`` (at least one token) to ``seqs[i]`` through the paged cache; returns the logits
        of each sequence's last new token ``[batch, vocab]``. Full blocks are then offered to the prefix cache. An
        empty batch changes nothing and returns ``[0, vocab]``. Bad input is refused before anything changes."""
        storage, ids = self.check_step(manager, seqs, new_tokens)
        if not ids:
            return self.embed.new_empty(0, self.cfg.vocab_size)
        x = self._embed(ids)
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
        """Greedy generation for a batch of prompts through the paged cache (:func:`kvlab.model.generate`: bad
        input refused first, nothing left allocated on failure). Returns the sequences (still live; free them when
        done) and the generated tokens of each."""
        seqs, out, _ = generate(self.step, manager, prompts, max_new_tokens, self.cfg.vocab_size, tenant)
        return seqs, out

    def generate_full(self, prompt: Seq[int], max_new_tokens: int) -> list[int]:
        """Reference greedy generation recomputing the whole prefix at each step."""
        toks = check_tokens(prompt, self.cfg.vocab_size, "prompt")
        check_count(max_new_tokens, "max_new_tokens")
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


def generate(step: Step, manager: SequenceManager, prompts: Seq[Seq[int]], max_new_tokens: int, vocab_size: int,
             tenant: str | None = None) -> tuple[list[Sequence], list[list[int]], list[torch.Tensor]]:
    """Greedy generation for a batch of prompts through ``step`` (prompts may hit the prefix cache): the live
    sequences, each one's new tokens and every step's logits. Everything is checked before the first sequence is
    created; a failure found only later (e.g. :class:`OutOfBlocksError`) frees the sequences created, then
    propagates."""
    prompts = check_prompts(prompts, vocab_size)
    check_count(max_new_tokens, "max_new_tokens")
    step(manager, [], [])  # an empty step checks the manager and its pool, and changes nothing
    seqs: list[Sequence] = []
    try:
        for p in prompts:
            seqs.append(manager.create(p, tenant=tenant))
        feed = [p[s.num_tokens:] for s, p in zip(seqs, prompts)]  # what a prefix hit did not cache
        out, logits = greedy(step, manager, seqs, feed, max_new_tokens)
    except KVLabError:
        for s in seqs:
            manager.free(s)
        raise
    return seqs, out, logits
