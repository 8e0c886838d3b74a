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
STATE_WORDS: dict[str, str] = {
    "FREE": "free", "PENDING": "pending: reserved, not yet committed", "ALLOC1": "allocated, 1 reference",
    "ALLOC8": "shared, 8+ references (darker = more)", "EVICTING": "evicting: being swapped out",
    "CACHED": "cached: no reference, reusable, evictable",
}
# The key of each state code (kvlab.core.block.FREE .. frames.CACHED); ALLOCATED's colour depends on its refcount.
STATE_KEYS = ("FREE", "PENDING", "ALLOC1", "EVICTING", "CACHED")

# Flashes (the frame's flash code): the cell is blended towards this colour, fully in the picture where the
# change happened, then less over the next three (weights below), so a change stays visible at 30 pictures/s.
FLASH_RGB: tuple[RGB | None, ...] = (None, OKABE_ITO["reddish purple"], (255, 255, 255), OKABE_ITO["black"],
                                     OKABE_ITO["reddish purple"], (255, 255, 255))
FLASH_WEIGHT = (1.0, 0.6, 0.35, 0.15)
FLASH_WORDS = (("just allocated or moved in", 1), ("just freed or moved away", 2), ("just evicted", 3))

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
    "RUN": "free, in the largest free run", "MOVE": "block moved by compaction (arrow: old place to new)",
    "OUTLINE": "outline: one block of a larger size class", "VICTIM": "the block the policy evicted",
    "CANDIDATE": "a cached block it passed over (its runners-up)", "USED": "in use (any number of references)",
    "FADE": "a flash fades over the next 3 pictures",
    "HIT": "prefix hit: served by the cache, not recomputed", "SHARED": "shared: 2 or more references (×n)",
    "COPIED": "copied on write", "MAP": "line: logical block to the physical block holding it",
    "COPYLINE": "dashed: to the block copied on write", "HOST": "swapped out to host memory",
}

# Gauges: (label, Frame attribute, colour, line dash in the time series).
GAUGES: tuple[tuple[str, str, RGB, tuple[int, ...]], ...] = (
    ("blocks held", "blocks_held", OKABE_ITO["blue"], ()),
    ("unusable free memory", "unusable_free", OKABE_ITO["vermillion"], (6, 3)),
    ("internal waste", "internal_waste", OKABE_ITO["reddish purple"], (2, 2)),
    ("external fragmentation (contiguity)", "external_fragmentation", OKABE_ITO["black"], (8, 3, 2, 3)),
)
# The bar under "blocks held", in the views and the stills: how much of what is held is only cached (no reference,
# reusable, evictable); a frame has no field for it, it is counted from the state bytes.
CACHED_GAUGE: tuple[str, str, RGB] = ("cached (reusable)", "cached", STATE_RGB["CACHED"])
GAUGE_WORDS = {
    "blocks_held": "share of blocks not free: referenced, cached (reusable) or in flight",
    "cached": "share of blocks with no reference, kept for reuse (evictable)",
    "unusable_free": "share of free memory a largest-class request cannot use",
    "internal_waste": "share of held slots holding no token",
    "external_fragmentation": "1 - largest free run / free blocks (contiguity)",
}

# What an eviction candidate's score means, per policy, and which way the order runs. A view shows the score as
# the quantity named here ("shown"): OPT's score is minus the next use, so its bar is the next use itself.
SCORES: dict[str, dict[str, Any]] = {
    "lru": {"what": "last use (pool clock tick)", "order": "least recently used goes first", "sign": 1},
    "lfu": {"what": "uses (allocations + references taken)", "order": "fewest uses go first", "sign": 1},
    "fifo": {"what": "created at (pool clock tick)", "order": "oldest goes first", "sign": 1},
    "opt": {"what": "next use (workload time; never = ∞)", "order": "farthest next use goes first", "sign": -1},
    "clock": {"what": "place in the hand's sweep", "order": "0 goes first; a block read since the hand last "
              "passed gets a second chance", "sign": 1},
    "random": {"what": "place in this eviction's random draw", "order": "place 0 goes first", "sign": 1},
}
UNKNOWN_SCORE = {"what": "score", "order": "lowest goes first", "sign": 1}


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
        "flash": FLASH_RGB, "flashWeight": FLASH_WEIGHT, "flashWords": FLASH_WORDS, "run": RUN_RGB,
        "move": MOVE_RGB, "victim": VICTIM_RGB, "candidate": CANDIDATE_RGB, "outline": OUTLINE_RGB,
        "track": TRACK_RGB, "hit": HIT_RGB, "copied": COPY_RGB, "copyDash": COPY_DASH, "words": OTHER_WORDS,
        "gauges": [list(g) for g in GAUGES], "cachedGauge": list(CACHED_GAUGE), "gaugeWords": GAUGE_WORDS,
        "scores": SCORES, "unknownScore": UNKNOWN_SCORE,
    }
    return f"const KV_PALETTE_DATA = {json.dumps(data, ensure_ascii=False)};\n"
