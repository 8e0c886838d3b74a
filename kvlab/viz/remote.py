"""A server's KV cache as a router sees it: a view built only from the server's KV events.

The idea: a KV-aware router never sees the server's pool. It sees a stream of events, blocks stored (each named by
its hash, its parent's hash and its tokens) and removed, and rebuilds from them the tree of cached prefixes
(:class:`~kvlab.kvevents.remote.RemoteCache`). This view draws that tree, per tier (medium, KV group), as an icicle:
column ``i`` holds the cached blocks that are the ``i``-th block of some prompt, each as tall as the prompts it
starts; the leading blocks a typed prompt would hit are outlined. Under it, blocks stored and removed per batch,
with the holes in the stream marked (batches lost and not replayed: the tree may then hold blocks that are gone).

What the events never say, and so no router knows: :data:`NEVER_SEEN`. kvlab's own views show all of it for a
kvlab run, which can publish the same events (:class:`~kvlab.kvevents.publisher.KVEventPublisher`): put the two
side by side and compare.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets  # type: ignore[import-untyped]
import numpy as np
from matplotlib.collections import PolyCollection

from kvlab.core.checks import check_positive, check_real
from kvlab.core.errors import ConfigError
from kvlab.kvevents.remote import RemoteBlock, RemoteCache, Tier
from kvlab.kvevents.subscriber import Received, Subscriber
from kvlab.kvevents.wire import BlockHash, BlockRemoved, BlockStored
from kvlab.viz.palette import OKABE_ITO, STATE_RGB, rgb01
from kvlab.viz.static import MIN_PT, Picture, figure_png

NEVER_SEEN = (
    "物理块号 (physical block ids)：事件只给哈希，块在显存里的位置不出现",
    "空闲链表和它的顺序 (the free list and its order)：下一个被分配、被淘汰的是谁",
    "引用计数 (reference counts)：一个块被几个运行中的请求共享",
    "正在填的部分块 (running partial blocks)：只有满块才登记、才发 BlockStored",
    "拥有者 (owners)：哪个请求持有哪个块",
    "抢占 (preemptions) 和换出 (swaps)：请求丢了块，事件里只见 BlockRemoved（或什么也不见）",
    "复制 (copies)：写时复制、换入换出搬的数据",
)
MAX_DRAWN = 4000  # blocks drawn one by one; past it each column is one bar of its count
TIER_RGB = (OKABE_ITO["bluish green"], OKABE_ITO["blue"], OKABE_ITO["orange"], OKABE_ITO["reddish purple"])


@dataclass(slots=True)
class BatchMark:
    """One delivered batch in the timeline: blocks stored and removed in it, batches lost just before it."""
    seq: int
    ts: float
    stored: int
    removed: int
    missed: int
    restarted: bool


class RemoteState:
    """The view's model: a :class:`~kvlab.kvevents.remote.RemoteCache` fed with :class:`Received` batches, and the
    last ``keep`` batches' marks. A restart forgets the cache (it describes a server that is gone)."""

    def __init__(self, keep: int = 600) -> None:
        self.cache = RemoteCache()
        self.timeline: deque[BatchMark] = deque(maxlen=check_positive(keep, "keep"))
        self.batches = self.missed = self.restarts = 0

    def apply(self, r: Received) -> None:
        """Take one delivered batch into the model."""
        if r.restarted:
            self.cache.clear()
            self.restarts += 1
        events = r.batch.events
        self.cache.apply(events)
        stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
        removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        self.timeline.append(BatchMark(r.seq, float(r.batch.ts), stored, removed, r.missed, r.restarted))
        self.batches += 1
        self.missed += r.missed


def _children(blocks: dict[BlockHash, RemoteBlock]) -> tuple[list[BlockHash], dict[BlockHash, list[BlockHash]]]:
    """The tier's roots (no parent, or a parent never seen: an orphan) and each block's children."""
    kids: dict[BlockHash, list[BlockHash]] = {}
    roots: list[BlockHash] = []
    for h, b in blocks.items():
        if b.parent is None or b.parent not in blocks:
            roots.append(h)
        else:
            kids.setdefault(b.parent, []).append(h)
    return roots, kids


