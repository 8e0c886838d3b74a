"""The views' visual language, defined once: every colour a view or a static figure draws and the words its legend
gives it. Python's figures read these tables; the widgets' JavaScript gets them as one generated constant
(:func:`palette_js`, put at the top of every view's module), so the two can never disagree.

The colours are the Okabe–Ito palette (Okabe and Ito, "Color Universal Design", 2002), chosen to stay apart
under the common colour-vision deficiencies, plus greys and two shades of its blue for the refcount ramp. Each
colour has one meaning in every view: cached is bluish green in the pool grid, in the memory map and in the
eviction candidates' bars; free is light grey everywhere.
"""
from __future__ import annotations

import json
import math
from typing import Any

RGB = tuple[int, int, int]

PALETTE_NAME = "Okabe–Ito"
OKABE_ITO: dict[str, RGB] = {
    "black": (0, 0, 0), "orange": (230, 159, 0), "sky blue": (86, 180, 233), "bluish green": (0, 158, 115),
    "yellow": (240, 228, 66), "blue": (0, 114, 178), "vermillion": (213, 94, 0), "reddish purple": (204, 121, 167),
}

# Block states (the frame's state byte; ALLOCATED is a ramp from one reference to eight or more).
STATE_RGB: dict[str, RGB] = {
    "FREE": (236, 236, 236), "PENDING": OKABE_ITO["orange"], "ALLOC1": OKABE_ITO["sky blue"],
    "ALLOC8": (0, 63, 125), "EVICTING": OKABE_ITO["vermillion"], "CACHED": OKABE_ITO["bluish green"],
}
# Every word a view or a still shows is Chinese first, in GLOSSARY.md's terms, with the English after it.
STATE_WORDS: dict[str, str] = {
    "FREE": "空闲 (free)", "PENDING": "待定：已预留，数据未到 (pending)", "ALLOC1": "已分配，1 个引用 (allocated)",
    "ALLOC8": "共享，8 个及以上引用，越深越多 (shared)", "EVICTING": "淘汰中：正在换出 (evicting)",
    "CACHED": "缓存：无引用，可复用、可淘汰 (cached)",
}
# The key of each state code (kvlab.core.block.FREE .. frames.CACHED); ALLOCATED's colour depends on its refcount.
STATE_KEYS = ("FREE", "PENDING", "ALLOC1", "EVICTING", "CACHED")

# Flashes (the frame's flash code): the cell is blended towards this colour, fully in the picture where the
# change happened, then less over the next three (weights below), so a change stays visible at 30 pictures/s.
FLASH_RGB: tuple[RGB | None, ...] = (None, OKABE_ITO["reddish purple"], (255, 255, 255), OKABE_ITO["black"],
                                     OKABE_ITO["reddish purple"], (255, 255, 255))
FLASH_WEIGHT = (1.0, 0.6, 0.35, 0.15)
FLASH_VERBS = {"allocated": "刚分配", "freed": "刚释放", "evicted": "刚淘汰", "moved in": "刚搬入",
               "moved out": "刚搬走"}
FLASH_WORDS = (("刚分配或搬入 (just allocated or moved in)", 1), ("刚释放或搬走 (just freed or moved away)", 2),
               ("刚被淘汰 (just evicted)", 3))

RUN_RGB = OKABE_ITO["yellow"]  # the largest free run, in the memory map
MOVE_RGB = OKABE_ITO["reddish purple"]  # a compaction's move, drawn as an arrow (its target flashes the same)
VICTIM_RGB = OKABE_ITO["black"]  # the evicted block's bar: the colour its cell flashes
CANDIDATE_RGB = STATE_RGB["CACHED"]  # the runners-up are cached blocks
OUTLINE_RGB: RGB = (34, 34, 34)  # the outline around a block of a larger size class
# Block tables (the BlockTableView, the ChatView's tables): a prefix hit is outlined in the colour of the cached
# block it came from; a copy made on write in the colour a just-allocated block flashes, its line dashed.
HIT_RGB = STATE_RGB["CACHED"]
COPY_RGB = OKABE_ITO["reddish purple"]
COPY_DASH = (6, 3)
GAP_RGB: RGB = (255, 255, 255)
TRACK_RGB: RGB = (225, 225, 225)  # an empty gauge

OTHER_WORDS = {
    "RUN": "空闲，在最长的空闲段里 (largest free run)",
    "MOVE": "压缩搬动的块，箭头从旧位置指向新位置 (moved by compaction)",
    "OUTLINE": "外框：一个更大大小级别的块 (larger size class)", "VICTIM": "策略淘汰的块 (evicted)",
    "CANDIDATE": "它跳过的缓存块 (runners-up)", "USED": "在用，任意引用数 (in use)",
    "FADE": "闪烁在之后 3 幅画面里淡去 (a flash fades)",
    "HIT": "前缀命中：由缓存提供，不重算 (prefix hit)", "SHARED": "共享：2 个及以上引用，×n (shared)",
    "COPIED": "写时复制 (copied on write)", "MAP": "连线：逻辑块到存它的物理块 (logical → physical)",
    "COPYLINE": "虚线：到写时复制出的块 (to the copy)", "HOST": "已换出到主机内存 (swapped out to host)",
}
NO_EVICTION = "还没有淘汰 (no eviction yet)"
# Why a block was evicted (the pool's reason, as a view says it).
REASON_WORDS = {"allocation pressure": "分配需要空间 (an allocation needed room)",
                "explicit": "被直接要求 (asked for directly)"}

