"""Exercises of §2.2.3 (allocation and release): shared prefixes and the allocator's strategies."""
from __future__ import annotations

from typing import Any

import numpy as np

from kvlab.exercises.framework import Verdict, metadata_pool, register, register_prediction, same


def sharing_scenario(users: int = 5, prefix_blocks: int = 3, own_blocks: int = 2) -> tuple[int, int]:
    """``users`` sequences share ``prefix_blocks`` blocks and each owns ``own_blocks`` more:
    (refcount of a shared block, blocks used)."""
    pool = metadata_pool(max(64, prefix_blocks + users * own_blocks), 16)
    prefix = pool.allocate(prefix_blocks)
    pool.incref(np.repeat(prefix, users - 1))
    for _ in range(users):
        pool.allocate(own_blocks)
    return pool.fields.refcount[prefix[0]], pool.num_blocks - pool.num_free_blocks


@register("2.2.3-sharing",
          "5 个用户共享同一段系统提示词，占 3 个块（第一个用户 allocate，其余 4 个各 incref 一次）；"
          "每个用户再各自 allocate 2 个块。共享块的引用计数是多少？池里一共用掉多少块？答案写成 (refcount, used)。",
          ("共享的块存几份？",
           "引用计数数的是“有几个用户在用”；用掉的块数 = 共享块 + 各自的块。",
           "每个用户的块表都指向同一份前缀块：一个前缀块被几张块表引用？已用的块 = 只存一份的前缀块 + "
           "每个用户自己的块。"))
def _judge_sharing(answer: Any) -> Verdict:
    return same(answer, sharing_scenario(), "(refcount, used blocks)", ("refcount", "used"))


def strategy_scenario() -> list[str]:
    """What the allocator did for size classes 0, 0, 0, 2 on an 8-block buddy pool ('wait' if it queued)."""
    from kvlab.memory.allocator import DynamicAllocator  # lazily: the allocator is optional for the other exercises
    pool = metadata_pool(8, 16, block_sizes=[16, 32, 64, 128])
    alloc = DynamicAllocator(pool)
    out = []
    for size_class in (0, 0, 0, 2):
        ticket = alloc.allocate_optimal_block(size_class=size_class)
        out.append(ticket.strategy or "wait")  # a ticket left waiting has no strategy yet
    return out


@register("2.2.3-strategies",
          "一个 8 个基本块的伙伴池（block_sizes=[16, 32, 64, 128]，开始时是一整块 128 token 的空闲块）。"
          "DynamicAllocator 依次为 size_class 0, 0, 0, 2 各分配一块。每次由哪种策略满足"
          "（'exact' / 'split' / 'merge' / 'evict' / 'wait'）？答案写成列表。",
          ("开始时只有一块最大的空闲块；小请求从哪里来？",
           "画出每次分配后各级空闲链表里有什么：切分留下的另一半还在链表里。",
           "画出 16/32/64/128 四级空闲链表。每次分配先看本级有没有空闲块：有就直接取 (exact)，"
           "没有就从更大的一级切一半 (split)，另一半挂回链表。逐次写下链表的样子。"))
def _judge_strategies(answer: Any) -> Verdict:
    return same(answer, strategy_scenario(), "策略 (strategies)",
                [f"第 {i + 1} 次 (request {i + 1})" for i in range(4)])


# ---------------------------------------------------------------------------- predictions
register_prediction("2.2.3-first-strategy",
                    "一整块 128 token 空闲的伙伴池，第一次请求一个 16 token 的块：DynamicAllocator 用哪种策略满足？",
                    choices=("exact", "split", "merge", "evict", "wait"))
register_prediction("2.2.3-text-retry",
                    "文本的分配器在没有空闲块时先 evict_block()，再 get_best_block() 重试。重试能成功吗？",
                    choices=("succeeds", "fails"))


# ---------------------------------------------------------------------------- errata hunting
TEXT_ALLOCATOR = '''\
class Pool:                          # the text's shape: free lists by size, blocks found but not taken
    def __init__(self, n):           # n FREE blocks put in by us: the text's pool never creates any
        self.free = {16: [{"id": i, "status": "FREE"} for i in range(n)]}
        self.active = {}
    def get_best_block(self, size):
        for b in self.free[16]:
            if b["status"] == "FREE":
                return b
        return None
    def allocate_optimal_block(self, size):
        return self.get_best_block(size)     # strategy 1 of the text: found, returned, never marked
'''


def text_allocator_story(callers: int = 3) -> list[int]:
    """Run :data:`TEXT_ALLOCATOR`: ``callers`` requests in turn, no threads; the block id each gets."""
    ns: dict[str, Any] = {}
    exec(TEXT_ALLOCATOR, ns)  # the snippet the prompt shows is the one that is run
    pool = ns["Pool"](4)
    return [pool.allocate_optimal_block(16)["id"] for _ in range(callers)]


