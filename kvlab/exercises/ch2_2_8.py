"""Exercises of the extension chapter 2.2.8 (inside a real model): the blocks parallel samples hold under
copy-on-write, and the tokens a prefix hit leaves to compute; the chapter's predictions. Every truth is computed on
a metadata pool (:func:`~kvlab.exercises.framework.metadata_pool`), never typed in."""
from __future__ import annotations

from typing import Any

from kvlab.core.sequence import SequenceManager
from kvlab.exercises.framework import Verdict, metadata_pool, register, register_prediction, same


def samples_blocks(prompt: int = 50, samples: int = 3, new_tokens: int = 20, block_size: int = 16) -> tuple[int, int]:
    """(blocks held, blocks of independent copies) for ``samples`` parallel samples of a ``prompt``-token prompt,
    forked after the prompt and each appending ``new_tokens`` tokens one step at a time (copy-on-write)."""
    per = -(-(prompt + new_tokens) // block_size)
    pool = metadata_pool(samples * per + 1, block_size)
    manager = SequenceManager(pool)
    first = manager.create()
    manager.append(first, prompt)
    seqs = [first] + [manager.fork(first) for _ in range(samples - 1)]
    for _ in range(new_tokens):
        manager.append_batch(seqs, [1] * samples)
    return pool.num_blocks - pool.num_free_blocks, samples * per


@register("2.2.8-samples",
          "一个 50 token 的提示（block_size 16）算完以后分叉成 3 个并行样本（fork），每个样本再逐个生成 20 个 token，"
          "写时复制（copy-on-write）。最后池里一共占着多少个块？如果 3 个样本各存一份完整的副本，要多少个块？"
          "答案写成 (held, independent)。",
          ("哪些块 3 个样本一直共享，哪些块每个样本各有一份？",
           "写满的提示块永远不再被写，所以一直共享；没写满的最后一块在第一次写入时被复制；之后的新块各自分配。",
           "共享 = floor(50 / 16) 个满块；每个样本共 ceil((50 + 20) / 16) 块，其中私有的是总数减去共享的；"
           "held = 共享 + 3 × 私有；independent = 3 × ceil(70 / 16)。"))
def _judge_samples(answer: Any) -> Verdict:
    return same(answer, samples_blocks(), "(占用块, 独立副本的块) (held, independent)",
                ("占用块 (held)", "独立副本的块 (independent)"))


def hit_computed(prompt: int = 64, block_size: int = 16) -> int:
    """Tokens the model still computes when a ``prompt``-token prompt arrives again after the identical prompt was
    computed and its full blocks cached."""
    pool = metadata_pool(2 * -(-prompt // block_size) + 1, block_size)
    manager = SequenceManager(pool, prefix_cache=True)
    tokens = list(range(1, prompt + 1))
    first = manager.create(tokens)
    manager.append(first, tokens)
    manager.cache_full_blocks(first)
    manager.free(first)
    again = manager.create(tokens)
    return prompt - again.num_tokens


@register("2.2.8-hit-tokens",
          "一个 64 token 的提示（block_size 16，正好 4 个满块）算完后，它的满块都进了前缀缓存。"
          "一模一样的提示再来一次：模型还要计算其中多少个 token？",
          ("命中的块不用再算；可是模型还需要什么才能生成下一个 token？",
           "生成第一个新 token 要用提示最后一个 token 的 logits，而命中的块只给出 K/V，不给 logits。",
           "至少留最后一个 token 要算；命中只按整块算，所以最后一个 token 所在的整块都要重算："
           "64 − 16 × floor((64 − 1) / 16)。"))
def _judge_hit_tokens(answer: Any) -> Verdict:
    return same(answer, hit_computed(), "要计算的 token 数 (tokens computed)")


# ---------------------------------------------------------------------------- predictions
register_prediction("2.2.8-online",
                    "内核一块一块地读块表，每块只算这一块的分数，用“累计最大值 + 累计和”把各块拼起来"
                    "（online softmax）。它的结果和对整段连续 K/V 做一次 softmax 相比：在浮点舍入之内相等，还是不同？"
                    "(block by block with a running max and sum: equal to one softmax over all positions, "
                    "or different?)",
                    choices=("equal", "different"))
register_prediction("2.2.8-copies",
                    "4 个样本共享同一个提示的全部块（最后一块没写满）。第一步解码，每个样本各写入 1 个 token："
                    "这一步一共复制了几个块？(4 samples share every block; each appends one token: how many blocks "
                    "are copied in that step?)")
register_prediction("2.2.8-hashes",
                    "改掉提示第 1 块（从 0 数起）里的一个 token，其余 token 都不变。提示的满块里，有几个块的哈希会变？"
                    "(change one token in block 1 of the prompt: how many of its full blocks' hashes change?)")
