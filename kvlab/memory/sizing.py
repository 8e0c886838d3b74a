"""Choosing the block size (text §2.2.1, "分块大小的确定原则"): the text's rule of thumb, then a measurement.

:class:`ChunkSizeOptimizer` keeps the text's two methods. ``analyze_sequence_distribution`` summarises lengths
(mean, median, p95, p99, max); ``recommend_chunk_size`` maps the p95 to a block size for one of three goals.
That mapping is a rule of thumb with fixed numbers, and kvlab keeps it as the text wrote it except where it
crashes:

* ``'balanced'`` picks from 64/128/256/512/1024 by ``log2(p95 // 100)``. For p95 < 100 that is ``log2(0)``,
  minus infinity, and turning it into an index raises ``OverflowError``: every short-request workload (a chat
  service) crashed it. Here any p95 below 200 picks 64, so the table is: p95 < 200 -> 64, < 400 -> 128,
  < 800 -> 256, < 1600 -> 512, else 1024.
* ``'memory_efficient'`` is ``clamp(p95 // 4, 512, 2048)``: its floor makes it 512 for every p95 below 2048,
  whatever the data, and a larger block *adds* internal waste to short sequences (the last block of each is
  on average half empty), the opposite of what the goal's name promises.
* ``'performance_optimal'`` is ``clamp(p95 // 6, 256, 1024)``: 256 for every p95 below 1536.
* Both clamps return sizes that need not be powers of two (p95 = 3000 gives 750).

What the rule of thumb says for the text's scenarios (``make_workload(name, 2000, seed=0)``, prompt + output
per request; tested in ``tests/test_sizing.py``):

=====================================  ======  ================  ===================  ========
lengths                                p95     memory_efficient  performance_optimal  balanced
=====================================  ======  ================  ===================  ========
``chat``                               390     512               256                  128
``document``                           3344    836               557                  1024
``code``                               1873    512               312                  1024
``retrieval``                          7251    1812              1024                 1024
retrieval queries alone (10-100)       ~71     512               256                  64 (text: crash)
=====================================  ======  ================  ===================  ========

The measured sweep says where the trade-off lies but not one answer: internal waste, prefix-sharing loss and
the slots a block-wise attention read touches grow with the block while the per-block overhead shrinks about as
``1/B``, and the size that balances them depends on how the terms are weighed and on which sizes are swept
(:func:`pick_grid`: with the default weights the Azure conversation trace's balanced pick is 128, with the
overhead weight at 1.0 or all weights equal it is 256). What holds for every weighting: the memory terms alone
pick the smallest size swept, and a heavier overhead weight never picks a smaller block (:class:`PickGrid`).
Every term of the cost is a count, so a pick under given weights is the same on every machine and in every run.

:func:`sweep` replaces the guess by a measurement. It runs a workload through a :class:`~kvlab.BlockPool` of
each block size, every request resident at its final length (the moment a batch holds the most), and reads:

* **waste** -- internal waste: allocated token slots holding no token / allocated slots (shared blocks once);
* **table entries** -- block-table entries over all requests (per-block bookkeeping, slot-mapping work);
* **alloc calls** -- ``pool.allocate`` calls: one batched call for a request's own prompt blocks, then one per
  block its decode opens, as a paged engine grows a sequence;
* **prefix loss** -- of the shared-prefix tokens in requests that find their prefix already cached, the share
  sitting in the prefix's last, partly filled block: only full blocks can be shared, so those tokens are
  stored (and computed) again by every request;
* **attention slots** -- token slots one decode step over every resident request reads when attention fetches
  whole blocks (kvlab's gather path copies each block of a sequence's table, ``ceil(n / B) * B`` slots for an
  ``n``-token sequence; a shared block is read once per request that uses it). Slots past a sequence's length
  are read and masked, so this grows with ``B`` while the tokens stay the same;
* **attention ms** (shown, not in the cost) -- one decode step of the paged attention the model runs
  (:func:`kvlab.fast.choose`: on the CPU in fp32, the compiled decode kernel) over a sample of the workload's
  sequences (evenly spaced quantiles of their lengths): the median of several rounds
  that visit the sizes in turn, with the fastest and slowest round. On a CPU shared with other work the spread
  between rounds is larger than the differences between sizes, which is why timings do not drive the choice.

:func:`measure_decode_ms` times what those milliseconds are a part of: one decode step of a whole model
(:class:`kvlab.serve.model.Llama`, e.g. SmolLM2-135M) on the same sample of sequences, and that step's attention alone.

Cost model (lower is better), each term in [0, 1]::

    cost(B) = a * waste(B) + b * prefix_loss(B)
            + c * (entries(B) + calls(B)) / max over swept B
            + d * attention_slots(B) / max over swept B

with ``(a, b, c, d)`` per goal in :data:`WEIGHTS` (:meth:`SweepResult.with_weights` tries others). The two
overhead terms are normalised by the worst size in the sweep, so the recommendation is relative to the sizes
swept (:meth:`SweepResult.between` sweeps fewer). Memory terms are fractions already. :func:`pick_grid` tries a
grid of weights (:data:`WEIGHT_GRID`) and sweep ranges (:data:`SWEEP_RANGES`), :func:`plot_pick_grid` draws it.

Two more measurements for the chapter: :func:`kv_reads` counts the separate contiguous reads that fetch one
sequence's K from kvlab's KV tensor (bigger blocks: fewer and longer reads), and
:func:`prefix_granularity_loss` the prefix-cache hits lost because only whole blocks are shared.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from kvlab.core.device import default_device
from kvlab.core.errors import ConfigError
from kvlab.core.checks import INT32_MAX, check_choice, check_device, check_flag, check_seed, is_int, is_real
from kvlab.core.pool import BlockPool
from kvlab.core.spec import KVSpec
from kvlab.workloads.mixes import Workload

if TYPE_CHECKING:
    from kvlab.serve.model import Llama

GOALS = ("memory_efficient", "performance_optimal", "balanced")
BALANCED_SIZES = (64, 128, 256, 512, 1024)
DEFAULT_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)
# (waste, prefix loss, per-block overhead, attention slots) weights of the cost model, per goal.
WEIGHTS: dict[str, tuple[float, float, float, float]] = {
    "memory_efficient": (1.0, 1.0, 0.1, 0.1),
    "performance_optimal": (0.25, 0.25, 0.5, 1.0),
    "balanced": (1.0, 0.5, 0.5, 0.5),
}
#: the settings of :func:`measure_attention_ms` that :func:`sweep` passes on, with their defaults
TIMING: dict[str, Any] = {"batch": 8, "max_len": 4096, "num_heads": 8, "head_dim": 64, "rounds": 5, "device": None,
                          "seed": 0}
T = TypeVar("T")


class ChunkSizeOptimizer:
    """The text's optimizer: length statistics, its rule-of-thumb recommendation, and the measured sweep."""

    def __init__(self) -> None:
        self.sequence_length_stats: dict[str, float] = {}
        self.performance_metrics: dict[int, SweepRow] = {}  # filled by :meth:`sweep`, one row per block size

    def analyze_sequence_distribution(self, sequences: Workload | Iterable[Any]) -> dict[str, float]:
        """Mean, median, p95, p99 and max of the lengths of ``sequences``: a :class:`Workload` (its requests'
        prompt + output), token sequences (their ``len``) or plain lengths (ints)."""
        if isinstance(sequences, Workload):
            lengths = sequences.sequence_lengths().tolist()
        elif isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
            raise ConfigError(f"sequences must be a Workload, token sequences or lengths, got {sequences!r:.80}")
        else:
            lengths = []
            for s in sequences:
                n = len(s) if hasattr(s, "__len__") else s
                if not is_int(n) or n < 0:
                    raise ConfigError(f"a sequence length must be an int >= 0 (or a sized sequence), got {s!r}")
                lengths.append(int(n))
        if not lengths:
            raise ConfigError("analyze_sequence_distribution needs at least one sequence")
        a = np.asarray(lengths, dtype=np.float64)
        self.sequence_length_stats = {"mean": float(a.mean()), "median": float(np.median(a)),
                                      "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99)),
                                      "max": int(a.max())}
        return self.sequence_length_stats

    def recommend_chunk_size(self, optimization_goal: str = "balanced") -> int:
        """The text's rule of thumb on the analysed p95 (see the module docstring for what is arbitrary)."""
        # the text silently treated any unknown goal as 'balanced'
        goal = check_choice(optimization_goal, "optimization goal", GOALS)
        if not self.sequence_length_stats:
            raise ConfigError("no statistics yet: call analyze_sequence_distribution(sequences) first")
        p95 = self.sequence_length_stats["p95"]
        if goal == "memory_efficient":
            return int(min(max(p95 // 4, 512), 2048))
        if goal == "performance_optimal":
            return int(min(max(p95 // 6, 256), 1024))
        k = int(p95 // 100)  # floor(log2(k)) is k.bit_length() - 1, exact; k < 1 was the text's crash
        return BALANCED_SIZES[0 if k < 1 else min(len(BALANCED_SIZES) - 1, k.bit_length() - 1)]

    def sweep(self, workload: Workload, block_sizes: Sequence[int] = DEFAULT_SIZES, **kwargs: Any) -> SweepResult:
        """:func:`sweep`, also analysing the workload's lengths and keeping the rows in ``performance_metrics``."""
        result = sweep(workload, block_sizes, **kwargs)  # first: a refused sweep leaves the analysis as it was
        self.analyze_sequence_distribution(workload)
        self.performance_metrics = {row.block_size: row for row in result.rows}
        return result


# ---------------------------------------------------------------------------------------------------- measuring
@dataclass(frozen=True, slots=True)
class SweepRow:
    """What one block size cost on the workload (see the module docstring for each measure)."""

    block_size: int
    blocks: int  # distinct blocks held with every request resident
    tokens: int  # token slots holding a token
    table_entries: int
    alloc_calls: int
    prefix_tokens: int  # shared-prefix tokens of requests whose prefix was already cached
    prefix_lost: int  # of those, tokens in the prefix's partly filled last block (stored again)
    attention_slots: int  # slots a whole-block attention read touches, one decode step over every request
    attention_ms: float = math.nan  # median over rounds (shown, not in the cost)
    attention_spread: tuple[float, float] = (math.nan, math.nan)  # fastest and slowest round

    @property
    def slots(self) -> int:
        return self.blocks * self.block_size

    @property
    def waste(self) -> float:
        return 1 - self.tokens / self.slots if self.slots else 0.0

    @property
    def prefix_loss(self) -> float:
        return self.prefix_lost / self.prefix_tokens if self.prefix_tokens else 0.0


def measure_block_size(workload: Workload, block_size: int, *, check: bool = False) -> SweepRow:
    """Run every request of ``workload`` through a metadata-only pool of ``block_size`` and count (no attention).

    Requests arrive in order; the first request naming a prefix keeps the prefix's full blocks as reusable, and
    later ones take a reference to them instead of allocating. With all requests at their final length the
    pool's own metadata gives blocks held and tokens stored; then every request is released, which must leave
    only the cached prefix blocks behind (``check=True`` also runs ``pool.check_invariants()``).
    """
    B = _check_sizes([block_size])[0]
    _check_workload(workload)
    check_flag(check, "check")
    need = int(sum(-(-r.total_len // B) for r in workload))
    pool = BlockPool(need, spec=KVSpec(block_size=B, device=torch.device("cpu")), with_storage=False)
    prefixes: dict[str, list[int]] = {}  # prefix id -> its full blocks, owned by the first request naming it
    tables: list[list[int]] = []
    entries = calls = prefix_tokens = prefix_lost = 0
    for r in workload:
        shared = prefixes.get(r.prefix_id) if r.prefix_id else None
        table = list(shared or ())
        if shared is not None:
            pool.incref(shared)
            prefix_tokens += r.prefix_len
            prefix_lost += r.prefix_len - len(shared) * B
        own_prompt = -(-r.prompt_len // B) - len(table)
        if own_prompt:
            table += pool.allocate(own_prompt, owner=r.id)
            calls += 1
        if r.prefix_id and shared is None:
            prefixes[r.prefix_id] = table[:r.prefix_len // B]
            if prefixes[r.prefix_id]:
                pool.mark_reusable(prefixes[r.prefix_id])
        for _ in range(-(-r.total_len // B) - len(table)):  # decode opens one block at a time
            table += pool.allocate(1, owner=r.id)
            calls += 1
        for i in range(len(shared or ()), len(table)):
            pool.set_token_count(table[i], min(B, r.total_len - i * B))
        entries += len(table)
        tables.append(table)
    row = SweepRow(B, pool.num_blocks - pool.num_free_blocks, int(pool.arrays.tokens.sum()), entries, calls,
                   prefix_tokens, prefix_lost, entries * B)
    for table in tables:
        pool.free(table)
    assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks, "a request leaked blocks"
    if check:
        pool.check_invariants()
    return row


def measure_attention_ms(workload: Workload, block_sizes: Sequence[int], *, batch: int = 8, max_len: int = 4096,
                         num_heads: int = 8, head_dim: int = 64, rounds: int = 5, device: Any = None,
                         seed: int = 0, on_step: Callable[[], Any] | None = None
                         ) -> dict[int, tuple[float, float, float]]:
    """(median, fastest, slowest) over ``rounds`` of the milliseconds of one decode step of
    the paged attention the model runs (:func:`kvlab.fast.choose`; fp32, one layer, ``num_heads`` x ``head_dim``)
    at each block size, over ``batch`` sequences whose lengths are evenly spaced quantiles of the workload's (clipped to
    ``max_len``), their blocks scattered over the pool in a seeded random order. Each round visits every size in
    turn, so a burst of load elsewhere on the machine slows all sizes alike instead of one. ``on_step()`` is
    called after each timing (progress bars)."""
    _check_workload(workload)
    sizes = _check_sizes(block_sizes)
    kw = _check_timing(dict(batch=batch, max_len=max_len, num_heads=num_heads, head_dim=head_dim, rounds=rounds,
                            device=device, seed=seed))
    _check_on_step(on_step)
    lens = _sample_lengths(workload, kw["batch"], kw["max_len"])
    times = _interleaved(sizes, kw["rounds"], on_step, lambda bs: _decode_step_ms(
        lens, bs, kw["num_heads"], kw["head_dim"], device, kw["seed"]))
    return {bs: _spread(t) for bs, t in times.items()}


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    """:func:`measure_decode_ms` at one block size. ``step`` and ``attention`` are (median, fastest, slowest)
    milliseconds over the rounds."""

    step: tuple[float, float, float]  # one whole-model decode step
    attention: tuple[float, float, float]  # that step's paged_attention calls (one per layer), timed again alone
    attention_share: float  # median over rounds of attention / step, both from the same round


def measure_decode_ms(model: Llama, workload: Workload, block_sizes: Sequence[int], *, batch: int = 8,
                      max_len: int = 4096, rounds: int = 3, seed: int = 0,
                      on_step: Callable[[], Any] | None = None) -> dict[int, DecodeTiming]:
    """Time one decode step of a whole :class:`kvlab.serve.model.Llama` (``model.step``: every layer's matmuls, the K/V
    writes, paged attention and the output layer) at each block size, over the same ``batch`` sequences as
    :func:`measure_attention_ms` (evenly spaced quantiles of the workload's lengths, clipped to ``max_len``),
    one new token each (the timed step's is their second: the warm-up step fed the first). Rounds visit the
    sizes in turn, as there.

    Each timing starts from a fresh pool (``model.cfg.kv_spec``, the model's dtype and device) whose blocks are
    handed out in a seeded random order (scattered, as a long-running pool's are). The sequences' tokens are
    appended without computing them (no prefill: on a CPU it would cost far more than the steps), so their K/V
    stay the pool's zeros: that does not change the work the kernels do. One warm-up step, then the timed step;
    then the step's attention alone: one :func:`~kvlab.paged_attention` call per layer on the same
    block tables and lengths, with the model's head counts and workspace (timed outside the step, so its caches
    may be warmer than between the step's matmuls). The thread count is the caller's (e.g. inside
    :func:`kvlab.torch_threads`). Every argument is checked before any work."""
    from kvlab.serve.model import Llama  # imported here: counting needs no model

    if not isinstance(model, Llama):
        raise ConfigError(f"model must be a kvlab.Llama (TinyLlama, or kvlab.load_model's), got {model!r:.80}")
    _check_workload(workload)
    sizes = _check_sizes(block_sizes)
    kw = _check_timing(dict(batch=batch, max_len=max_len, rounds=rounds, seed=seed))
    _check_on_step(on_step)
    lens = _sample_lengths(workload, kw["batch"], kw["max_len"])
    runs = _interleaved(sizes, kw["rounds"], on_step, lambda bs: _model_step_ms(model, lens, bs, kw["seed"]))
    return {bs: DecodeTiming(_spread([s for s, _ in r]), _spread([a for _, a in r]),
                             float(np.median([a / s for s, a in r]))) for bs, r in runs.items()}


def decode_table(decode: dict[int, DecodeTiming], num_layers: int) -> str:
    """:func:`measure_decode_ms`'s timings as a table, one row per block size: the whole step and its attention as
    ``median [fastest-slowest]`` ms, and attention's share of the step (``num_layers`` names the attention calls)."""
    def span(t: tuple[float, float, float]) -> str:
        return f"{t[0]:.1f} [{t[1]:.1f}-{t[2]:.1f}]"

    head = (f"{'块':>5s} | {'一步解码 ms，中位数 [最快-最慢]':24s} | {f'其中注意力 ms（{num_layers} 次调用）':22s} | "
            "注意力占比")
    rows = [f"{bs:5d} | {span(t.step):34s} | {span(t.attention):31s} | {t.attention_share:.0%}"
            for bs, t in decode.items()]
    return "\n".join([head, *rows])


def _overlap(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Two (median, fastest, slowest) ranges share a value: their order is not shown by the timing."""
    return max(a[1], b[1]) <= min(a[2], b[2])


@dataclass(frozen=True, slots=True)
class DecodeVerdict:
    """What :func:`judge_decode` read from the timings; ``str()`` is the chapter's four lines."""

    decode: dict[int, DecodeTiming]
    slots: dict[int, int]  # the counted attention slots per block size (the cost's term)
    requests: int  # how many requests those slots count
    apart: list[tuple[int, int]]  # pairs of block sizes whose whole-step ranges do not overlap
    slowest_attention: int  # block size with the largest median attention time
    slowest_clear: bool  # its attention range overlaps no other size's
    first_vs_last: str  # attention time from the smallest to the largest timed size: 下降 / 没有下降 / 分不出升降

    def __str__(self) -> str:
        sizes = list(self.decode)
        pairs = len(sizes) * (len(sizes) - 1) // 2
        shares = [t.attention_share for t in self.decode.values()]
        steps = {bs: t.step[0] for bs, t in self.decode.items()}
        attn = {bs: t.attention[0] for bs, t in self.decode.items()}
        lo, hi = min(steps, key=steps.__getitem__), max(steps, key=steps.__getitem__)
        slow, first, last = self.slowest_attention, sizes[0], sizes[-1]
        others = ", ".join(f"{bs}: {ms:.0f}" for bs, ms in attn.items() if bs != slow)
        share = f"{min(shares):.0%}–{max(shares):.0%}"
        step_gap = f"差 {steps[hi] / steps[lo] - 1:.0%}（其中注意力 {attn[lo]:.0f} -> {attn[hi]:.0f} ms）"
        order = f"，分得开的 (apart): {self.apart}" if self.apart else "：整步的计时排不出先后 (cannot order them)"
        return "\n".join([
            f"计时（这台机器这一次，timing）：注意力占一步解码的 {share}；其余是权重矩阵乘和输出层，"
            "它们的形状在每个块大小下都一样",
            f"计时：整步的中位数从 {steps[lo]:.0f} ms（块 {lo}）到 {steps[hi]:.0f} ms（块 {hi}），{step_gap}"
            f"；{pairs} 对块大小里 {pairs - len(self.apart)} 对的整步区间重叠{order}",
            f"计时：单看注意力，块 {slow} 最慢（{attn[slow]:.0f} ms；{others}），它的区间"
            + ("和其他每个块大小都分得开" if self.slowest_clear else "和别的块大小有重叠，分不出先后"),
            f"计数 vs 计时：代价里的注意力槽位（全部 {self.requests:,} 个请求按整块读，计数）从 {self.slots[first]:,}"
            f"（块 {first}）增加到 {self.slots[last]:,}（块 {last}）；"
            f"实测的注意力时间在这两个块大小之间{self.first_vs_last}",
        ])


def judge_decode(decode: dict[int, DecodeTiming], slots: dict[int, int], requests: int) -> DecodeVerdict:
    """Read :func:`measure_decode_ms`'s timings against the counted attention ``slots`` (per block size, over
    ``requests`` requests): which sizes' whole steps can be told apart (ranges that do not overlap), which size's
    attention is slowest and whether clearly so, and whether attention time fell from the smallest timed size to the
    largest. Only non-overlapping (fastest, slowest) ranges count as an order: a timing never decides by medians
    alone. Needs at least two timed sizes, each in ``slots``."""
    sizes = list(decode)
    if len(sizes) < 2 or any(bs not in slots for bs in sizes):
        raise ConfigError(f"need two or more timed block sizes, each with counted slots; got {sizes}, {list(slots)}")
    pairs = [(a, b) for i, a in enumerate(sizes) for b in sizes[i + 1:]]
    apart = [p for p in pairs if not _overlap(decode[p[0]].step, decode[p[1]].step)]
    attn = {bs: t.attention[0] for bs, t in decode.items()}
    slow = max(attn, key=attn.__getitem__)
    clear = all(not _overlap(decode[slow].attention, decode[bs].attention) for bs in sizes if bs != slow)
    first, last = decode[sizes[0]].attention, decode[sizes[-1]].attention
    moved = "分不出升降（区间重叠）" if _overlap(first, last) else "下降" if last[0] < first[0] else "没有下降"
    return DecodeVerdict(dict(decode), dict(slots), requests, apart, slow, clear, moved)


def _sample_lengths(workload: Workload, batch: int, max_len: int) -> list[int]:
    """``batch`` evenly spaced quantiles of the workload's sequence lengths (all of them if fewer), each clipped to
    ``max_len``: the timed batch, short to long."""
    lens = np.sort(workload.sequence_lengths())
    return np.minimum(lens[np.linspace(0, lens.size - 1, min(batch, lens.size)).round().astype(int)],
                      max_len).tolist()


def _interleaved(sizes: list[int], rounds: int, on_step: Callable[[], Any] | None,
                 measure: Callable[[int], T]) -> dict[int, list[T]]:
    """``measure(size)`` for every size, ``rounds`` times, each round visiting every size in turn (a burst of load
    elsewhere slows all sizes alike instead of one); ``on_step()`` after each."""
    seen: dict[int, list[T]] = {bs: [] for bs in sizes}
    for _ in range(rounds):
        for bs, got in seen.items():
            got.append(measure(bs))
            if on_step is not None:
                on_step()
    return seen


def _spread(ms: list[float]) -> tuple[float, float, float]:
    """(median, fastest, slowest)."""
    return float(np.median(ms)), min(ms), max(ms)


def _check_on_step(on_step: Any) -> None:
    if on_step is not None and not callable(on_step):
        raise ConfigError(f"on_step must be callable or None, got {on_step!r:.80}")


def _check_workload(workload: Workload) -> None:
    if not isinstance(workload, Workload):
        raise ConfigError(f"workload must be a Workload, got {workload!r:.80}")
    if not len(workload):
        raise ConfigError(f"workload {workload.name!r} has no requests")


def _check_sizes(block_sizes: Iterable[int]) -> list[int]:
    """``block_sizes`` (at least one; numpy integers count as ints) as distinct plain ints, ascending; the error
    names the size at fault."""
    what = f"block sizes must be distinct ints in 1..{INT32_MAX}"
    if isinstance(block_sizes, str) or not isinstance(block_sizes, Iterable):
        raise ConfigError(f"{what}, got {block_sizes!r:.80}")
    sizes = list(block_sizes)
    bad = [s for s in sizes if not (is_int(s) and 1 <= s <= INT32_MAX)]
    if bad or not sizes or len(set(sizes)) != len(sizes):  # (set() only once they are ints: hashable)
        raise ConfigError(f"{what}, got {bad[0] if bad else sizes!r:.80}")
    return sorted(int(s) for s in sizes)


def _check_timing(settings: dict[str, Any]) -> dict[str, Any]:
    """:data:`TIMING` updated by ``settings`` (:func:`measure_attention_ms`'s), each checked before any work."""
    unknown = sorted(set(settings) - set(TIMING))
    if unknown:
        raise ConfigError(f"unknown attention setting {unknown[0]!r}; known: {', '.join(TIMING)}")
    kw = {**TIMING, **settings}
    for name in ("batch", "max_len", "num_heads", "head_dim", "rounds"):
        if not is_int(kw[name]) or not 1 <= kw[name] <= INT32_MAX:
            raise ConfigError(f"{name} must be a positive int, got {kw[name]!r:.80}")
        kw[name] = int(kw[name])
    kw["seed"] = check_seed(kw["seed"])
    if kw["device"] is not None:
        check_device(kw["device"], "device")
    return kw


def _decode_step_ms(lens: list[int], block_size: int, heads: int, dim: int, device: Any, seed: int) -> float:
    """One timed decode step after one warm-up, on a fresh pool. The K/V values stay the pool's zeros: they do
    not change the work the kernels do."""
    from kvlab.core.attention import AttentionWorkspace  # imported here: counting needs no attention
    from kvlab.fast import choose
    paged_attention = choose().attention  # what the model runs (on the CPU in fp32: the compiled decode kernel)

    spec = KVSpec(num_layers=1, num_kv_heads=heads, head_dim=dim, block_size=block_size, dtype=torch.float32,
                  **({} if device is None else {"device": device}))
    counts = [-(-n // block_size) for n in lens]
    pool = _scattered_pool(sum(counts), spec, seed)
    ids = pool.allocate(sum(counts))
    tables = [ids[a - c:a] for a, c in zip(np.cumsum(counts).tolist(), counts)]
    gen = torch.Generator(device=spec.device).manual_seed(seed)
    q = torch.randn(len(lens), heads, dim, generator=gen, device=spec.device)
    ws = AttentionWorkspace()
    paged_attention(q, pool, 0, tables, lens, workspace=ws)  # warm-up: workspace, caches, lazy kernels
    return _timed(spec.device, lambda: paged_attention(q, pool, 0, tables, lens, workspace=ws))


def _model_step_ms(model: Llama, lens: list[int], block_size: int, seed: int) -> tuple[float, float]:
    """(ms of one ``model.step``, ms of its attention calls alone): see :func:`measure_decode_ms`."""
    paged_attention = model.attention  # the function the model's step calls
    from kvlab.core.sequence import SequenceManager

    c = model.cfg
    # each sequence gains two tokens (warm-up and timed step): room for their blocks, no more
    pool = _scattered_pool(sum(-(-(n + 2) // block_size) for n in lens),
                           c.kv_spec(block_size, model.dtype, model.device), seed)
    manager = SequenceManager(pool)
    seqs = [manager.create() for _ in lens]
    manager.append_tokens(seqs, lens)  # blocks and token counts only: no K/V computed
    feed = [[0] for _ in seqs]  # which token makes no difference to the work
    model.step(manager, seqs, feed)  # warm-up: workspace, caches, lazy kernels
    step = _timed(model.device, lambda: model.step(manager, seqs, feed))
    tables, seq_lens = manager.block_tables(seqs).to(model.device), [s.num_tokens for s in seqs]
    gen = torch.Generator(device=model.device).manual_seed(seed)
    q = torch.randn(len(lens), c.num_heads, c.head_dim, generator=gen, device=model.device, dtype=model.dtype)

    def attend() -> None:
        for layer in range(c.num_layers):
            paged_attention(q, pool, layer, tables, seq_lens, workspace=model.workspace)
    return step, _timed(model.device, attend)


def _scattered_pool(n: int, spec: KVSpec, seed: int) -> BlockPool:
    """A pool of ``n`` blocks whose free stack hands them out in a seeded random order: scattered, as in a pool
    that has served for a while (``free`` pushes so that the first id freed comes out first)."""
    pool = BlockPool(n, spec=spec)
    pool.free(np.random.default_rng(seed).permutation(pool.allocate(n)).tolist())
    return pool


def _timed(device: torch.device, run: Callable[[], Any]) -> float:
    """Milliseconds of ``run()``, waiting for a CUDA device's queued work before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    sync(device)
    t0 = time.perf_counter()
    run()
    sync(device)
    return 1e3 * (time.perf_counter() - t0)


@dataclass
class SweepResult:
    """Rows of a sweep (one per block size, ascending) and how attention was timed."""

    workload: str
    requests: int
    rows: list[SweepRow]
    attention: str = "not measured"
    weights: dict[str, tuple[float, float, float, float]] = field(default_factory=lambda: dict(WEIGHTS))

    def __post_init__(self) -> None:
        if not isinstance(self.rows, list) or not self.rows or not all(isinstance(r, SweepRow) for r in self.rows):
            raise ConfigError(f"a sweep result needs a non-empty list of SweepRow, got {self.rows!r:.80}")

    def costs(self, goal: str = "balanced") -> dict[int, float]:
        """``cost(B)`` of the module docstring's model for every swept block size."""
        a, b, c, d = self.weights[check_choice(goal, "optimization goal", GOALS)]
        over = _relative([r.table_entries + r.alloc_calls for r in self.rows])
        reads = _relative([r.attention_slots for r in self.rows])
        return {r.block_size: float(a * r.waste + b * r.prefix_loss + c * o + d * t)
                for r, o, t in zip(self.rows, over, reads)}

    def with_weights(self, goal: str, weights: Sequence[float]) -> SweepResult:
        """The same rows with ``goal``'s cost weights (waste, prefix loss, overhead, attention slots) replaced:
        what a student moves to watch the recommendation change. Weights are finite numbers >= 0, not all 0."""
        check_choice(goal, "optimization goal", GOALS)
        w = tuple(weights)
        if len(w) != 4 or any(not is_real(x) or x < 0 for x in w) \
                or not any(w):
            raise ConfigError(f"weights for {goal!r} must be 4 finite numbers >= 0, not all 0; got {weights!r}")
        a, b, c, d = (float(x) for x in w)
        return replace(self, weights={**self.weights, goal: (a, b, c, d)})

    def between(self, smallest: int, largest: int) -> SweepResult:
        """The rows of block sizes ``smallest`` .. ``largest`` only, as if only they had been swept: the overhead
        and attention terms are then normalised by the worst of them, so the picks may move."""
        rows = [r for r in self.rows if smallest <= r.block_size <= largest]
        if not rows:
            raise ConfigError(f"no swept block size lies in {smallest}..{largest}; swept: "
                              f"{[r.block_size for r in self.rows]}")
        return replace(self, rows=rows)

    def recommend(self, goal: str = "balanced") -> int:
        """The swept block size of lowest cost for ``goal`` (the smaller size on a tie)."""
        costs = self.costs(goal)
        return min(costs, key=lambda bs: (costs[bs], bs))

    def to_markdown(self, goal: str = "balanced") -> str:
        """The measured table as Markdown, with the cost for ``goal`` and the recommended size marked."""
        costs, best = self.costs(goal), self.recommend(goal)
        lines = [f"workload `{self.workload}`, {self.requests} requests; attention: {self.attention}", "",
                 "| block | blocks | waste % | table entries | alloc calls | prefix loss % | attention slots | "
                 f"attention ms, median [min-max] | cost ({goal}) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in self.rows:
            lo, hi = r.attention_spread
            ms = "-" if math.isnan(r.attention_ms) else f"{r.attention_ms:.3f} [{lo:.3f}-{hi:.3f}]"
            mark = " **<-**" if r.block_size == best else ""
            lines.append(f"| {r.block_size} | {r.blocks} | {100 * r.waste:.1f} | {r.table_entries} | "
                         f"{r.alloc_calls} | {100 * r.prefix_loss:.1f} | {r.attention_slots} | {ms} | "
                         f"{costs[r.block_size]:.3f}{mark} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def _relative(counts: Sequence[int]) -> np.ndarray:
    """``counts`` / their max; all 0 when the max is 0 (no size costs anything there, rather than 0/0 = NaN)."""
    x = np.asarray(counts, dtype=float)
    return x / max(x.max(), 1.0)


def sweep(workload: Workload, block_sizes: Sequence[int] = DEFAULT_SIZES, *, attention: bool = True,
          progress: bool = True, **attention_kwargs: Any) -> SweepResult:
    """Measure ``workload`` at every block size (see the module docstring). Attention timing needs the KV
    tensor, is shown beside the cost but does not enter it, and can be turned off (``attention=False``);
    ``attention_kwargs`` go to :func:`measure_attention_ms`."""
    from tqdm.auto import tqdm

    sizes = _check_sizes(block_sizes)
    _check_workload(workload)
    kw = _check_timing(attention_kwargs)
    with tqdm(total=len(sizes) * (1 + kw["rounds"] if attention else 1), desc=f"sweep {workload.name}",
              unit="step", disable=None if progress else True) as bar:  # None: off in logs
        rows = []
        for bs in sizes:
            rows.append(measure_block_size(workload, bs))
            bar.update()
        if not attention:
            return SweepResult(workload.name, len(workload), rows)
        ms = measure_attention_ms(workload, sizes, on_step=bar.update, **kw)
    how = (f"paged_attention decode, {kw['batch']} seqs (<= {kw['max_len']} tokens), "
           f"{kw['num_heads']}x{kw['head_dim']} fp32, {kw['device'] or default_device()}, "
           f"median of {kw['rounds']} rounds")
    rows = [replace(r, attention_ms=ms[r.block_size][0], attention_spread=ms[r.block_size][1:]) for r in rows]
    return SweepResult(workload.name, len(workload), rows, how)


# ---------------------------------------------------------------------------------------- which weights pick what
#: Weight settings (waste, prefix loss, per-block overhead, attention slots) for one goal's cost: kvlab's default
#: for 'balanced', all equal, the default with the overhead weight at 0.25, 1 or 2, the default without the
#: attention term, and the memory terms alone. The names are Chinese first: the chapter prints them.
WEIGHT_GRID: dict[str, tuple[float, float, float, float]] = {
    "默认 (default)": WEIGHTS["balanced"],
    "等权 (equal)": (1.0, 1.0, 1.0, 1.0),
    "开销 0.25 (overhead)": (1.0, 0.5, 0.25, 0.5),
    "开销 1 (overhead)": (1.0, 0.5, 1.0, 0.5),
    "开销 2 (overhead)": (1.0, 0.5, 2.0, 0.5),
    "无注意力项 (no attention)": (1.0, 0.5, 0.5, 0.0),
    "只计内存 (memory only)": (1.0, 1.0, 0.0, 0.0),
}
#: the settings of :data:`WEIGHT_GRID` that differ in the overhead weight only, in ascending order of it
OVERHEAD_LADDER = ("开销 0.25 (overhead)", "默认 (default)", "开销 1 (overhead)", "开销 2 (overhead)")
MEMORY_ONLY = "只计内存 (memory only)"
#: sweep ranges (smallest, largest block size swept) the grid tries: the overhead and attention terms are
#: normalised by the worst size swept, so the range moves the pick as the weights do
SWEEP_RANGES: tuple[tuple[int, int], ...] = ((16, 2048), (32, 2048), (64, 2048), (16, 512))
Weights = tuple[float, float, float, float]


@dataclass(frozen=True)
class PickGrid:
    """The block size one goal picks on one sweep, for every weight setting and sweep range of a grid
    (:func:`pick_grid`)."""

    workload: str
    goal: str
    weights: dict[str, Weights]  # setting name -> its weights
    picks: dict[str, dict[tuple[int, int], int]]  # setting name -> (smallest, largest) swept -> the pick
    smallest: dict[tuple[int, int], int]  # sweep range -> the smallest size swept in it

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(self.smallest)

    def sizes(self) -> list[int]:
        """Every size some cell of the grid picks, ascending."""
        return sorted({b for row in self.picks.values() for b in row.values()})

    def cells_in(self, lo: int, hi: int) -> list[tuple[str, tuple[int, int]]]:
        """The (setting, range) cells whose pick lies in ``lo`` .. ``hi`` (e.g. the text's band, 256 .. 512)."""
        return [(name, rng) for name, row in self.picks.items() for rng, b in row.items() if lo <= b <= hi]

    def picks_smallest(self, setting: str = MEMORY_ONLY) -> bool:
        """Whether ``setting`` picks the smallest size swept, in every range."""
        return all(self.picks[setting][rng] == low for rng, low in self.smallest.items())

    def never_smaller(self, ladder: Sequence[str] = OVERHEAD_LADDER) -> bool:
        """Whether, in every range, each setting of ``ladder`` (ascending overhead weight, the rest equal) picks at
        least the size its predecessor picks. The overhead term falls as the block grows, so weighing it more
        can only move the lowest cost to a larger block."""
        return all(self.picks[a][rng] <= self.picks[b][rng]
                   for a, b in zip(ladder, ladder[1:]) for rng in self.smallest)


def pick_grid(result: SweepResult, weights: dict[str, Weights] | None = None,
              ranges: Sequence[tuple[int, int]] = SWEEP_RANGES, goal: str = "balanced") -> PickGrid:
    """What ``goal`` picks on ``result`` under each named weight setting (:data:`WEIGHT_GRID` by default) and
    each sweep range ``(smallest, largest)`` (:meth:`SweepResult.between`): counts only, no new sweep."""
    check_choice(goal, "optimization goal", GOALS)
    weights = dict(WEIGHT_GRID if weights is None else weights)
    if not weights or not ranges:
        raise ConfigError("a pick grid needs at least one weight setting and one sweep range")
    parts = {(lo, hi): result.between(lo, hi) for lo, hi in ranges}
    picks = {name: {rng: part.with_weights(goal, w).recommend(goal) for rng, part in parts.items()}
             for name, w in weights.items()}
    return PickGrid(result.workload, goal, {n: parts[ranges[0]].with_weights(goal, w).weights[goal]
                                            for n, w in weights.items()},
                    picks, {rng: part.rows[0].block_size for rng, part in parts.items()})


# ---------------------------------------------------------------------------------------- reads and prefix hits
def contiguous_runs(pool: BlockPool, block_ids: Sequence[int], *, layer: int = 0, head: int | None = None
                    ) -> list[int]:
    """Byte lengths of the separate contiguous pieces of ``pool``'s KV tensor that hold the K of ``block_ids``
    (a sequence's block table, in its order) for ``layer``: every head, or ``head`` only. Read off the tensor's
    own strides, so kvlab's layout decides (``[K/V, layer, block, token, head, dim]``: the heads of a token sit
    side by side, "NHD"); a piece that starts where the previous one ended is the same read."""
    kv = pool.storage_of().kv
    item = kv.element_size()
    runs: list[list[int]] = []  # [start, length] in elements
    for b in pool.check_ids(list(block_ids)):
        tile = kv[0, layer, b] if head is None else kv[0, layer, b, :, head]
        for start, n in _pieces(tile):
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1][1] += n
            else:
                runs.append([start, n])
    return [n * item for _, n in runs]


def _pieces(t: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) in elements of the contiguous pieces of the view ``t``, in its index order."""
    shape, stride = [int(n) for n in t.shape], list(t.stride())
    run, k = 1, len(shape)
    while k and (stride[k - 1] == run or shape[k - 1] == 1):  # the innermost dimensions laid out without gaps
        run *= shape[k - 1]
        k -= 1
    starts = [int(t.storage_offset())]
    for n, step in zip(shape[:k], stride[:k]):
        starts = [a + i * int(step) for a in starts for i in range(int(n))]
    return [(a, int(run)) for a in starts]


def kv_reads(tokens: int, block_size: int, *, num_kv_heads: int = 8, head_dim: int = 128, head: int | None = None,
             seed: int = 0) -> list[int]:
    """:func:`contiguous_runs` of one ``tokens``-long sequence (fp16, one layer, ``num_kv_heads`` x
    ``head_dim``) in a pool of ``block_size`` whose blocks come out scattered, as a pool's do once it has
    served for a while. One layer tells it all: every layer is read the same way, apart from the others."""
    if not is_int(tokens) or tokens < 1:
        raise ConfigError(f"tokens must be a positive int, got {tokens!r}")
    B = _check_sizes([block_size])[0]
    spec = KVSpec(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=B, dtype=torch.float16,
                  device=torch.device("cpu"))
    n = -(-int(tokens) // B)
    pool = _scattered_pool(n, spec, check_seed(seed))
    return contiguous_runs(pool, pool.allocate(n), head=head)


def prefix_granularity_loss(workload: Workload, block_sizes: Sequence[int]) -> dict[int, float]:
    """For each block size, the share of the prefix-cache hits an unbounded cache could serve token by token
    that whole blocks lose: ``1 - prefix_hit_bound(w, B) / prefix_hit_bound(w, 1)`` (only full blocks are
    shared, so the shared prefix's last, partly filled block is computed again). 0 where nothing is shared."""
    from kvlab.workloads.traces import prefix_hit_bound

    _check_workload(workload)
    sizes = _check_sizes(block_sizes)
    exact = prefix_hit_bound(workload, 1)
    return {B: (1 - prefix_hit_bound(workload, B) / exact) if exact else 0.0 for B in sizes}


def plot_sweep(result: SweepResult, goal: str = "balanced") -> Any:
    """A 2x2 matplotlib figure of a sweep: memory (waste, prefix loss), bookkeeping (entries, calls),
    attention time, and the cost for ``goal`` with the recommended size marked. Returns the Figure. Labels are
    Chinese first, English after."""
    from kvlab.viz.static import MIN_PT, Picture  # a figure that displays as an image in any kernel

    if not isinstance(result, SweepResult):
        raise ConfigError(f"plot_sweep draws a SweepResult, got {result!r:.80}")
    costs, best = result.costs(goal), result.recommend(goal)  # first: a bad goal is refused before any drawing
    sizes = [r.block_size for r in result.rows]
    fig = Picture(figsize=(10, 6.5), layout="constrained")
    ax = fig.subplots(2, 2).ravel()
    ax[0].plot(sizes, [100 * r.waste for r in result.rows], "o-", label="内部浪费 (internal waste)")
    ax[0].plot(sizes, [100 * r.prefix_loss for r in result.rows], "s--", label="前缀共享损失 (prefix loss)")
    ax[0].set(ylabel="占槽位 / 占共享前缀 token 的 %", title="内存 (memory)")
    ax[1].plot(sizes, [r.table_entries for r in result.rows], "o-", label="块表条目 (table entries)")
    ax[1].plot(sizes, [r.alloc_calls for r in result.rows], "s--", label="分配调用 (alloc calls)")
    ax[1].set(yscale="log", title="管理开销 (bookkeeping)")
    reads = _relative([r.attention_slots for r in result.rows])
    ax[2].plot(sizes, reads, "o-", color="C2", label="要读的槽位（进代价）/ 最大值")
    if not any(math.isnan(r.attention_ms) for r in result.rows):
        top = max(r.attention_spread[1] for r in result.rows)
        ax[2].errorbar(sizes, [r.attention_ms / top for r in result.rows],
                       yerr=[[(r.attention_ms - r.attention_spread[0]) / top for r in result.rows],
                             [(r.attention_spread[1] - r.attention_ms) / top for r in result.rows]],
                       fmt="s--", color="C4", capsize=3, label="实测毫秒，中位数 [最快-最慢] / 最大值")
    ax[2].set(ylabel="相对最大值 (relative)", title="分页注意力，一步解码 (paged attention)")
    ax[3].plot(sizes, [costs[s] for s in sizes], "o-", color="C3")
    ax[3].axvline(best, color="k", ls=":", label=f"推荐 (recommended): {best}")
    ax[3].set(title=f"代价 (cost, {goal})")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xticks(sizes, [str(s) for s in sizes])
        a.set_xlabel("块大小 (block size, tokens)")
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=MIN_PT)
    fig.suptitle(f"块大小扫描 (block-size sweep): {result.workload}，{result.requests} 个请求")
    return fig


def plot_pick_grid(grids: Sequence[PickGrid], band: tuple[int, int] = (256, 512)) -> Any:
    """One panel per :class:`PickGrid`: a cell per (weight setting, sweep range) holding the block size picked,
    coloured by it; cells inside ``band`` (the text's "balanced" 256-512) are framed. Returns the Figure."""
    from matplotlib.colors import Normalize
    from matplotlib.patches import Patch, Rectangle

    from kvlab.viz.static import MIN_PT, Picture

    if not grids or not all(isinstance(g, PickGrid) for g in grids):
        raise ConfigError(f"plot_pick_grid draws PickGrids, got {grids!r:.80}")
    names, ranges = list(grids[0].picks), grids[0].ranges
    cols = min(3, len(grids))
    rows = -(-len(grids) // cols)
    fig = Picture(figsize=(10, 2.2 + 2.6 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    norm = Normalize(math.log2(DEFAULT_SIZES[0]), math.log2(DEFAULT_SIZES[-1]))
    cmap = "YlGnBu"
    for i, (ax, g) in enumerate(zip(axes, grids)):
        table = np.array([[math.log2(g.picks[n][r]) for r in ranges] for n in names])
        ax.imshow(table, cmap=cmap, norm=norm, aspect="auto")
        for y, n in enumerate(names):
            for x, r in enumerate(ranges):
                b = g.picks[n][r]
                ax.text(x, y, str(b), ha="center", va="center", fontsize=MIN_PT,
                        color="white" if norm(math.log2(b)) > 0.6 else "black")
                if band[0] <= b <= band[1]:
                    ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, lw=2.5, ec="#d62728"))
        ax.set_xticks(range(len(ranges)), [f"{lo}–{hi}" for lo, hi in ranges], fontsize=MIN_PT)
        labels = [f"{n}  {'/'.join(f'{x:g}' for x in g.weights[n])}" for n in names]
        ax.set_yticks(range(len(names)), labels if i % cols == 0 else [""] * len(names), fontsize=MIN_PT)
        ax.set_title(g.workload, fontsize=10)
        if i // cols == rows - 1:
            ax.set_xlabel("扫描范围 (sweep range)", fontsize=MIN_PT)
    for ax in axes[len(grids):]:
        ax.set_visible(False)
    fig.legend(handles=[Patch(fill=False, ec="#d62728", lw=2.5,
                              label=f"落在文本的 {band[0]}–{band[1]} 档 (in the text's band)")],
               loc="outside lower center", fontsize=MIN_PT, frameon=False)
    fig.suptitle(f"{grids[0].goal} 选哪个块：随权重（行：浪费/前缀损失/开销/注意力）和扫描范围（列）变化 "
                 "(which block wins)")
    return fig


@dataclass(frozen=True)
class TraceLengths:
    """:func:`trace_lengths`'s numbers: per trace, ``requests`` and the prompt's mean, median and 95th percentile
    and the output's mean and median (tokens). ``lengths[name]`` is one trace's dict; ``str()`` the table."""
    stats: dict[str, dict[str, float]]

    def __getitem__(self, name: str) -> dict[str, float]:
        return self.stats[name]

    def __str__(self) -> str:
        lines = [f"{'trace':16s} {'请求数':>6s} | {'提示均值':>8s} {'中位':>5s} {'p95':>5s} | "
                 f"{'输出均值':>8s} {'中位':>5s}"]
        lines += [f"{name:16s} {int(t['requests']):9d} | {t['prompt_mean']:12.1f} {t['prompt_median']:7.0f} "
                  f"{t['prompt_p95']:5.0f} | {t['output_mean']:12.1f} {t['output_median']:7.0f}"
                  for name, t in self.stats.items()]
        return "\n".join(lines)


def trace_lengths(traces: dict[str, Workload]) -> TraceLengths:
    """Prompt and output lengths of each workload in ``traces`` (every request), in their order."""
    stats = {}
    for name, w in traces.items():
        _check_workload(w)
        p = np.array([r.prompt_len for r in w])
        o = np.array([r.output_len for r in w])
        stats[name] = {"requests": float(len(w)), "prompt_mean": float(p.mean()), "prompt_median": float(np.median(p)),
                       "prompt_p95": float(np.percentile(p, 95)), "output_mean": float(o.mean()),
                       "output_median": float(np.median(o))}
    return TraceLengths(stats)


def weight_explorer(result: SweepResult, goal: str = "balanced") -> Any:
    """Four sliders (0 to 4), one per cost term's weight for ``goal`` (starting at :data:`WEIGHTS`), and the size
    ``result`` recommends under them (:meth:`SweepResult.with_weights`: counts only, no new sweep), shown again on
    every change. Returns the ``ipywidgets.VBox`` to display."""
    import ipywidgets as widgets  # type: ignore[import-untyped]

    check_choice(goal, "optimization goal", GOALS)
    names = ("浪费 (waste)", "前缀损失 (prefix loss)", "管理开销 (overhead)", "注意力槽位 (attention)")
    sliders = [widgets.FloatSlider(value=v, min=0.0, max=4.0, step=0.25, description=d,
                                   style={"description_width": "initial"}) for v, d in zip(WEIGHTS[goal], names)]
    out = widgets.Output()

    def show(_: Any = None) -> None:
        weights = [s.value for s in sliders]
        out.clear_output()
        with out:
            if not any(weights):
                print("至少一个权重要大于 0 (at least one weight must be > 0)")
                return
            pick = result.with_weights(goal, weights).recommend(goal)
            print(f"权重 (weights) {weights} -> {result.workload} 上 {goal} 推荐的块 (recommended): {pick}")

    for s in sliders:
        s.observe(show, names="value")
    show()
    return widgets.VBox([*sliders, out])


def plot_lengths(workloads: dict[str, Workload], traces: dict[str, Workload], band: tuple[int, int] = (10, 200)
                 ) -> Any:
    """Histograms of sequence lengths (prompt + output): the text's scenarios as lines, real traces filled, the
    text's chat range ``band`` shaded. Returns the Figure."""
    from kvlab.viz.static import MIN_PT, Picture

    fig = Picture(figsize=(9, 3.6), layout="constrained")
    ax = fig.subplots()
    bins = np.logspace(0.5, 4.3, 60).tolist()
    for name, w in workloads.items():
        ax.hist(w.sequence_lengths(), bins=bins, histtype="step", lw=1.2, label=f"文本 (text): {name}")
    for name, w in traces.items():
        ax.hist(w.sequence_lengths(), bins=bins, histtype="stepfilled", alpha=0.25, label=name)
    ax.axvspan(*band, color="grey", alpha=0.1, label=f"文本的对话 (text's chat) {band[0]}–{band[1]}")
    ax.set_xscale("log")
    ax.set(xlabel="序列长度 (sequence length: prompt + output, tokens)", ylabel="请求数 (requests)")
    ax.legend(fontsize=MIN_PT, ncol=2)
    ax.set_title("文本的场景 vs Azure 2023 trace (the text's scenarios vs real traces)")
    return fig
