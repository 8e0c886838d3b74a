"""One Llama decoder that writes its K/V into the paged cache: a tiny random one, or a real model.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP. :class:`Llama` holds the weights
and runs them; where they come from is the only difference between the two models kvlab ships:

* :class:`TinyLlama`: a few layers drawn from a fixed seed (no download, instant; its output is noise);
* a real model read from a GGUF file by :func:`kvlab.load_model` (e.g. SmolLM2-135M-Instruct, 30 layers).

Two ways to run either:

* :meth:`Llama.forward_full` recomputes the whole prefix every step with plain tensors and the reference
  :func:`kvlab.core.attention.contiguous_attention` (no cache at all);
* :meth:`Llama.step` runs only the new tokens of a batch of sequences: it appends them through
  :class:`kvlab.SequenceManager` (blocks on demand, copy-on-write, prefix-cache hits), writes their K/V into the
  pool's slots (one ``index_copy_`` per layer) and attends with :func:`kvlab.paged_attention` (on the CPU
  in fp32, its decode rows by the compiled kernel of :mod:`kvlab.fast.attention`).

Greedy generation through :meth:`step` gives exactly the tokens of :meth:`forward_full`: the cache changes
where K/V live, never what attention computes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.core.attention import AttentionWorkspace, contiguous_attention
from kvlab.core.checks import check_count, check_positive, check_real, check_seed, check_token_ids
from kvlab.core.errors import ConfigError, KVLabError
from kvlab.core.sequence import Sequence, SequenceManager
from kvlab.fast import choose
from kvlab.core.spec import KVSpec
from kvlab.core.storage import KVStorage


def check_prompts(prompts: Any, vocab_size: int) -> list[list[int]]:
    """A batch of prompts as lists of ids (see :func:`~kvlab.core.checks.check_token_ids`), else
    :class:`ConfigError`."""
    if not isinstance(prompts, (list, tuple)):
        raise ConfigError(f"prompts must be a list of prompts, got {prompts!r}")
    return [check_token_ids(p, f"prompt {i}", vocab_size) for i, p in enumerate(prompts)]


def check_pool(manager: Any, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device,
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
class LlamaConfig:
    """A Llama model's shape. ``head_dim = dim // num_heads``; ``num_heads`` is a multiple of ``num_kv_heads``
    (grouped-query attention). ``context_len`` is the longest sequence the model was trained for; ``name`` is
    what reports call it."""
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    eps: float = 1e-6
    context_len: int = 8192
    name: str = "llama"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "context_len"):
            object.__setattr__(self, name, check_positive(getattr(self, name), f"{type(self).__name__}.{name}"))
        for name in ("rope_theta", "eps"):
            object.__setattr__(self, name, check_real(getattr(self, name), f"{type(self).__name__}.{name}", lo=0,
                                                      lo_open=True))
        if not isinstance(self.name, str):
            raise ConfigError(f"{type(self).__name__}.name must be a str, got {self.name!r}")
        if self.dim % self.num_heads or self.head_dim % 2:  # rotary embeddings rotate pairs of a head's dims
            raise ConfigError(f"{type(self).__name__}.dim={self.dim} does not split into "
                              f"num_heads={self.num_heads} heads of an even size")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{type(self).__name__}.num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def kv_spec(self, block_size: int = 16, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> KVSpec:
        """The :class:`KVSpec` a pool needs to hold this model's K/V."""
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype, torch.device(device))


