"""Exercises for the chapters, "predict, then check" (text §2.2.1–§2.2.6), and the chapters' fast mode.

A student writes an answer (a number, a list, a set, or a small function) and :func:`check` says whether it is
right, with a hint when it is not. The truth is never typed in: every checker computes it by running kvlab on a
fresh pool (a scenario replayed, or a reference computation cross-checked against the pool's own counters), so
an exercise stays right when the library changes. Function answers are compared with the reference on many
seeded cases and the first disagreeing input is shown.

An answer is compared by its value in plain Python form, never through its own ``==``: a tuple answers a list
question and the other way round, numpy scalars and arrays count as their values, a BlockStatus member as its
name. A value of any other kind is a wrong answer that says so (see the helpers below).

:func:`fast_mode` reads ``KVLAB_FAST`` (``1``/``true``/``yes``): the chapters shrink their sizes with
:func:`sized` so that CI executes every notebook in seconds.
"""
from __future__ import annotations

import copy
import math
import operator
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .block import BlockStatus
from .errors import ConfigError, KVLabError
from .pool import BlockPool
from .spec import KVSpec


def fast_mode() -> bool:
    """True when ``KVLAB_FAST`` is set to 1/true/yes: notebooks and demos use small sizes."""
    return os.environ.get("KVLAB_FAST", "").strip().lower() in ("1", "true", "yes", "on")


def sized(full: Any, fast: Any) -> Any:
    """``fast`` in fast mode, else ``full`` (e.g. ``n_requests = sized(2000, 200)``)."""
    return fast if fast_mode() else full


