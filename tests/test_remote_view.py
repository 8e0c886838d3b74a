"""kvlab.viz.remote: the cache a router sees, drawn from KV events alone. The icicle's geometry against the tree
it draws (every block as tall as its leaves, children inside their parent), the outlined hit path against
RemoteCache.hit_blocks, restarts and holes in the stream, the Chinese-first still, and the live view following a
kvlab engine's published events: what it rebuilds is the engine's prefix cache, and a prompt's hits are the
engine's own."""
from __future__ import annotations

import asyncio
import random
import socket

import pytest
from matplotlib.patches import StepPatch
from matplotlib.text import Text

from kvlab import Engine, EngineConfig, make_workload
from kvlab.core.errors import ConfigError
from kvlab.kvevents import KVEventPublisher, RemoteCache, Subscriber
from kvlab.kvevents.publisher import external_hash
from kvlab.kvevents.subscriber import Received
from kvlab.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvlab.viz import remote as rv
from test_figures import english_first

B = 4


def random_stores(seed: int, n: int = 60) -> tuple[list[BlockStored], list[list[int]]]:
    """Prompts over a small alphabet (so prefixes repeat), each stored as vLLM stores a prompt's full blocks:
    one event per prompt, the blocks it did not share with earlier ones, parent-linked."""
    rng = random.Random(seed)
    seen: dict[tuple[int, ...], int] = {}  # a prefix of whole blocks -> its block's hash
    events, prompts = [], []
    for _ in range(n):
        prompt = [rng.randrange(3) for _ in range(B * rng.randint(1, 6))]
        prompts.append(prompt)
        new, tokens = [], []
        for at in range(0, len(prompt), B):
            key = tuple(prompt[:at + B])
            if key in seen:  # an earlier prompt stored this block: shared, not stored again
                continue
            seen[key] = len(seen) + 1
            new.append(seen[key])
            tokens += prompt[at:at + B]
        if new:
            first_parent = seen.get(tuple(prompt[:len(prompt) - len(tokens)])) if len(tokens) < len(prompt) else None
            events.append(BlockStored(block_hashes=new, parent_block_hash=first_parent, token_ids=tokens,
                                      block_size=B, medium="GPU"))
    return events, prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def received(seq: int, events: list, **kw) -> Received:
    return Received(seq, KVEventBatch(ts=float(seq), events=events), **kw)


@pytest.mark.parametrize("seed", range(4))
def test_every_block_is_as_tall_as_its_leaves_and_holds_its_children(seed):
    events, _ = random_stores(seed)
    cache = RemoteCache()
    cache.apply(events)
    blocks = cache.blocks[("GPU", None)]
    placed = {h: (d, y0, hgt) for h, d, y0, hgt in rv.icicle(blocks)}
    assert set(placed) == set(blocks)
    children: dict[int, list[int]] = {}
    for h, b in blocks.items():
        if b.parent is not None:
            children.setdefault(b.parent, []).append(h)
    leaves = [h for h in blocks if h not in children]
    for h, (depth, y0, height) in placed.items():
        assert depth == len(cache.chain(h, ("GPU", None))) - 1  # its place in the prompt
        under = [leaf for leaf in leaves if h in {b.block_hash for b in cache.chain(leaf, ("GPU", None))}]
        assert height == len(under)
        kids = sorted(placed[k][1:] for k in children.get(h, []))
        if kids:  # the children tile the parent's span exactly, in order, no overlap
            assert kids[0][0] == y0 and sum(k[1] for k in kids) == height
            assert all(a[0] + a[1] == b[0] for a, b in zip(kids, kids[1:]))
    roots = sorted(placed[h][1:] for h, b in blocks.items() if b.parent is None)
    assert roots[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(roots, roots[1:]))


@pytest.mark.parametrize("seed", range(4))
def test_the_columns_drawn_for_a_large_cache_count_the_icicles_blocks_by_depth(seed):
    """depth_counts (the still's bars past MAX_DRAWN blocks) against the icicle's own placement; a cycle of
    parents (a lying stream) is reachable from no root and is counted in neither."""
    events, _ = random_stores(seed)
    events.append(BlockStored(block_hashes=[10_001], parent_block_hash=10_002, token_ids=[1] * B, block_size=B,
                              medium="GPU"))
    events.append(BlockStored(block_hashes=[10_002], parent_block_hash=10_001, token_ids=[2] * B, block_size=B,
                              medium="GPU"))
    cache = RemoteCache()
    cache.apply(events)
    blocks = cache.blocks[("GPU", None)]
    depths = [d for _, d, _, _ in rv.icicle(blocks)]
    assert rv.depth_counts(blocks) == [depths.count(d) for d in range(max(depths) + 1)]
    assert sum(rv.depth_counts(blocks)) == len(blocks) - 2


