"""Exercises of §2.2.1 (block size): internal fragmentation of one sequence and utilisation of a pool."""
from __future__ import annotations

import random
from typing import Any

import numpy as np

from kvlab.memory.fragmentation import memory_usage
from kvlab.exercises.framework import (Verdict, canon, compare_fn, metadata_pool, register,
                                      register_prediction, same)


def pool_utilisation(lengths: list[int], block_size: int) -> float:
    """Tokens stored / token slots reserved, measured on a pool holding one sequence per length."""
    need = sum(-(-n // block_size) for n in lengths)
    pool = metadata_pool(max(need, 1), block_size)
    for n in lengths:
        blocks = pool.allocate(-(-n // block_size))
        for i, b in enumerate(blocks):
            pool.set_token_count(b, min(block_size, n - i * block_size))
    mem = memory_usage(pool)
    return mem["token_bytes"] / mem["used"] if mem["used"] else 1.0


def pool_waste(tokens: int, block_size: int) -> int:
    """Empty token slots in the last block of one ``tokens``-long sequence, read from a pool's counters."""
    pool = metadata_pool(-(-tokens // block_size), block_size)
    blocks = pool.allocate(-(-tokens // block_size))
    for i, b in enumerate(blocks):
        pool.set_token_count(b, min(block_size, tokens - i * block_size))
    mem = memory_usage(pool)
    return (mem["used"] - mem["token_bytes"]) // pool.spec.bytes_per_token


def _waste_cases() -> list[tuple[int, int]]:
    rng = random.Random(221)
    return [(t, bs) for bs in (1, 8, 16, 64, 256) for t in (1, bs, bs + 1, 2 * bs - 1)] + \
           [(rng.randint(1, 5000), rng.choice((16, 32, 128, 512))) for _ in range(40)]


@register("2.2.1-waste",
          "写一个函数 waste(tokens, block_size)：一条长 tokens 的序列按 block_size 分块后，最后一块里空着的槽位数"
          "（内部碎片, internal fragmentation）。",
          ("想一想：序列长度正好是 block_size 的整数倍时，最后一块空几个槽？",
           "先算要几个块（向上取整），再用块数能装的槽位减去 tokens。",
           "空槽 = ceil(tokens / block_size) × block_size − tokens，也就是 (−tokens) mod block_size。"))
def _judge_waste(fn: Any) -> Verdict:
    return compare_fn(fn, _waste_cases(), pool_waste, "waste")


@register("2.2.1-utilisation",
          "写一个函数 utilisation(lengths, block_size)：把一组序列（长度列表 lengths）放进块大小为 block_size 的池，"
          "返回真正存了 token 的槽位占已分配槽位的比例（0..1）。",
          ("每条序列各自占整数个块；不同序列不共用一个块。",
           "分子是所有序列的 token 数之和；分母是每条序列分到的块数乘以 block_size，再求和。",
           "utilisation = sum(lengths) / sum(ceil(n / block_size) × block_size for n in lengths)。"))
def _judge_utilisation(fn: Any) -> Verdict:
    rng = random.Random(2211)
    cases = [([rng.randint(1, 2000) for _ in range(rng.randint(1, 30))], rng.choice((8, 16, 64, 256, 1024)))
             for _ in range(25)]
    return compare_fn(fn, cases, pool_utilisation, "utilisation", close=True)


# ---------------------------------------------------------------------------- predictions before the reveals
register_prediction("2.2.1-waste-trend",
                    "块大小从 16 增大到 2048 时，对话 (chat) 场景的内部浪费 (internal waste) 会怎样变化？",
                    choices=("上升 (rises)", "下降 (falls)", "持平 (flat)"))
register_prediction("2.2.1-overhead-weight",
                    "在 Azure 对话 trace 上，把代价里管理开销 (overhead) 的权重从默认的 0.5 提到 2（其他权重不变），"
                    "balanced 代价最低的块会怎样变化？",
                    choices=("变大 (larger)", "变小 (smaller)", "不变 (unchanged)"))
register_prediction("2.2.1-azure-ratio",
                    "Azure 2023 对话 trace 里，模型一次回答（一轮的输出）平均多长？是文本“对话轮次平均约 50 token”"
                    "的多少倍？（一个数字；±30% 算命中）", rel_tol=0.3)
register_prediction("2.2.1-reads",
                    "块大小从 16 增大到 256 时，从 kvlab 的 KV 张量读一条对话序列一层的 K（所有头一起读），"
                    "要分开读的连续内存段 (separate contiguous reads) 会怎样变化？",
                    choices=("变多 (more)", "变少 (fewer)", "不变 (same)"))


def band_of(block_size: int) -> str:
    """Which of the text's rule-of-thumb bands ``block_size`` falls in (Chinese first: the chapter prints it)."""
    if block_size < 64:
        return "小于 64 (below 64)"
    if block_size <= 128:
        return "保守 64–128 (conservative)"
    if block_size <= 512:
        return "平衡 256–512 (balanced)"
    return "激进 1024–2048 (aggressive)"


# ---------------------------------------------------------------------------- errata, interpretation, parameters
TEXT_RULE = '''\
import numpy as np
def recommend(p95, goal):          # the text's rule, in two of its three branches
    if goal == "memory_efficient":
        return min(max(p95 // 4, 512), 2048)
    sizes = [64, 128, 256, 512, 1024]
    return sizes[min(len(sizes) - 1, int(np.log2(p95 // 100)))]
'''


def text_rule_at(p95: float) -> tuple[Any, Any]:
    """Run :data:`TEXT_RULE` (text-style code) at ``p95``: (memory_efficient, balanced)."""
    ns: dict[str, Any] = {}
    exec(TEXT_RULE, ns)  # the snippet the prompt shows is the one that is run
    return ns["recommend"](np.float64(p95), "memory_efficient"), ns["recommend"](np.float64(p95), "balanced")


@register("2.2.1-errata-rule",
          "找错 (find the bug)：下面是按文本逻辑写的推荐函数。\n" + TEXT_RULE +
          "p95 = 2047 时，recommend(p95, 'memory_efficient') 和 recommend(p95, 'balanced') 各返回什么？"
          "答案写成 (memory_efficient, balanced)。想一想：哪个目标的名字和结果矛盾？",
          ("两个分支各算一遍；注意 // 作用在浮点数上得到的仍是浮点数。",
           "memory_efficient：先算 p95 // 4，再夹到 [512, 2048]；balanced：p95 // 100 取 log2 再取整，作下标。",
           "把 p95 = 2047 分别代入两个分支：一个先算 p95 // 4 再夹到列表里的尺寸，另一个取 log2(p95 // 100) "
           "的整数部分作下标。算出两个尺寸后比较：文本说哪个目标该选更大的块？"),
          kind="errata")
def _judge_errata_rule(answer: Any) -> Verdict:
    return same(answer, text_rule_at(2047.0), "(memory_efficient, balanced)", ("memory_efficient", "balanced"))


def waste_points(name: str, n: int, seed: int, small: int, large: int) -> int:
    """Percentage points by which internal waste grows from block size ``small`` to ``large``, rounded."""
    from kvlab.memory.sizing import measure_block_size
    from kvlab.workloads.mixes import make_workload
    w = make_workload(name, n, seed)
    return round(100 * (measure_block_size(w, large).waste - measure_block_size(w, small).waste))


@register("2.2.1-move-block",
          "动参数 (move a parameter)：对 make_workload('chat', 500, seed=0)，块大小从 16 改成 256，"
          "内部浪费 (measure_block_size(...).waste) 增加多少个百分点？答案写成整数（四舍五入）。",
          ("块越大，每条序列最后一块平均空得越多；对话很短，影响很大。",
           "用 kvlab.measure_block_size 分别量 16 和 256 的 waste，相减再乘 100。",
           "round(100 × (waste(256) − waste(16)))；waste = 1 − 存了 token 的槽位 / 已分配槽位。"),
          kind="parameter")
def _judge_move_block(answer: Any) -> Verdict:
    return same(answer, waste_points("chat", 500, 0, 16, 256), "百分点 (points)")


SWEEP_TERMS = ("waste", "prefix loss", "table entries", "alloc calls", "attention slots")


def rising_terms(name: str = "code", n: int = 300, seed: int = 0) -> frozenset[str]:
    """Which cost terms of a sweep (16 ... 2048) are larger at 2048 than at 16 on ``make_workload(name, n, seed)``."""
    from kvlab.memory.sizing import sweep
    from kvlab.workloads.mixes import make_workload
    rows = sweep(make_workload(name, n, seed), attention=False, progress=False).rows
    lo, hi = rows[0], rows[-1]
    value = {"waste": lambda r: r.waste, "prefix loss": lambda r: r.prefix_loss,
             "table entries": lambda r: r.table_entries, "alloc calls": lambda r: r.alloc_calls,
             "attention slots": lambda r: r.attention_slots}
    return frozenset(t for t in SWEEP_TERMS if value[t](hi) > value[t](lo))


@register("2.2.1-interpret-sweep",
          "读曲线 (interpret)：在 sweep(make_workload('code', 300, seed=0)) 的结果里，代价模型的五项 "
          f"{', '.join(SWEEP_TERMS)} 中，哪些在块大小 2048 时比 16 时大？答案写成名字的集合。",
          ("有的项按块计数，有的项按槽位或 token 计数。",
           "按块计数的项大约按 1/B 下降；和“最后一块没填满”有关的项随 B 增长。",
           "对每一项问：它按块的个数计（块越大，个数约按 1/B 变少），还是按最后一块空出的槽位计（每条序列平均约 "
           "B/2）？把五项分到这两类里。"),
          kind="interpret")
def _judge_interpret_sweep(answer: Any) -> Verdict:
    truth = rising_terms()
    got = canon(answer)
    if not isinstance(got, (tuple, frozenset)) or not all(isinstance(t, str) for t in got):
        return False, f"答案应是名字的集合，名字取自 (a set of names from) {SWEEP_TERMS}"
    unknown = sorted(set(got) - set(SWEEP_TERMS))
    if unknown:
        return False, f"不认识的名字 (unknown names) {unknown}; 可选 (choose from) {SWEEP_TERMS}"
    if frozenset(got) == truth:
        return True, f"增长的项 (rising terms): {sorted(truth)}"
    # each term rises or not: marking one wrong would spell out its answer, so only the count is told
    misjudged = sum((t in got) != (t in truth) for t in SWEEP_TERMS)
    return False, f"{len(SWEEP_TERMS)} 项里有 {misjudged} 项判断不对 (terms misjudged)"