# Gauges: (label, Frame attribute, colour, line dash in the time series).
GAUGES: tuple[tuple[str, str, RGB, tuple[int, ...]], ...] = (
    ("占用块 blocks held", "blocks_held", OKABE_ITO["blue"], ()),
    ("不可用空闲内存 unusable free memory", "unusable_free", OKABE_ITO["vermillion"], (6, 3)),
    ("内部浪费 internal waste", "internal_waste", OKABE_ITO["reddish purple"], (2, 2)),
    ("外部碎片（连续性） external fragmentation (contiguity)", "external_fragmentation", OKABE_ITO["black"],
     (8, 3, 2, 3)),
)
# The bar under "blocks held", in the views and the stills: how much of what is held is only cached (no reference,
# reusable, evictable); a frame has no field for it, it is counted from the state bytes.
CACHED_GAUGE: tuple[str, str, RGB] = ("可复用缓存块 cached (reusable)", "cached", STATE_RGB["CACHED"])
GAUGE_WORDS = {
    "blocks_held": "非空闲块的份额：被引用的、可复用缓存块 cached (reusable)、数据在途的",
    "cached": "没有引用、留着复用（可淘汰）的块的份额",
    "unusable_free": "最大大小级别的请求用不上的空闲内存的份额",
    "internal_waste": "已占槽位中没有存 token 的份额",
    "external_fragmentation": "1 − 最长空闲段 / 空闲块数（连续性）",
}

# What an eviction candidate's score means, per policy, and which way the order runs. A view shows the score as
# the quantity named here ("shown"): OPT's score is minus the next use, so its bar is the next use itself.
SCORES: dict[str, dict[str, Any]] = {
    "lru": {"what": "上次使用，池时钟 (last use)", "order": "最久未用的先走", "sign": 1},
    "lfu": {"what": "使用次数：分配 + 取引用 (uses)", "order": "用得最少的先走", "sign": 1},
    "fifo": {"what": "创建时刻，池时钟 (created at)", "order": "最老的先走", "sign": 1},
    "opt": {"what": "下次使用，工作负载时间；永不 = ∞ (next use)", "order": "下次使用最远的先走", "sign": -1},
    "clock": {"what": "在指针一圈扫描中的位置 (place in the sweep)",
              "order": "0 先走；指针上次经过后读过的块有第二次机会", "sign": 1},
    "random": {"what": "在这次随机抽签中的位置 (place in the draw)", "order": "位置 0 先走", "sign": 1},
}
UNKNOWN_SCORE = {"what": "分数 (score)", "order": "最低的先走", "sign": 1}


def score_words(policy: str) -> dict[str, Any]:
    """What ``policy``'s eviction score means: ``what`` it is, the ``order`` of eviction, and the ``sign`` to
    multiply a score by to get the quantity shown."""
    return SCORES.get(policy, UNKNOWN_SCORE)


def shown_score(policy: str, score: float) -> float:
    """The quantity a view shows for a candidate's ``score`` (OPT's next use for its minus next use)."""
    return score_words(policy)["sign"] * score


def bar_axis(shown: list[float]) -> float:
    """Where the bars of scores ``shown`` start: 0, unless the scores sit far from zero compared with their spread
    (LRU's last uses 1109 and 1113: bars from zero look identical); then half their spread below the smallest,
    so the smallest bar is a third of the largest. Never-again scores (infinite) take the full bar."""
    finite = [abs(v) for v in shown if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    return 0.0 if hi == lo or lo <= 2 * (hi - lo) else lo - (hi - lo) / 2


def fmt_score(x: float) -> str:
    """A score in words: ``∞`` for never, integers without decimals, draws to three places."""
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    return f"{x:g}" if float(x).is_integer() else f"{x:.3f}"


def rgb01(c: RGB) -> tuple[float, float, float]:
    """A colour as matplotlib takes it."""
    return (c[0] / 255, c[1] / 255, c[2] / 255)


def palette_js() -> str:
    """The palette as the JavaScript constant ``KV_PALETTE_DATA`` that ``widgets/common.js`` reads."""
    data = {
        "name": PALETTE_NAME, "state": {**STATE_RGB, "GAP": GAP_RGB}, "stateWords": STATE_WORDS,
        "flash": FLASH_RGB, "flashWeight": FLASH_WEIGHT, "flashWords": FLASH_WORDS, "flashVerbs": FLASH_VERBS,
        "run": RUN_RGB,
        "move": MOVE_RGB, "victim": VICTIM_RGB, "candidate": CANDIDATE_RGB, "outline": OUTLINE_RGB,
        "track": TRACK_RGB, "hit": HIT_RGB, "copied": COPY_RGB, "copyDash": COPY_DASH, "words": OTHER_WORDS,
        "gauges": [list(g) for g in GAUGES], "cachedGauge": list(CACHED_GAUGE), "gaugeWords": GAUGE_WORDS,
        "scores": SCORES, "unknownScore": UNKNOWN_SCORE, "reasons": REASON_WORDS, "noEviction": NO_EVICTION,
    }
    return f"const KV_PALETTE_DATA = {json.dumps(data, ensure_ascii=False)};\n"