@pytest.mark.parametrize("seed", range(4))
def test_the_hit_path_is_the_longest_stored_chain_that_spells_the_prompt(seed):
    """RemoteCache.hit_path (which the still outlines and hit_blocks counts) against a brute force over every
    block's chain from the root."""
    events, prompts = random_stores(seed)
    cache = RemoteCache()
    cache.apply(events)
    tier = ("GPU", None)
    chains = [cache.chain(h, tier) for h in cache.blocks[tier]]
    rooted = [c for c in chains if c[0].parent is None]  # a chain up to a parent never seen reaches no prompt
    rng = random.Random(seed)
    for prompt in prompts + [[rng.randrange(3) for _ in range(B * 5)] for _ in range(30)]:
        spelled = [c for c in rooted if [t for b in c for t in b.tokens] == prompt[:B * len(c)]]
        longest = max(spelled, key=len, default=[])
        path = cache.hit_path(prompt, tier=tier)
        assert path == [b.block_hash for b in longest]
        assert cache.hit_blocks(prompt) == len(path)
    assert RemoteCache().hit_path(prompts[0], tier=tier) == []  # no block size known yet
    assert cache.hit_path(prompts[0], tier=("CPU", None)) == []  # a tier that holds nothing


def test_a_restart_forgets_the_cache_and_holes_are_marked():
    events, prompts = random_stores(0, 10)
    state = rv.RemoteState(keep=3)
    state.apply(received(0, [AllBlocksCleared(), *events]))
    held = len(state.cache)
    assert held == sum(len(e.block_hashes) for e in events) and state.cache.hit_blocks(prompts[0]) > 0
    first = events[0].block_hashes[:1]
    state.apply(received(4, [BlockRemoved(block_hashes=first, medium="GPU")], missed=3))
    assert len(state.cache) == held - 1 and state.missed == 3
    state.apply(received(0, events[:1], restarted=True))
    assert len(state.cache) == len(events[0].block_hashes) and state.restarts == 1
    marks = list(state.timeline)
    assert [(m.stored, m.removed, m.missed, m.restarted) for m in marks] == [
        (held, 0, 0, False), (0, 1, 3, False), (len(events[0].block_hashes), 0, 0, True)]
    state.apply(received(1, []))
    assert len(state.timeline) == 3 and state.batches == 4  # bounded: the oldest mark goes


def test_the_still_outlines_the_hits_greys_orphans_and_reads_chinese_first(monkeypatch):
    events, prompts = random_stores(1)
    state = rv.RemoteState()
    state.apply(received(0, events))
    orphan = BlockStored(block_hashes=[999], parent_block_hash=12345, token_ids=[7] * B, block_size=B, medium="GPU")
    state.apply(received(1, [orphan], missed=2))
    prompt = max(prompts, key=state.cache.hit_blocks)
    fig = rv.plot_remote(state, prompt)
    (boxes,) = fig.axes[0].collections  # one box per block, in one collection
    assert len(boxes.get_paths()) == len(state.cache)
    assert sum(w > 2 for w in boxes.get_linewidths()) == state.cache.hit_blocks(prompt) > 0
    grey = [c for c in boxes.get_facecolors() if c[:3] == pytest.approx(rv.rgb01(rv.STATE_RGB["FREE"]))]
    assert len(grey) == 1  # the block whose parent never arrived
    assert f"命中前 {state.cache.hit_blocks(prompt)} 块" in fig.axes[0].get_title()
    (holes,) = fig.axes[-1].collections  # the dotted line before batch 1, the hole
    assert holes.get_linestyle()[0][1] is not None and len(holes.get_segments()) == 1
    stored, removed = (p for p in fig.axes[-1].patches if isinstance(p, StepPatch))
    assert list(stored.get_data().values) == [m.stored for m in state.timeline]
    rv.figure_png(fig)
    assert not [t.get_text() for t in fig.findobj(Text) if english_first(t.get_text())]
    monkeypatch.setattr(rv, "MAX_DRAWN", 5)  # a large cache: blocks per column, as many as it holds
    (column,) = [p for p in rv.plot_remote(state).axes[0].patches if isinstance(p, StepPatch)]
    assert column.get_data().values.sum() == len(state.cache)