def icicle(blocks: dict[BlockHash, RemoteBlock]) -> list[tuple[BlockHash, int, float, float]]:
    """Each block's place in the icicle: ``(hash, depth, y0, height)``, a leaf 1 high and every block as high as
    the leaves under it, siblings stacked in the order the tree has them (iteratively: a prefix can be
    thousands of blocks deep)."""
    roots, kids = _children(blocks)
    leaves: dict[BlockHash, int] = {}
    order: list[BlockHash] = []  # parents before children
    stack = list(reversed(roots))
    while stack:
        h = stack.pop()
        order.append(h)
        stack.extend(reversed(kids.get(h, [])))
    for h in reversed(order):
        leaves[h] = sum(leaves[k] for k in kids.get(h, [])) or 1
    out: list[tuple[BlockHash, int, float, float]] = []
    place: dict[BlockHash, tuple[int, float]] = {}
    y = 0.0
    for h in roots:
        place[h] = (0, y)
        y += leaves[h]
    for h in order:
        depth, y0 = place[h]
        out.append((h, depth, y0, float(leaves[h])))
        at = y0
        for k in kids.get(h, []):
            place[k] = (depth + 1, at)
            at += leaves[k]
    return out


def depth_counts(blocks: dict[BlockHash, RemoteBlock]) -> list[int]:
    """Blocks per column of the icicle (per position in the prompt), level by level from the roots, without
    placing any: what the still draws when there are too many blocks to draw one by one."""
    roots, kids = _children(blocks)
    counts: list[int] = []
    level = roots
    while level:
        counts.append(len(level))
        level = [k for h in level for k in kids.get(h, ())]
    return counts


def _tier_name(tier: Tier) -> str:
    medium, group = tier
    return f"{medium or '介质未标 (no medium)'} · KV 组 {group if group is not None else 0} (group)"


