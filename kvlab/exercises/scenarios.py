"""Problems drawn from a seed: a chapter's exercise again with fresh numbers, as many times as a student wants.

As in OSTEP's simulators, a seed names the problem (``draw("2.2.4-moves", seed=7)`` is the same problem on every
machine, ``-s 7`` on the command line) and the answer is shown only when asked for (:meth:`Problem.solution`,
``-c``). The truth is computed by running kvlab, as every checker's is; :meth:`Problem.check` judges an answer
like :func:`kvlab.exercises.check` (item by item for a tuple, two-way items never marked alone) and records it in
:func:`kvlab.exercises.attempts` under ``KEY@SEED``.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.core.checks import show
from kvlab.core.errors import ConfigError
from kvlab.exercises import ch2_2_1, ch2_2_2, ch2_2_3, ch2_2_4, ch2_2_5, ch2_2_6
from kvlab.exercises.framework import HINT_STAGES, Canon, Result, attempts, canon, hint, record, same, text

__all__ = ["Problem", "draw", "list_scenarios", "SEED_MAX"]

SEED_MAX = 2**31 - 1


@dataclass(frozen=True)
class Problem:
    """One drawn problem: the question, kvlab's answer (shown by :meth:`solution` only) and how to get it."""

    key: str
    seed: int
    question: str
    truth: Canon
    method: str
    labels: tuple[str, ...] = ()
    two_way: tuple[str, ...] = ()

    def check(self, answer: Any) -> Result:
        """The verdict on ``answer`` (``...`` is no answer yet and is not counted)."""
        name = f"{self.key}@{self.seed}"
        if answer is Ellipsis:
            return Result(name, False, "还没有答案 (no answer yet): 把 ... 换成你的答案 (replace ... with yours)")
        verdict = same(answer, self.truth, "答案 (answer)", self.labels, self.two_way)
        ok, details = verdict[0], verdict[2] if len(verdict) == 3 else ()
        # the hints of the chapter's own exercise, staged by this problem's misses: the method would give it away
        stage = 0 if ok else min(1 + sum(not a.ok for a in attempts() if a.key == name), len(HINT_STAGES))
        record(name, text(answer), ok, stage)
        return Result(name, ok, verdict[1], hint(self.key, stage) if stage else "", stage, details)

    def solution(self) -> str:
        """The answer and how it follows (OSTEP's ``-c``)."""
        return f"[{self.key}@{self.seed}] 答案 (answer): {self.truth!r}\n  做法 (how): {self.method}"

    def __str__(self) -> str:
        return (f"[{self.key}, 种子 seed={self.seed}] {self.question}\n"
                f"  (同一题: draw({self.key!r}, seed={self.seed}) 或 kvlab exercise {self.key} -s {self.seed})")

    __repr__ = __str__


Make = Callable[[random.Random], tuple[str, Any, str, tuple[str, ...], tuple[str, ...]]]
_SCENARIOS: dict[str, Make] = {}


def _scenario(key: str) -> Callable[[Make], Make]:
    def deco(make: Make) -> Make:
        _SCENARIOS[key] = make
        return make
    return deco


def list_scenarios(chapter: str | None = None) -> list[str]:
    """Keys of the exercises that can be drawn afresh (those of ``chapter`` only if given)."""
    return sorted(k for k in _SCENARIOS if chapter is None or k.split("-", 1)[0] == chapter)


def draw(key: str, seed: int | None = None) -> Problem:
    """Problem ``key`` drawn from ``seed`` (a fresh random seed if None, shown with the problem so that it can be
    drawn again)."""
    if not isinstance(key, str) or key not in _SCENARIOS:
        raise ConfigError(f"no drawn problems for {show(key)}; known: {', '.join(list_scenarios())}")
    if seed is None:
        seed = random.SystemRandom().randrange(SEED_MAX)
    elif type(seed) is not int or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"seed must be an int in 0..{SEED_MAX}, got {show(seed)}")
    question, truth, method, labels, two_way = _SCENARIOS[key](random.Random(f"{key}/{seed}"))
    return Problem(key, seed, question, canon(truth), method, labels, two_way)