@dataclass(frozen=True)
class Result:
    """The verdict on one answer; truthy when right. Shows itself as one line (text or Markdown)."""

    exercise: str
    ok: bool
    message: str
    hint: str = ""

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        mark = "✓ 正确 (right)" if self.ok else "✗ 还不对 (not yet)"
        tail = "" if self.ok or not self.hint else f"\n  提示 (hint): {self.hint}"
        return f"[{self.exercise}] {mark}: {self.message}{tail}"

    __repr__ = __str__

    def _repr_markdown_(self) -> str:
        mark = "✅ **正确 (right)**" if self.ok else "❌ **还不对 (not yet)**"
        tail = "" if self.ok or not self.hint else f"<br>💡 提示 (hint): {self.hint}"
        return f"`{self.exercise}` {mark}: {self.message}{tail}"


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``judge(answer) -> (ok, message)`` computes the truth with kvlab and compares."""

    key: str
    prompt: str
    hint: str
    judge: Callable[[Any], tuple[bool, str]]

    def check(self, answer: Any) -> Result:
        try:
            ok, msg = self.judge(answer)
        except _Unreadable as e:  # an answer of a type the checker does not compare: wrong, and why
            ok, msg = False, str(e)
        except KVLabError:
            raise  # a bug in the scenario itself must not read as a wrong answer
        except Exception as e:  # the student's function crashed: that is a wrong answer, say why
            ok, msg = False, f"你的答案运行时出错 (your answer raised) {type(e).__name__}: {_text(e)}"
        return Result(self.key, ok is True, msg, self.hint)


EXERCISES: dict[str, Exercise] = {}


def _register(key: str, prompt: str, hint: str) -> Callable[[Callable[[Any], tuple[bool, str]]], Callable]:
    def deco(judge: Callable[[Any], tuple[bool, str]]) -> Callable:
        if key in EXERCISES:
            raise ConfigError(f"exercise {key!r} is defined twice")
        EXERCISES[key] = Exercise(key, prompt, hint, judge)
        return judge
    return deco


def exercise(key: str) -> Exercise:
    """The exercise ``key`` (e.g. ``"2.2.2-lru"``); :class:`ConfigError` lists the known keys otherwise."""
    if key not in EXERCISES:
        raise ConfigError(f"unknown exercise {key!r}; known: {', '.join(sorted(EXERCISES))}")
    return EXERCISES[key]


def list_exercises(chapter: str | None = None) -> list[str]:
    """Keys of the exercises, those of ``chapter`` (e.g. ``"2.2.3"``) only if given."""
    return sorted(k for k in EXERCISES if chapter is None or k.startswith(chapter + "-"))


def check(key: str, answer: Any) -> Result:
    """Check ``answer`` to exercise ``key``; the result prints as right/wrong with a hint."""
    return exercise(key).check(answer)


def prompt(key: str) -> str:
    """The task of exercise ``key`` in words (Chinese, identifiers in English)."""
    return exercise(key).prompt


# ---------------------------------------------------------------------------- helpers
# Answers are compared in a canonical form of plain Python values, truth on the left. Only the answer's real type
# is consulted (``type(x)``, never ``isinstance``, which trusts a ``__class__`` property) and its value is read
# through the base type's own methods, so an answer cannot pass by overriding ``__eq__``, ``__iter__`` or
# ``__index__``; anything that is not a number, a string, a BlockStatus or a list/tuple/set/array of those is
# refused with a wrong-answer message rather than compared.
Canon = int | float | str | tuple["Canon", ...] | frozenset["Canon"]

_NUMPY_INTS = frozenset(np.dtype(c).type for c in np.typecodes["AllInteger"])
_NUMPY_FLOATS = frozenset(np.dtype(c).type for c in np.typecodes["Float"])
_MAX_DEPTH = 8  # deeper than any answer here; also stops a list that contains itself


class _Unreadable(Exception):
    """An answer (or a value inside it) the checkers do not compare; its message is the wrong-answer text."""


def _canon(x: Any, depth: int = 0) -> Canon:
    """``x`` as plain values: ints, floats and strs, BlockStatus members as their names, sequences and arrays as
    tuples, sets as frozensets. Raises :class:`_Unreadable` for anything else."""
    t = type(x)
    if t is bool or t is np.bool_:
        raise _Unreadable(f"答案里有 True/False，这里要的是数字 (the answer holds a bool {x}, not a number)")
    if t is BlockStatus:
        return BlockStatus(operator.index(x)).name  # the member by its stored value, not by its attributes
    if issubclass(t, int):
        return operator.index(x)  # for an int subclass this copies the stored value; __index__ is not called
    if t in _NUMPY_INTS:
        return operator.index(x)
    if issubclass(t, float):
        return float.__float__(x)  # np.float64 too; a subclass's own __float__ is bypassed
    if t in _NUMPY_FLOATS:
        return float(x)
    if issubclass(t, str):
        return str.__str__(x)  # np.str_ too; an exact copy of the stored text
    if depth >= _MAX_DEPTH:
        raise _Unreadable("答案嵌套太深 (the answer is nested too deeply)")
    if issubclass(t, np.ndarray):
        return _canon(np.ndarray.tolist(x), depth + 1)  # a 0-d array gives its scalar
    # the base type's own iterator reads the stored items, whatever a subclass's __iter__ says
    if issubclass(t, list):
        return tuple(_canon(v, depth + 1) for v in list.__iter__(x))
    if issubclass(t, tuple):
        return tuple(_canon(v, depth + 1) for v in tuple.__iter__(x))
    if issubclass(t, set):
        return frozenset(_canon(v, depth + 1) for v in set.__iter__(x))
    if issubclass(t, frozenset):
        return frozenset(_canon(v, depth + 1) for v in frozenset.__iter__(x))
    raise _Unreadable(f"kvlab 不比较 {t.__name__} 类型的值 (kvlab does not compare a value of type "
                      f"{t.__name__}); 请用 int / float / str / list / tuple / set (use one of these)")


def _text(x: Any, limit: int = 200) -> str:
    """``str(x)`` for a message, cut to ``limit`` characters; a broken ``__str__`` gives the type's name."""
    try:
        text = str(x)
    except Exception:
        text = f"<{type(x).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _same(answer: Any, truth: Any, what: str) -> tuple[bool, str]:
    want, got = _canon(truth), _canon(answer)  # a list answers a tuple question and the other way round
    if want == got:
        return True, f"{what} = {truth!r}"
    return False, f"你的答案 (your answer) {got!r} ≠ kvlab 的结果 (kvlab's result)"


def _agrees(want: Canon, got: Canon, close: bool) -> bool:
    """Truth on the left; both are canonical, so ``==`` is the plain types' own."""
    if close and isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and math.isclose(want, got, rel_tol=1e-9, abs_tol=1e-9)
    return want == got