@dataclass(frozen=True)
class TinyConfig(LlamaConfig):
    """The random teaching model's shape (small enough to run anywhere in milliseconds) and its weights' seed."""
    vocab_size: int = 101
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_dim: int = 128
    name: str = "tiny-llama"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "seed", check_seed(self.seed, "TinyConfig.seed"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[tokens, 1, head_dim // 2]`` of each position's rotation: pair ``i`` of a head
    turns by ``position / theta ** (2i / head_dim)`` (computed in fp32, once per step for every layer)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
                               / head_dim)
    ang = positions.to(torch.float32)[:, None] * inv_freq
    return ang.cos()[:, None].to(dtype), ang.sin()[:, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, dim]`` (rotate-half convention: dims ``i`` and ``i + dim/2`` pair up)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, dim]`` by its positions (:func:`rope_angles`, then :func:`apply_rope`)."""
    return apply_rope(x, *rope_angles(positions, x.shape[-1], theta, x.dtype))


LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Each layer weight's shape (``out x in`` for projections, as ``x @ w.T`` uses them)."""
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    return {"attn_norm": (d,), "wq": (cfg.num_heads * hd, d), "wk": (cfg.num_kv_heads * hd, d),
            "wv": (cfg.num_kv_heads * hd, d), "wo": (d, cfg.num_heads * hd), "mlp_norm": (d,),
            "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}


class Llama:
    """A Llama decoder's weights and its two forward paths (see the module docstring).

    ``embed`` ``[vocab, dim]``, ``layers`` (one dict of :data:`LAYER_WEIGHTS` per layer, shapes from
    :func:`weight_shapes`), ``norm`` ``[dim]`` and ``lm_head`` ``[vocab, dim]`` (the same tensor as ``embed`` when
    the model ties them). ``tokenizer`` turns text into ids and back (a real model's; ``None`` for
    :class:`TinyLlama`). Every tensor is checked against ``cfg`` and moved to ``dtype`` on ``device`` here."""

    def __init__(self, cfg: LlamaConfig, embed: torch.Tensor, layers: Seq[dict[str, torch.Tensor]],
                 norm: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tokenizer: Any = None) -> None:
        if not isinstance(cfg, LlamaConfig):
            raise ConfigError(f"{type(self).__name__} needs a LlamaConfig, got {cfg!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"{type(self).__name__}'s dtype must be a floating torch.dtype, got {dtype!r}")
        self.cfg, self.dtype, self.device, self.tokenizer = cfg, dtype, torch.device(device), tokenizer
        shapes = weight_shapes(cfg)
        if len(layers) != cfg.num_layers or any(set(p) != set(LAYER_WEIGHTS) for p in layers):
            raise ConfigError(f"expected {cfg.num_layers} layers of weights {LAYER_WEIGHTS}")

        def put(t: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ConfigError(f"weight {what} must be a tensor of shape {list(shape)}, got "
                                  f"{list(t.shape) if isinstance(t, torch.Tensor) else t!r}")
            return t.to(self.device, dtype).contiguous()

        v, d = cfg.vocab_size, cfg.dim
        self.embed = put(embed, (v, d), "embed")
        self.layers = [{k: put(p[k], shapes[k], f"{k} of layer {i}") for k in LAYER_WEIGHTS}
                       for i, p in enumerate(layers)]
        self.norm = put(norm, (d,), "norm")
        self.lm_head = self.embed if lm_head is embed else put(lm_head, (v, d), "lm_head")
        self.workspace = AttentionWorkspace()
        self.attention = choose().attention  # paged attention: the fast twin unless KVLAB_REFERENCE says decode

    def __repr__(self) -> str:
        c = self.cfg
        return (f"{type(self).__name__}({c.name!r}: {c.num_layers} layers, {c.num_heads} query / "
                f"{c.num_kv_heads} KV heads x {c.head_dim}, vocab {c.vocab_size}, {self.dtype}, {self.device})")

    def _layer(self, p: dict[str, torch.Tensor], x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor],
               attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One decoder layer on ``x`` ``[tokens, dim]``: ``attend(q, k, v)`` stores and attends (paged or not)."""
        c = self.cfg
        h = rms_norm(x, p["attn_norm"], c.eps)
        q = apply_rope(F.linear(h, p["wq"]).view(-1, c.num_heads, c.head_dim), *rot)
        k = apply_rope(F.linear(h, p["wk"]).view(-1, c.num_kv_heads, c.head_dim), *rot)
        v = F.linear(h, p["wv"]).view(-1, c.num_kv_heads, c.head_dim)
        x = x + F.linear(attend(q, k, v).reshape(x.shape[0], -1), p["wo"])
        h = rms_norm(x, p["mlp_norm"], c.eps)
        return x + F.linear(F.silu(F.linear(h, p["w_gate"])) * F.linear(h, p["w_up"]), p["w_down"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # F.linear, not ``@ w.T``: for the 49,152 x 576 output layer of SmolLM2 it is ~1.7x faster on one core.
        return F.linear(rms_norm(x, self.norm, self.cfg.eps), self.lm_head)

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.embed[torch.tensor(ids, dtype=torch.long, device=self.device)]

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta, self.dtype)

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
                         for t in check_token_ids(toks, f"new tokens of sequence {i}", self.cfg.vocab_size)]

    @torch.no_grad()
    def forward_full(self, tokens: Seq[int]) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` recomputing everything, no cache."""
        x = self._embed(check_token_ids(tokens, "tokens", self.cfg.vocab_size))
        rot = self._rotation(torch.arange(x.shape[0], device=self.device))
        n = [x.shape[0]]
        for p in self.layers:
            x = self._layer(p, x, rot, lambda q, k, v: contiguous_attention(q, [k], [v], n))
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
        rot = self._rotation(batch.positions)
        for layer, p in enumerate(self.layers):
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = layer) -> torch.Tensor:
                storage.write_slots(layer, batch.slots, k, v)
                return self.attention(q, storage, layer, batch.block_tables, batch.seq_lens, batch.query_lens,
                                      workspace=self.workspace)
            x = self._layer(p, x, rot, attend)
        for seq in seqs:
            manager.cache_full_blocks(seq)
        last = torch.tensor(batch.query_lens, device=self.device).cumsum(0) - 1
        return self._logits(x[last])

    def generate(self, manager: SequenceManager, prompts: Seq[Seq[int]], max_new_tokens: int,
                 tenant: str | None = None) -> tuple[list[Sequence], list[list[int]]]:
        """Greedy generation for a batch of prompts through the paged cache (:func:`kvlab.serve.model.generate`: bad
        input refused first, nothing left allocated on failure). Returns the sequences (still live; free them when
        done) and the generated tokens of each."""
        seqs, out, _ = generate(self.step, manager, prompts, max_new_tokens, self.cfg.vocab_size, tenant)
        return seqs, out

    def generate_full(self, prompt: Seq[int], max_new_tokens: int) -> list[int]:
        """Reference greedy generation recomputing the whole prefix at each step."""
        toks = check_token_ids(prompt, "prompt", self.cfg.vocab_size)
        check_count(max_new_tokens, "max_new_tokens")
        for _ in range(max_new_tokens):
            toks.append(int(self.forward_full(toks)[-1].argmax()))
        return toks[len(prompt):]


class TinyLlama(Llama):
    """The teaching model: :class:`Llama` with weights drawn from ``cfg.seed`` (no file, no download)."""

    def __init__(self, cfg: TinyConfig = TinyConfig(), dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(cfg, TinyConfig):
            raise ConfigError(f"TinyLlama needs a TinyConfig, got {cfg!r}")
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

        shapes = weight_shapes(cfg)
        embed = w(cfg.vocab_size, cfg.dim) * cfg.dim ** 0.5
        layers = [{k: torch.ones(shape) if len(shape) == 1 else w(*shape) for k, shape in shapes.items()}
                  for _ in range(cfg.num_layers)]
        super().__init__(cfg, embed, layers, torch.ones(cfg.dim), w(cfg.vocab_size, cfg.dim), dtype, device)


Step = Callable[[SequenceManager, Seq[Sequence], Seq[Seq[int]]], torch.Tensor]


def greedy(step: Step, manager: SequenceManager, seqs: Seq[Sequence], feed: Seq[Seq[int]],
           max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding through the paged cache: ``step(manager, seqs, feed)`` appends the tokens fed to each
    sequence and returns one row of logits per sequence (``Llama.step``, or a tensor-parallel one); each
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