# ---------------------------------------------------------------------------------------------------- the problems
@_scenario("2.2.1-waste")
def _waste(rng: random.Random):
    tokens, block = rng.randrange(1, 5000), rng.choice((8, 16, 32, 64, 128, 256))
    return (f"一条 {tokens} token 的序列放进 block_size={block} 的池，最后一块空着几个槽位？"
            f"(slots left empty in the last block)", ch2_2_1.pool_waste(tokens, block),
            f"ceil({tokens} / {block}) × {block} − {tokens}", (), ())


@_scenario("2.2.2-lru")
def _lru(rng: random.Random):
    n = rng.randrange(4, 7)
    released = tuple(rng.sample(range(n), n))
    reused = tuple(rng.choice(range(n)) for _ in range(rng.randrange(1, 3)))
    return (f"一个 {n} 块的池（eviction_policy='lru'）：allocate({n}) 得到块 0..{n - 1}，全部 mark_reusable；"
            f"按 {list(released)} 的顺序 free；然后依次对 {list(reused)} 中的每个块 incref 再 free。"
            f"连续调用 {n} 次 pool.evict()，依次淘汰哪些块？答案写成列表。",
            ch2_2_2.lru_scenario(released, reused),
            "写下每个块最后一次被 free 的时刻，按从早到晚排列。",
            tuple(f"第 {i + 1} 个淘汰 (victim {i + 1})" for i in range(n)), ())


@_scenario("2.2.3-sharing")
def _sharing(rng: random.Random):
    users, prefix, own = rng.randrange(2, 21), rng.randrange(1, 7), rng.randrange(1, 5)
    return (f"{users} 个用户共享 {prefix} 个前缀块（allocate 一次，再 incref 给其余用户），每个用户再各自 allocate "
            f"{own} 个块。共享块的引用计数是多少？池里一共用掉多少块？答案写成 (refcount, used)。",
            ch2_2_3.sharing_scenario(users, prefix, own),
            f"refcount = {users}（每个用户一份引用）；used = {prefix} + {users} × {own}", ("refcount", "used"), ())


@_scenario("2.2.4-moves")
def _moves(rng: random.Random):
    n = rng.randrange(8, 17)
    layout = "".join(rng.choice("A.") for _ in range(n))
    k = layout.count("A")
    return (f"布局 '{layout}'（A = ALLOCATED，. = FREE，按地址排列）。要把所有已分配块压到最低地址、让空闲空间"
            f"连成一段，最少要用 pool.migrate 搬动几个块？",
            ch2_2_4.compaction_moves(layout),
            f"A 有 {k} 个；搬动数 = 位置 ≥ {k} 的 A 的个数 = 前 {k} 个位置里 '.' 的个数", (), ())


@_scenario("2.2.5-headroom")
def _headroom(rng: random.Random):
    headroom = rng.choice((0.25, 0.5, 0.75, 1.0, 1.25))
    reserved, free = ch2_2_5.reserve_scenario(headroom)
    return (f"64 块的池，租户 1 一次 allocate 了 48 块又全部 free；Preallocator(window=8, horizon=64, "
            f"headroom={headroom}) replenish 之后给租户 1 预留了几个块？别人还剩几个空闲块？"
            "答案写成 (reserved, free)。",
            (reserved, free), f"reserved = ceil(48 × {headroom})（不超过空闲块数）；free = 64 − reserved",
            ("reserved", "free"), ())


@_scenario("2.2.6-long")
def _long(rng: random.Random):
    tokens, dtype_bytes = rng.randrange(1_000, 200_001), rng.choice((2, 4))
    spec = ch2_2_6.LONG_SPEC
    per_token = 2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * dtype_bytes
    return (f"{spec['num_layers']} 层、{spec['num_kv_heads']} 个 KV 头、head_dim {spec['head_dim']}、每个数 "
            f"{dtype_bytes} 字节、block_size {spec['block_size']} 的 KV 形状。"
            f"一条 {tokens:,} token 的序列需要多少个块、多少字节？答案写成 (blocks, bytes)。",
            ch2_2_6.long_sequence_cost(tokens, dtype_bytes),
            f"blocks = ceil({tokens} / {spec['block_size']}) = {math.ceil(tokens / spec['block_size'])}；"
            f"bytes = blocks × {spec['block_size']} × {per_token}（每 token 字节）", ("blocks", "bytes"), ())