def test_the_view_refuses_what_it_cannot_follow():
    with pytest.raises(ConfigError, match="Subscriber"):
        rv.RemoteCacheView("tcp://127.0.0.1:5557")  # type: ignore[arg-type]
    sub = Subscriber("tcp://127.0.0.1:5557")
    for bad in (0, -1, 31, True, "4"):
        with pytest.raises(ConfigError, match="fps"):
            rv.RemoteCacheView(sub, fps=bad)
    with pytest.raises(ConfigError, match="tokenize"):
        rv.RemoteCacheView(sub, tokenize="not a function")  # type: ignore[arg-type]
    assert not sub.running  # nothing was started by a refused view


def test_the_view_follows_a_kvlab_engine_and_its_hits_are_the_engines():
    """A kvlab engine publishes its prefix cache's events (vLLM's format); the view, fed only by them, holds the
    engine's cached blocks and finds, for every prompt, the hits the engine's own prefix cache finds."""
    port, replay = (free_port() for _ in range(2))
    w = make_workload("chat", 40, seed=0)
    engine = Engine(w, EngineConfig(num_blocks=256, block_size=16, prefix_caching=True))

    async def go() -> rv.RemoteCacheView:
        sub = Subscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
                         on_warning=lambda _: None)
        view = rv.RemoteCacheView(sub, fps=30)  # starts the subscriber on this loop
        with KVEventPublisher(engine, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}") as pub:
            await asyncio.sleep(0.2)  # the subscription reaches the publisher before the first batch
            while engine.step():
                await asyncio.sleep(0)
            sub.catch_up()  # what the live stream missed (the first batch may go before the subscription lands)
            for _ in range(500):
                if sub.stats.batches == pub.seq:
                    break
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the last redraw
        await sub.aclose()
        return view

    view = asyncio.run(asyncio.wait_for(go(), 60))
    cache = engine.memory.cache
    assert view.state.missed == 0 and view.state.batches > 2
    assert set(view.state.cache.blocks[("GPU", 0)]) == {external_hash(d) for d, _, _ in cache.entries().values()}
    hits = []
    for r in w.requests:
        prompt = engine.memory.prompt_ids(r)
        view.box.value = " ".join(map(str, prompt))  # typed as token ids
        hits.append(view.hit_blocks())
        assert hits[-1] == len(cache.peek(prompt, r.tenant))
        assert f"命中前 {hits[-1]} 块" in view.answer.value
    assert any(hits)
    assert view.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    view.box.value = "not token ids"
    assert view.prompt is None and "读不懂" in view.answer.value


def test_watch_engine_counts_what_each_side_saw():
    """A kvlab run stopped half way, seen by its pool and by the router's view: the router knows exactly the
    registered blocks (cached, and the running requests' registered full ones), fewer than the pool holds."""
    w = make_workload("chat", 30, seed=0)
    engine = Engine(w, EngineConfig(num_blocks=256, block_size=16, prefix_caching=True))
    seen = asyncio.run(asyncio.wait_for(rv.watch_engine(engine, steps=40), 60))
    pool = engine.memory.pool
    assert seen.steps == 40 and seen.missed == 0
    assert seen.held == pool.num_blocks - pool.num_free_blocks and seen.cached == pool.num_cached_blocks
    assert seen.router_blocks == seen.cached + seen.registered == len(engine.memory.cache.entries())
    assert seen.router_blocks < seen.held and seen.partial > 0
    assert seen.unregistered >= 0  # registered and partial blocks are among the referenced ones
    assert "路由器从" in str(seen) and "(refcount >= 2)" in str(seen)
    with pytest.raises(ConfigError, match="steps"):
        asyncio.run(rv.watch_engine(engine, steps=0))


def test_a_slow_picture_makes_the_next_one_wait_twice_its_time(monkeypatch):
    """A redraw that took longer than the fps allows makes the next wait twice as long: the loop keeps two thirds
    of its time for the stream and the notebook; a quick one leaves the fps interval as it is."""
    async def go() -> list[float]:
        sub = Subscriber("tcp://127.0.0.1:5557")
        view = rv.RemoteCacheView(sub, fps=4)
        sub.close()
        delays: list[float] = []
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "call_later", lambda delay, fn: delays.append(delay) or loop.call_soon(fn))
        clock = iter([0.0, 0.9, 1.0, 1.01])  # the first picture takes 0.9 s, the second 0.01 s
        monkeypatch.setattr(rv.time, "perf_counter", lambda: next(clock))
        monkeypatch.setattr(view, "redraw", lambda: None)
        for seq in range(2):
            view._on_batch(received(seq, []))
            await asyncio.sleep(0)
        view._on_batch(received(2, []))
        return delays

    assert asyncio.run(go()) == [0.25, 1.8, 0.25]