def plot_remote(state: RemoteState, prompt: Sequence[int] | None = None, title: str = "") -> Picture:
    """The still of :class:`RemoteCacheView`: the icicle of each tier's cached prefixes (the blocks ``prompt``
    would hit outlined), and blocks stored and removed per batch (holes in the stream marked)."""
    cache = state.cache
    tiers = cache.tiers() or [(None, None)]
    fig = Picture(figsize=(10, 2.6 * len(tiers) + 2.4), layout="constrained")
    axes = fig.subplots(len(tiers) + 1, 1, height_ratios=[2.6] * len(tiers) + [1.6])
    for t, (ax, tier) in enumerate(zip(axes, tiers)):
        blocks = cache.blocks.get(tier, {})
        color = rgb01(TIER_RGB[t % len(TIER_RGB)])
        hits = set(cache.hit_path(prompt, tier=tier)) if prompt else set()
        if len(blocks) <= MAX_DRAWN:  # one collection for every block: a patch each cost ~0.5 ms a block
            placed = icicle(blocks)
            x0, y0, hgt = (np.array([p[i] for p in placed], np.float64).reshape(-1) for i in (1, 2, 3))
            boxes = np.stack([np.stack([x0, y0], 1), np.stack([x0 + 0.92, y0], 1),
                              np.stack([x0 + 0.92, y0 + hgt], 1), np.stack([x0, y0 + hgt], 1)], 1)
            hit = np.array([h in hits for h, _, _, _ in placed], bool)
            orphan = np.array([blocks[h].parent is not None and blocks[h].parent not in blocks  # parent never seen
                               for h, _, _, _ in placed], bool)
            faces = np.where(orphan[:, None], rgb01(STATE_RGB["FREE"]), color)
            edges = np.where(hit[:, None], (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # a hit outlined black
            ax.add_collection(PolyCollection(list(boxes), facecolors=faces, edgecolors=edges,
                                             linewidths=np.where(hit, 2.2, 0.4)))
            ax.set_xlim(0, float(x0.max(initial=0)) + 1)
            ax.set_ylim(0, float((y0 + hgt).max(initial=1.0)))
            ax.set_yticks([])
        else:  # too many to draw one by one: blocks per column
            depths = depth_counts(blocks)
            ax.stairs(depths, np.arange(len(depths) + 1), fill=True, color=color)
            ax.set_ylabel("块数 (blocks)", fontsize=MIN_PT)
        ax.invert_yaxis()
        hit_words = f"；这个提示命中前 {len(hits)} 块 (would hit)" if prompt else ""
        ax.set_title(f"{_tier_name(tier)}：{len(blocks)} 个缓存块 (cached blocks){hit_words}", fontsize=10)
        ax.set_xlabel("块在提示里的位置 (block position in the prompt)", fontsize=MIN_PT)
    ax = axes[-1]
    marks = list(state.timeline)
    steps = np.arange(len(marks) + 1) - 0.5  # one step per batch: two artists, however many batches
    ax.stairs([m.stored for m in marks], steps, fill=True, color=rgb01(OKABE_ITO["bluish green"]),
              label="存入 (stored)")
    ax.stairs([-m.removed for m in marks], steps, fill=True, color=rgb01(OKABE_ITO["vermillion"]),
              label="移除 (removed)")
    holes = [i - 0.5 for i, m in enumerate(marks) if m.missed or m.restarted]
    if holes:
        ax.vlines(holes, 0, 1, transform=ax.get_xaxis_transform(), colors="black", linestyles=":", lw=1.2)
    ax.axhline(0, color="0.5", lw=0.6)
    ax.set_xlabel(f"最近 {len(marks)} 批 (batches)；虚线：流里的缺口或重启 (a gap or a restart)", fontsize=MIN_PT)
    ax.set_ylabel("块 (blocks)", fontsize=MIN_PT)
    ax.legend(fontsize=MIN_PT, loc="upper left", frameon=False)
    counts = cache.counts()
    fig.suptitle(title or f"路由器看到的缓存 (the cache a router sees)：存入 {counts['stored']}、"
                 f"移除 {counts['removed']}、缺失的批 {state.missed} (batches missed)", fontsize=11)
    return fig


class RemoteCacheView(widgets.VBox):
    """The live view: follows a :class:`~kvlab.kvevents.subscriber.Subscriber` (started on the running loop if it
    is not yet), redraws at most ``fps`` times a second (and, when a picture is slow, waits twice its time, so the
    loop keeps two thirds for the stream and the notebook), and answers a typed prompt with the blocks the server
    would hit. ``tokenize`` turns the typed text into token ids (a model's ``tokenizer.encode``, or a chat
    template); without it the box takes token ids separated by spaces."""

    def __init__(self, subscriber: Subscriber, *, tokenize: Callable[[str], Sequence[int]] | None = None,
                 fps: float = 4.0, keep: int = 600) -> None:
        if not isinstance(subscriber, Subscriber):
            raise ConfigError(f"RemoteCacheView follows a kvlab.kvevents.Subscriber, got {type(subscriber).__name__}")
        if tokenize is not None and not callable(tokenize):
            raise ConfigError(f"tokenize must be callable (text -> token ids) or None, got {tokenize!r:.80}")
        self.interval = 1.0 / check_real(fps, "fps", 0, 30, lo_open=True)
        self.subscriber, self.tokenize = subscriber, tokenize
        self.state = RemoteState(keep)
        self.prompt: list[int] | None = None
        self.image = widgets.Image(format="png")
        self.box = widgets.Text(placeholder="输入一个提示，看服务器会命中几块 (type a prompt)" if tokenize else
                                "输入 token id，空格分开 (token ids)", layout=widgets.Layout(width="100%"))
        self.answer = widgets.Label()
        self.box.observe(self._typed, names="value")
        super().__init__([self.image, self.box, self.answer])
        self._pending: asyncio.TimerHandle | None = None
        self._cost = 0.0  # seconds the last picture took
        self._unsubscribe = subscriber.subscribe(self._on_batch)
        self.redraw()
        if not subscriber.running:
            subscriber.start()

    def close(self) -> None:
        """Stop following (the subscriber keeps running for its other listeners)."""
        if hasattr(self, "_unsubscribe"):  # not on a view whose construction was refused (ipywidgets' __del__)
            self._unsubscribe()
            if self._pending is not None:
                self._pending.cancel()
        super().close()

    def _on_batch(self, r: Received) -> None:
        self.state.apply(r)
        if self._pending is None:  # at most one redraw waiting: a burst of batches costs one picture
            # and a slow picture waits twice its cost: drawing never takes more than a third of the loop
            delay = max(self.interval, 2 * self._cost)
            self._pending = asyncio.get_running_loop().call_later(delay, self._flush)

    def _flush(self) -> None:
        self._pending = None
        t0 = time.perf_counter()
        self.redraw()
        self._cost = time.perf_counter() - t0

    def _typed(self, change: dict[str, Any]) -> None:
        text = str(change["new"]).strip()
        try:
            self.prompt = (list(self.tokenize(text)) if self.tokenize else [int(t) for t in text.split()]) or None
        except (ValueError, TypeError) as e:
            self.prompt = None
            self.answer.value = f"读不懂这个提示 (unreadable): {e}"
            return
        self.redraw()

    def hit_blocks(self) -> int:
        """The leading blocks of the typed prompt the server holds (0 with no prompt)."""
        return self.state.cache.hit_blocks(self.prompt) if self.prompt else 0

    def redraw(self) -> None:
        """Draw the picture and the answer from the model now."""
        fig = plot_remote(self.state, self.prompt)
        self.image.value = figure_png(fig)
        if self.prompt:
            size = self.state.cache.block_size or 0
            self.answer.value = (f"{len(self.prompt)} 个 token；服务器会命中前 {self.hit_blocks()} 块 = "
                                 f"{self.hit_blocks() * size} 个 token，不必重算 (would hit, not recomputed)")


@dataclass(frozen=True)
class SideBySide:
    """A kvlab run seen twice when it stopped: the blocks the router's view holds (from events alone) beside what
    the pool holds. ``registered`` of the pool's referenced blocks are full blocks with a hash (the events told
    of them); ``partial`` are running requests' blocks still filling, ``shared`` have two or more references:
    no event tells of either."""
    steps: int
    router_blocks: int
    held: int
    cached: int
    referenced: int
    registered: int
    partial: int
    shared: int
    batches: int
    missed: int

    @property
    def unregistered(self) -> int:
        """Full blocks of running requests not yet registered (kvlab's metadata engine registers the blocks a
        request decoded when it ends, as SGLang does): held, and no event told of them."""
        return self.referenced - self.registered - self.partial

    def __str__(self) -> str:
        return "\n".join([
            f"第 {self.steps} 步停下 (stopped at step)：路由器从 {self.batches} 批事件里知道 {self.router_blocks} 个块 "
            f"(blocks the router knows)；缺失的批 {self.missed} (missed)",
            f"池里占用 {self.held} 块 (blocks held) = 可复用缓存块 {self.cached} (cached) + 运行中的请求持有 "
            f"{self.referenced} (referenced)",
            f"  其中满块、已登记 {self.registered} (registered: in the events)；满块、请求结束时才登记 "
            f"{self.unregistered} (full, registered at the end)；正在填的部分块 {self.partial} (partial: never)",
            f"  被共享的块 {self.shared} 个 (refcount >= 2)：事件从不说引用计数 (the events never say)",
        ])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def watch_engine(engine: Any, *, steps: int | None = None, steps_per_second: float | None = None,
                       fps: float = 4.0, tokenize: Callable[[str], Sequence[int]] | None = None) -> SideBySide:
    """Run a paged kvlab ``engine`` (prefix caching on) for ``steps`` steps (None: to the end) while it publishes
    its KV events in vLLM's format on this machine; show, side by side, kvlab's own pool view of the run and the
    router's view built from the events alone; when it stops, count what each saw. For a notebook cell:
    ``seen = await watch_engine(engine, steps=40)``. Both views' last states are then shown as pictures too."""
    from IPython.display import display

    from kvlab.core.block import ALLOCATED
    from kvlab.kvevents.publisher import KVEventPublisher
    from kvlab.viz.static import plot_pool
    from kvlab.viz.views import PoolView

    if steps is not None:
        check_positive(steps, "steps")
    port, replay = _free_port(), _free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}")
    pool = engine.memory.pool
    with KVEventPublisher(engine, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}") as pub:
        router = RemoteCacheView(sub, tokenize=tokenize, fps=fps)
        pool_view = PoolView(pool)
        display(widgets.HBox([widgets.VBox([widgets.Label("kvlab 的池：所有状态 (kvlab's pool: everything)"),
                                            pool_view]),
                              widgets.VBox([widgets.Label("路由器只从事件看到的 (the router: events only)"),
                                            router])]))
        taken = 0

        def step() -> bool:
            nonlocal taken
            taken += 1
            return engine.step() and (steps is None or taken < steps)

        await pool_view.live(step, steps_per_second=steps_per_second)
        sub.catch_up()  # what the live stream missed (a first batch sent before the subscription landed)
        for _ in range(500):
            if sub.stats.batches >= pub.seq:
                break
            await asyncio.sleep(0.01)
        router.redraw()
    await sub.aclose()
    display(plot_pool(pool))  # the same two states as pictures, for readers without a live kernel
    display(plot_remote(router.state))
    snap = pool.snapshot()
    referenced = (snap["status"] == ALLOCATED) & (snap["refcount"] > 0)
    registered = set(engine.memory.cache.entries())
    seqs = engine.memory.manager.seqs.values()
    partial = {s.block_table[-1] for s in seqs if s.block_table and s.num_tokens % pool.spec.block_size}
    return SideBySide(taken, len(router.state.cache), int((snap["status"] != 0).sum()), int(snap["cached"].sum()),
                      int(referenced.sum()), len(registered & set(np.flatnonzero(referenced).tolist())),
                      len(partial), int((snap["refcount"] >= 2).sum()), router.state.batches, router.state.missed)


__all__ = ["BatchMark", "MAX_DRAWN", "NEVER_SEEN", "RemoteCacheView", "RemoteState", "SideBySide",
           "depth_counts", "icicle", "plot_remote", "watch_engine"]