def _returned(fn: Callable[..., Any], args: tuple, call: str) -> Canon:
    """What ``fn(*args)`` returns, canonical; a crash or an unreadable value is a wrong answer naming ``call``.
    The function gets copies, so that it cannot change the case it is judged on."""
    try:
        raw = fn(*copy.deepcopy(args))
    except Exception as e:  # even a KVLabError: it came from the student's code, not from the scenario
        raise _Unreadable(f"{call} 运行时出错 (your answer raised) {type(e).__name__}: {_text(e)}") from None
    try:
        return _canon(raw)
    except _Unreadable as e:
        raise _Unreadable(f"{call}: {e}") from None


def _compare_fn(fn: Any, cases: Iterable[tuple], reference: Callable[..., Any], name: str,
                close: bool = False) -> tuple[bool, str]:
    if not callable(fn):
        return False, f"请传入一个函数 (pass a function) {name}(...), 而不是 {type(fn).__name__}"
    n = 0
    for args in cases:
        want = _canon(reference(*args))
        got = _returned(fn, args, f"{name}{args!r}")
        if not _agrees(want, got, close):
            return False, f"{name}{args!r} 返回 (returned) {got!r}, kvlab 得到 (kvlab gets) {want!r}"
        n += 1
    return True, f"{name} 与 kvlab 在 {n} 个用例上一致 (agrees with kvlab on {n} cases)"


def _metadata_pool(num_blocks: int, block_size: int, **kw: Any) -> BlockPool:
    return BlockPool(num_blocks, spec=KVSpec(block_size=block_size, device=torch.device("cpu")), with_storage=False,
                     **kw)