@register("2.2.3-errata-handout",
          "找错 (find the bug)：\n" + TEXT_ALLOCATOR +
          "pool = Pool(4)（文本的池从不创建块，照原样每个请求都得到 None；这里假设池里有 4 个空闲块）；"
          "三个请求依次（不用线程）调用 pool.allocate_optimal_block(16)。每个请求拿到的块 id 是什么？答案写成列表。",
          ("“找到一个空闲块”和“占用它”是两件事。",
           "看 allocate_optimal_block 返回之前，块的 status 有没有被改掉。",
           "逐行跟踪 allocate_optimal_block：找到块以后，有没有哪一行改了它的状态，或把它从空闲链表里拿走？"
           "第二个调用者看到的链表和第一个看到的一样吗？"),
          kind="errata")
def _judge_errata_handout(answer: Any) -> Verdict:
    return same(answer, text_allocator_story(), "块 id (block ids)",
                [f"请求 {i + 1} (request {i + 1})" for i in range(3)])


TEXT_EVICT = '''\
class Pool:                          # the text's shape: evicted blocks leave `active` and go nowhere
    def __init__(self, n):           # n active blocks put in by us: the text's pool never has any
        self.free_lists = {16: []}                        # nothing ever fills them
        self.active = {i: {"refs": 0, "status": "ALLOCATED"} for i in range(n)}
    def get_best_block(self, size):
        return next((b for b in self.free_lists[16] if b["status"] == "FREE"), None)
    def evict_block(self):
        block_id = next(iter(self.active))
        block = self.active.pop(block_id)
        block["status"] = "FREE"
        return block
'''


def text_evict_story(evictions: int = 2) -> tuple[int, int, str]:
    """Run :data:`TEXT_EVICT`: evict ``evictions`` times, then retry; (active left, free-list length, retry)."""
    ns: dict[str, Any] = {}
    exec(TEXT_EVICT, ns)
    pool = ns["Pool"](4)
    for _ in range(evictions):
        pool.evict_block()
    retry = pool.get_best_block(16)
    return len(pool.active), len(pool.free_lists[16]), "found" if retry is not None else "None"


@register("2.2.3-errata-retry",
          "找错 (find the bug)：\n" + TEXT_EVICT +
          "pool = Pool(4)（假设池里有 4 个可淘汰的活跃块；文本的池从不创建块）；调用两次 pool.evict_block()，"
          "然后 pool.get_best_block(16)。"
          "答案写成 (len(pool.active), len(pool.free_lists[16]), 'found' 或 'None')。",
          ("被淘汰的块去了哪里？",
           "看 evict_block 把块从哪里拿走、又放到了哪里；get_best_block 只在哪里找？",
           "画两个框：active 和 free_lists[16]。每次 evict_block 从哪个框拿走一块、又放进哪个框？get_best_block "
           "只在哪个框里找？"),
          kind="errata")
def _judge_errata_retry(answer: Any) -> Verdict:
    return same(answer, text_evict_story(), "(active, free list, retry)", ("active", "free list", "retry"),
                two_way=("retry",))


def blocks_saved(users: int, prefix_blocks: int = 3, own_blocks: int = 2) -> int:
    """Blocks that sharing the prefix saves: ``users`` private copies measured on a pool minus the shared case."""
    pool = metadata_pool(users * (prefix_blocks + own_blocks), 16)
    for _ in range(users):
        pool.allocate(prefix_blocks + own_blocks)
    private = pool.num_blocks - pool.num_free_blocks
    return private - sharing_scenario(users, prefix_blocks, own_blocks)[1]


@register("2.2.3-move-users",
          "动参数 (move a parameter)：沿用 2.2.3-sharing 的设定（共享前缀 3 块，每人另有 2 块），"
          "和每人各存一份前缀相比，共享在 5 个用户时省下多少块？50 个用户时呢？答案写成 (5 个用户, 50 个用户)。",
          ("不共享时，每个用户都要自己存一份前缀。",
           "分别算不共享和共享两种情况用掉的块数，再相减；用户数变了，哪一部分跟着变？",
           "不共享时每个用户各存一份前缀，共享时前缀只存一份：省下的块 = 少存的前缀份数 × 每份前缀的块数。对 5 个和 "
           "50 个用户各算一次。"),
          kind="parameter")
def _judge_move_users(answer: Any) -> Verdict:
    return same(answer, (blocks_saved(5), blocks_saved(50)), "(5 users, 50 users)", ("5 users", "50 users"))
