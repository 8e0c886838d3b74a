"""Exercises of §2.2.5 (performance): how often the pool takes its lock."""
from __future__ import annotations

from typing import Any

from . import Verdict, metadata_pool, register, same


def lock_scenario(n: int = 100) -> tuple[int, int]:
    """Lock acquisitions for ``n`` one-block allocations and frees, and for one batched allocate and free."""
    one = metadata_pool(n, 16)
    for _ in range(n):
        one.allocate(1)
    for b in range(n):
        one.free([b])
    batch = metadata_pool(n, 16)
    batch.free(batch.allocate(n))
    return one.lock_acquisitions, batch.lock_acquisitions


@register("2.2.5-locks",
          "把 100 个块一个一个 allocate(1) 再一个一个 free([b])，与 allocate(100) 后一次 free(全部) 相比，"
          "BlockPool.lock_acquisitions 各是多少？答案写成 (逐个, 批量)。",
          ("锁是按调用拿的，还是按块拿的？",
           "数一数两种做法各调用了几次公开的修改操作。",
           "每个公开的修改操作只拿一次锁：逐个 = 100 + 100，批量 = 1 + 1。"))
def _judge_locks(answer: Any) -> Verdict:
    return same(answer, lock_scenario(), "(one by one, batched)", ("逐个 (one by one)", "批量 (batched)"))
