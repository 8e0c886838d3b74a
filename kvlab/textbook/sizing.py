"""The text's ``ChunkSizeOptimizer`` (§2.2.1, "分块大小选择算法示例") as written, to show what it does.

kvlab's own :class:`kvlab.memory.sizing.ChunkSizeOptimizer` keeps the text's rule and mends it. This one is the
text's code, unchanged apart from type hints and docstrings, so that a chapter can run it and show:

* ``recommend_chunk_size`` before ``analyze_sequence_distribution`` reads ``p95`` from the empty
  ``defaultdict(int)``, which answers 0. ``'memory_efficient'`` then returns 512 and ``'performance_optimal'``
  256, silently; only ``'balanced'`` raises (``int(np.log2(0))`` is ``int(-inf)``: ``OverflowError``);
* the same ``OverflowError`` for every p95 below 100 (a service of short turns);
* the two clamps return numpy floats (``p95 // 4`` of a numpy float), not always powers of two;
* any unknown goal is treated as ``'balanced'``.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sized
from typing import Any

import numpy as np


class TextChunkSizeOptimizer:
    """The text's optimizer, line for line."""

    def __init__(self) -> None:
        self.sequence_length_stats: dict[str, Any] = defaultdict(int)
        self.performance_metrics: dict[Any, Any] = {}

    def analyze_sequence_distribution(self, sequences: Iterable[Sized]) -> dict[str, Any]:
        """分析序列长度分布 (the text's statistics of ``len(seq)``)."""
        lengths = [len(seq) for seq in sequences]
        self.sequence_length_stats = {
            'mean': np.mean(lengths),
            'median': np.median(lengths),
            'p95': np.percentile(lengths, 95),
            'p99': np.percentile(lengths, 99),
            'max': max(lengths)
        }
        return self.sequence_length_stats

    def recommend_chunk_size(self, optimization_goal: str = 'balanced') -> Any:
        """根据优化目标推荐分块大小 (the text's rule on the p95)."""
        stats = self.sequence_length_stats
        p95_length = stats['p95']

        if optimization_goal == 'memory_efficient':
            # 内存效率优先：选择较大的分块，减少碎片
            return min(max(p95_length // 4, 512), 2048)
        elif optimization_goal == 'performance_optimal':
            # 性能优先：选择适中的分块大小，平衡内存和访问效率
            return min(max(p95_length // 6, 256), 1024)
        else:  # balanced
            # 平衡策略：基于统计分布选择最优分块大小
            optimal_sizes = [64, 128, 256, 512, 1024]
            return optimal_sizes[min(len(optimal_sizes) - 1,
                                     int(np.log2(p95_length // 100)))]