# ---------------------------------------------------------------------------- 2.2.1 block size
def _pool_utilisation(lengths: list[int], block_size: int) -> float:
    """Tokens stored / token slots reserved, measured on a pool holding one sequence per length."""
    need = sum(-(-n // block_size) for n in lengths)
    pool = _metadata_pool(max(need, 1), block_size)
    for n in lengths:
        blocks = pool.allocate(-(-n // block_size))
        for i, b in enumerate(blocks):
            pool.set_token_count(b, min(block_size, n - i * block_size))
    mem = pool.get_memory_usage()
    return mem["token_bytes"] / mem["used"] if mem["used"] else 1.0


def _waste_cases() -> list[tuple[int, int]]:
    rng = random.Random(221)
    return [(t, bs) for bs in (1, 8, 16, 64, 256) for t in (1, bs, bs + 1, 2 * bs - 1)] + \
           [(rng.randint(1, 5000), rng.choice((16, 32, 128, 512))) for _ in range(40)]


@_register("2.2.1-waste",
           "写一个函数 waste(tokens, block_size)：一条长 tokens 的序列按 block_size 分块后，最后一块里空着的槽位数"
           "（内部碎片, internal fragmentation）。",
           "需要的块数是 ceil(tokens / block_size)；空槽 = 块数 × block_size − tokens。")
def _judge_waste(fn: Any) -> tuple[bool, str]:
    def reference(tokens: int, block_size: int) -> int:
        pool = _metadata_pool(-(-tokens // block_size), block_size)
        blocks = pool.allocate(-(-tokens // block_size))
        for i, b in enumerate(blocks):
            pool.set_token_count(b, min(block_size, tokens - i * block_size))
        mem = pool.get_memory_usage()
        return (mem["used"] - mem["token_bytes"]) // pool.spec.bytes_per_token
    return _compare_fn(fn, _waste_cases(), reference, "waste")


@_register("2.2.1-utilisation",
           "写一个函数 utilisation(lengths, block_size)：把一组序列（长度列表 lengths）放进块大小为 block_size 的池，"
           "返回真正存了 token 的槽位占已分配槽位的比例（0..1）。",
           "分母是每条序列 ceil(n / block_size) 个块乘以 block_size 之和，分子是 sum(lengths)。")
def _judge_utilisation(fn: Any) -> tuple[bool, str]:
    rng = random.Random(2211)
    cases = [([rng.randint(1, 2000) for _ in range(rng.randint(1, 30))], rng.choice((8, 16, 64, 256, 1024)))
             for _ in range(25)]
    return _compare_fn(fn, cases, _pool_utilisation, "utilisation", close=True)


# ---------------------------------------------------------------------------- 2.2.2 block management
@_register("2.2.2-transitions",
           "BlockStatus 有 FREE / PENDING / ALLOCATED / EVICTING 四个状态。给出所有合法的状态转移，"
           "写成集合 {(old, new), ...}，old/new 用 BlockStatus 成员。",
           "FREE 只能被占用（直接或先预留）；PENDING 可以提交或放弃；ALLOCATED 要么释放，要么开始淘汰；"
           "EVICTING 只有一条出路。")
def _judge_transitions(answer: Any) -> tuple[bool, str]:
    legal = set()
    for old in BlockStatus:
        for new in BlockStatus:
            try:
                BlockStatus.check(-1, old, new)
                legal.add((old, new))
            except KVLabError:
                pass
    shape = "答案应是 (old, new) 二元组的集合 (a set of (old, new) pairs)"
    try:
        pairs = _canon(answer)
    except _Unreadable as e:
        return False, f"{shape}: {e}"
    if not isinstance(pairs, (tuple, frozenset)):
        return False, shape
    given = set()
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            return False, shape
        given.add((_status(pair[0]), _status(pair[1])))
    if legal == given:
        return True, f"{len(legal)} 条合法转移 (legal transitions)"
    extra, missing = given - legal, legal - given
    parts = []
    if extra:
        parts.append("多了 (not legal): " + ", ".join(f"{o.name}->{n.name}" for o, n in sorted(extra)))
    if missing:
        parts.append(f"少了 {len(missing)} 条 (missing {len(missing)})")
    return False, "; ".join(parts)


def _status(c: Canon) -> BlockStatus:
    """A canonical status: a member's name (``BlockStatus.FREE`` is canonically ``"FREE"``) or its int value."""
    if isinstance(c, str) and c in BlockStatus.__members__:
        return BlockStatus[c]
    if isinstance(c, int) and c in {int(s) for s in BlockStatus}:
        return BlockStatus(c)
    raise _Unreadable(f"{c!r} 不是 BlockStatus 的状态 (is not a BlockStatus; use BlockStatus.FREE or 'FREE')")


def _lru_scenario() -> list[int]:
    """Four reusable blocks, released in the order 2, 0, 3, 1; block 0 is then reused and released again."""
    pool = _metadata_pool(4, 16, eviction_policy="lru")
    blocks = pool.allocate(4)
    pool.mark_reusable(blocks)
    for b in (2, 0, 3, 1):
        pool.free([b])
    pool.incref([0])
    pool.free([0])
    order = []
    for _ in range(4):
        victim = pool.evict_block()
        if victim is None:
            raise ConfigError("2.2.2-lru scenario: the pool found nothing to evict")  # a scenario bug, not an answer
        order.append(victim.block_id)
    return order


@_register("2.2.2-lru",
           "一个 4 块的池（eviction_policy='lru'）：allocate(4) 得到块 0,1,2,3，全部 mark_reusable；"
           "按 2, 0, 3, 1 的顺序 free（它们变成 cached）；然后 incref([0]) 再 free([0])。"
           "接下来连续调用 4 次 evict_block()，依次淘汰哪些块？答案写成列表。",
           "LRU 看的是最后一次访问（释放、incref 都算访问）。块 0 被再次使用过。")
def _judge_lru(answer: Any) -> tuple[bool, str]:
    return _same(answer, _lru_scenario(), "淘汰顺序 (order)")


def _refcount_scenario() -> tuple[int, str]:
    pool = _metadata_pool(4, 16)
    (b,) = pool.allocate(1)
    pool.incref([b, b])
    pool.decref([b])
    pool.free([b])
    return pool.block(b).reference_count, pool.block(b).status.name


@_register("2.2.2-refcount",
           "在一个新池上：(b,) = pool.allocate(1)；pool.incref([b, b])；pool.decref([b])；pool.free([b])。"
           "此时块 b 的 reference_count 和 status.name 是什么？答案写成 (refcount, 'STATUS')。",
           "allocate 给出引用计数 1；列表里重复的 id 会各加一次。计数没有降到 0 之前块一直是 ALLOCATED。")
def _judge_refcount(answer: Any) -> tuple[bool, str]:
    return _same(answer, _refcount_scenario(), "(refcount, status)")


# ---------------------------------------------------------------------------- 2.2.3 allocation and release
def _sharing_scenario(users: int = 5, prefix_blocks: int = 3, own_blocks: int = 2) -> tuple[int, int]:
    """``users`` sequences share ``prefix_blocks`` blocks and each owns ``own_blocks`` more."""
    pool = _metadata_pool(64, 16)
    prefix = pool.allocate(prefix_blocks)
    pool.incref(np.repeat(prefix, users - 1))
    for _ in range(users):
        pool.allocate(own_blocks)
    return pool.block(prefix[0]).reference_count, pool.num_blocks - pool.num_free_blocks


@_register("2.2.3-sharing",
           "5 个用户共享同一段系统提示词，占 3 个块（第一个用户 allocate，其余 4 个各 incref 一次）；"
           "每个用户再各自 allocate 2 个块。共享块的引用计数是多少？池里一共用掉多少块？答案写成 (refcount, used)。",
           "共享的块只存一份；每多一个用户引用计数加 1。")
def _judge_sharing(answer: Any) -> tuple[bool, str]:
    return _same(answer, _sharing_scenario(), "(refcount, used blocks)")


def _strategy_scenario() -> list[str]:
    from .allocator import DynamicAllocator  # lazily: the allocator is optional for the other exercises
    pool = _metadata_pool(8, 16, block_sizes=[16, 32, 64, 128])
    alloc = DynamicAllocator(pool)
    out = []
    for size_class in (0, 0, 0, 2):
        ticket = alloc.allocate_optimal_block(size_class=size_class)
        out.append(ticket.strategy or "wait")  # a ticket left waiting has no strategy yet
    return out


@_register("2.2.3-strategies",
           "一个 8 个基本块的伙伴池（block_sizes=[16, 32, 64, 128]，开始时是一整块 128 token 的空闲块）。"
           "DynamicAllocator 依次为 size_class 0, 0, 0, 2 各分配一块。每次由哪种策略满足"
           "（'exact' / 'split' / 'merge' / 'evict' / 'wait'）？答案写成列表。",
           "第一次请求只能把大块一半一半切下来；切下的另一半留在空闲链表里，可以直接满足下一次。")
def _judge_strategies(answer: Any) -> tuple[bool, str]:
    return _same(answer, _strategy_scenario(), "策略 (strategies)")


# ---------------------------------------------------------------------------- 2.2.4 fragmentation
def _fragmentation_case(seed: int) -> tuple[np.ndarray, int, int]:
    """A buddy pool after a seeded random allocate/free history; returns (free mask, top order, kvlab's %)."""
    rng = random.Random(seed)
    top = rng.choice((1, 2, 3))
    pool = _metadata_pool(rng.choice((8, 16, 24, 32)), 16, block_sizes=[16 << k for k in range(top + 1)])
    held: list[int] = []
    for _ in range(rng.randint(5, 40)):
        if held and rng.random() < 0.4:
            pool.free([held.pop(rng.randrange(len(held)))])
        elif pool.num_free_blocks:
            try:
                held += pool.allocate(1, size_class=rng.randint(0, top))
            except KVLabError:
                pass
    pool.merge_free_buddies()
    return pool.snapshot()["status"] == int(BlockStatus.FREE), top, pool.calculate_fragmentation()


@_register("2.2.4-fragmentation",
           "写一个函数 fragmentation(free, top_order)：free 是按地址排列的基本块是否空闲的布尔数组，"
           "最大的块跨 2**top_order 个基本块（且必须对齐到 2**top_order）。返回外部碎片百分比（整数）："
           "空闲空间里无法拼成一个最大块的那一部分所占的比例。没有空闲空间时返回 0。",
           "把数组按 2**top_order 切成对齐的窗口（末尾不足一个窗口的部分不算），全空闲的窗口才可用；"
           "结果 round(100 * (1 - 可用 / 空闲))。")
def _judge_fragmentation(fn: Any) -> tuple[bool, str]:
    if not callable(fn):
        return False, f"请传入一个函数 (pass a function), 而不是 {type(fn).__name__}"
    for seed in range(40):
        free, top, truth = _fragmentation_case(seed)
        want = _canon(truth)
        case = f"free={free.astype(int).tolist()}, top_order={top}"
        got = _returned(fn, (free, top), f"fragmentation({case})")
        if not _agrees(want, got, close=False):
            return False, f"{case}: 你的函数返回 {got!r}, pool.calculate_fragmentation() = {want!r}"
    return True, "与 BlockPool.calculate_fragmentation 在 40 个随机池上一致 (agrees on 40 random pools)"


def _compaction_moves(layout: str) -> int:
    """Fewest migrations that leave every ALLOCATED block below every FREE one (``layout``: 'A' / '.')."""
    pool = _metadata_pool(len(layout), 16)
    ids = pool.allocate(len(layout))
    pool.free([b for b, c in zip(ids, layout) if c == "."])
    used = pool.num_blocks - pool.num_free_blocks
    src = [b for b in range(used, pool.num_blocks) if pool.block(b).status is BlockStatus.ALLOCATED]
    dst = [b for b in range(used) if pool.block(b).status is BlockStatus.FREE]
    pool.migrate(src, dst)
    assert pool.free_runs().tolist() == ([pool.num_free_blocks] if pool.num_free_blocks else [])
    return len(src)


@_register("2.2.4-moves",
           "布局 'A..AA.A..A.A'（A = ALLOCATED，. = FREE，按地址排列）。要把所有已分配块压到最低地址、"
           "让空闲空间连成一段，最少要用 pool.migrate 搬动几个块？",
           "已用的块最后占据前 k 个位置（k = A 的个数）；已经在前 k 个位置里的块不必动。")
def _judge_moves(answer: Any) -> tuple[bool, str]:
    return _same(answer, _compaction_moves("A..AA.A..A.A"), "搬动次数 (moves)")


# ---------------------------------------------------------------------------- 2.2.5 performance
def _lock_scenario(n: int = 100) -> tuple[int, int]:
    one = _metadata_pool(n, 16)
    for _ in range(n):
        one.allocate(1)
    for b in range(n):
        one.free([b])
    batch = _metadata_pool(n, 16)
    batch.free(batch.allocate(n))
    return one.lock_acquisitions, batch.lock_acquisitions


@_register("2.2.5-locks",
           "把 100 个块一个一个 allocate(1) 再一个一个 free([b])，与 allocate(100) 后一次 free(全部) 相比，"
           "BlockPool.lock_acquisitions 各是多少？答案写成 (逐个, 批量)。",
           "每个公开的修改操作只拿一次锁，批量操作也一样。")
def _judge_locks(answer: Any) -> tuple[bool, str]:
    return _same(answer, _lock_scenario(), "(one by one, batched)")


# ---------------------------------------------------------------------------- 2.2.6 applications
LONG_SPEC = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)  # a Llama-3-8B-like KV shape


def _long_sequence_cost(tokens: int = 100_000, dtype_bytes: int = 2) -> tuple[int, int]:
    spec = KVSpec(**LONG_SPEC, dtype={2: torch.float16, 4: torch.float32}[dtype_bytes], device=torch.device("cpu"))
    pool = BlockPool(total_memory=spec.bytes_per_block * (-(-tokens // spec.block_size)), spec=spec,
                     with_storage=False)
    blocks = pool.allocate(-(-tokens // spec.block_size))
    return len(blocks), pool.get_memory_usage()["used"]


@_register("2.2.6-long",
           "一个类 Llama-3-8B 的 KV 形状：32 层，8 个 KV 头，head_dim 128，fp16，block_size 16。"
           "一条 100,000 token 的序列需要多少个块、多少字节？答案写成 (blocks, bytes)。",
           "每个 token 的 KV 字节数 = 2 (K 和 V) × 层数 × KV 头数 × head_dim × 每个元素的字节数；"
           "块数向上取整，字节数按整块算。")
def _judge_long(answer: Any) -> tuple[bool, str]:
    return _same(answer, _long_sequence_cost(), "(blocks, bytes)")
