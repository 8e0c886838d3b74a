"""KV events from a busy server: decoding them, rebuilding the cache from them, and drawing the view, on one core.

* **decode**: ``kvlab.kvevents.decode_batch`` on payloads of ``BlockStored`` events of 16-token blocks (64-bit
  int hashes, each event's parent the block before), written by kvlab's ``encode_batch`` in vLLM 0.34.0's map
  encoding and, rewritten field by field as SGLang 0.5.10.post1 lays them out, in the positional-array encoding
  (vLLM up to 0.23.0, SGLang), as batches of 64 events of 1 block and of 1 event of 64 blocks; the floor is
  msgspec's untyped ``msgpack.Decoder().decode`` of the same bytes (plain lists and dicts, no event objects).
  Goal: >= 200,000 one-block ``BlockStored`` events/s.
* **model**: ``RemoteCache.apply`` on the same events, decoded, into a fresh cache each round; the floor stores
  each block's tokens under its hash in a dict (what any model of the cache must do).
* **view**: Python time (the thread's CPU time: the machine is shared) for one frame of ``RemoteCacheView``,
  ``plot_remote`` + ``figure_png``, on caches of 100, 1,000 and 4,000 blocks (``MAX_DRAWN``, drawn one by one) and
  50,000 (one bar per column), prompts of 20 blocks sharing a 4-block system prompt, 600 batches in the timeline;
  the baseline is the frame of an empty cache (matplotlib's fixed cost). Then the redraw rate: a
  ``RemoteCacheView`` fed as fast as the loop allows through its subscriber's callbacks (a ``Subscriber`` that
  never listens: closed as soon as the view starts it), one batch per loop turn, each storing a 16-block prompt
  and removing the one stored 100 batches before (about 1,600 blocks cached): redraws per second against the
  view's ``fps`` (goal: never above it), and the batches fed meanwhile; then the same with the drawing skipped
  (each redraw counted, nothing drawn), which shows the pacing alone.

Every timing is the best of its rounds with the garbage collector off; the variants of a row are timed in turn
within each round. ``python benchmarks/bench_kvevents.py [--quick]``.
"""
from __future__ import annotations

import asyncio
import gc
import random
import time
from typing import Any

import msgspec

from kvlab.app.bench import ns_per_item_together
from kvlab.kvevents import BlockRemoved, BlockStored, KVEventBatch, Received, RemoteCache, Subscriber
from kvlab.kvevents.wire import BlockHash, decode_batch, encode_batch
from kvlab.viz.remote import MAX_DRAWN, RemoteCacheView, RemoteState, plot_remote
from kvlab.viz.static import figure_png

B = 16  # tokens per block
GOAL = 200_000  # one-block BlockStored events decoded per second
SGLANG_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def random_hashes(rng: random.Random, n: int) -> list[BlockHash]:
    """``n`` hashes as vLLM sends them by default: 64-bit ints."""
    return [rng.getrandbits(64) for _ in range(n)]


def stored_events(n_events: int, blocks_each: int, seed: int = 0) -> list[BlockStored]:
    """``n_events`` chained ``BlockStored`` events of ``blocks_each`` blocks: random 64-bit hashes and tokens."""
    rng = random.Random(seed)
    events, parent = [], None
    for _ in range(n_events):
        hashes = random_hashes(rng, blocks_each)
        tokens = [rng.randrange(150_000) for _ in range(blocks_each * B)]
        events.append(BlockStored(hashes, parent, tokens, B, None, "GPU"))
        parent = hashes[-1]
    return events


def array_payload(batch: KVEventBatch) -> bytes:
    """``batch`` in the positional-array encoding, as SGLang sends it: kvlab's map bytes, each event rewritten as
    ``[type, field, ...]`` in declared order up to ``medium``."""
    ts, events, rank = msgspec.msgpack.decode(encode_batch(batch))
    return msgspec.msgpack.encode([ts, [[e["type"], *(e.get(f) for f in SGLANG_STORED)] for e in events], rank])


def payloads(shape: tuple[int, int], seed: int) -> dict[str, bytes]:
    batch = KVEventBatch(1.7e9, list(stored_events(*shape, seed=seed)), 0)
    return {"map": encode_batch(batch), "array": array_payload(batch)}


def decode_rows(rounds: int, reps: int) -> list[dict[str, Any]]:
    floor = msgspec.msgpack.Decoder()
    rows = []
    for n_events, blocks_each in ((64, 1), (1, 64)):
        for encoding, data in payloads((n_events, blocks_each), seed=n_events).items():
            assert decode_batch(data).events == stored_events(n_events, blocks_each, seed=n_events)
            ns = ns_per_item_together({"kvlab": lambda: decode_batch(data), "floor": lambda: floor.decode(data)},
                                      items=n_events, reps=reps, rounds=rounds)
            rate, base = 1e9 / ns["kvlab"], 1e9 / ns["floor"]
            met = "" if blocks_each > 1 else (" (met)" if rate >= GOAL else " (not met)")
            rows.append({"name": f"decode_batch, {encoding} encoding, {n_events} BlockStored x {blocks_each} "
                                 f"block{'s' * (blocks_each > 1)} of {B} tokens ({len(data):,} B)",
                         "value": round(rate), "unit": "events/s", "baseline": round(base),
                         "ratio": round(rate / base, 3),
                         "goal": f">= {GOAL:,} events/s{met}" if blocks_each == 1 else "-"})
    return rows


def dict_floor(events: list[BlockStored]) -> None:
    """The least a model of the cache does: each block's tokens under its hash."""
    d: dict[int | bytes, tuple[int, ...]] = {}
    for e in events:
        size = e.block_size
        for i, h in enumerate(e.block_hashes):
            d[h] = tuple(e.token_ids[i * size:(i + 1) * size])


def model_rows(rounds: int, n_batches: int) -> list[dict[str, Any]]:
    rows = []
    for n_events, blocks_each in ((64, 1), (1, 64)):
        events = [e for k in range(n_batches) for e in stored_events(n_events, blocks_each, seed=1000 + k)]
        ns = ns_per_item_together({"kvlab": lambda: RemoteCache().apply(events),
                                   "floor": lambda: dict_floor(events)}, 1, 1, rounds)
        s = {name: t / 1e9 for name, t in ns.items()}  # seconds a call
        rate, base = len(events) / s["kvlab"], len(events) / s["floor"]
        rows.append({"name": f"RemoteCache.apply, {len(events):,} BlockStored x {blocks_each} "
                             f"block{'s' * (blocks_each > 1)} into a fresh cache",
                     "value": round(rate), "unit": "events/s", "baseline": round(base),
                     "ratio": round(rate / base, 3), "goal": "-"})
    return rows


# ---------------------------------------------------------------- the view
def busy_state(n_blocks: int, prompt_blocks: int = 20, shared: int = 4, timeline: int = 600) -> RemoteState:
    """A ``RemoteState`` holding ``n_blocks`` blocks: prompts of ``prompt_blocks`` blocks on one ``shared``-block
    system prompt, one per batch, and ``timeline`` batches of marks."""
    rng = random.Random(n_blocks)
    state = RemoteState(keep=timeline)
    system = stored_events(1, min(shared, n_blocks), seed=-1)[0]
    state.apply(Received(0, KVEventBatch(0.0, [system])))
    left, seq = n_blocks - len(system.block_hashes), 1
    while left > 0:
        n = min(prompt_blocks - shared, left)
        hashes = random_hashes(rng, n)
        tokens = [rng.randrange(150_000) for _ in range(n * B)]
        state.apply(Received(seq, KVEventBatch(float(seq), [BlockStored(hashes, system.block_hashes[-1], tokens, B,
                                                                        None, "GPU")])))
        left, seq = left - n, seq + 1
    while seq < timeline:  # quiet steps fill the timeline
        state.apply(Received(seq, KVEventBatch(float(seq), [])))
        seq += 1
    assert len(state.cache) == n_blocks
    return state


def frame(state: RemoteState) -> bytes:
    return figure_png(plot_remote(state))


def frame_ms(state: RemoteState, rounds: int) -> float:
    """Best thread CPU milliseconds for one frame of ``state``."""
    best = float("inf")
    for _ in range(rounds):
        gc.disable()
        try:
            t = time.thread_time()
            frame(state)
            best = min(best, (time.thread_time() - t) * 1e3)
        finally:
            gc.enable()
    return best


def view_rows(sizes: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    empty = frame_ms(RemoteState(), rounds)
    rows = []
    for n in sizes:
        ms = frame_ms(busy_state(n), rounds)
        how = "each drawn" if n <= MAX_DRAWN else "bars per column"
        rows.append({"name": f"view: Python per frame, plot_remote + figure_png, {n:,} blocks ({how})",
                     "value": round(ms, 1), "unit": "ms", "baseline": round(empty, 1), "ratio": round(ms / empty, 2),
                     "goal": "<= 250 ms (fps 4)"})
    return rows


def feed_batches(n: int, prompt_blocks: int = 16, cached: int = 100) -> list[Received]:
    """``n`` batches to cycle through, batch ``k`` storing a fresh ``prompt_blocks``-block prompt (hashes
    ``k * prompt_blocks + i``) and removing the one stored ``cached`` batches before it (in the first cycle a
    hash never stored: counted, ignored), so that about ``cached`` prompts stay cached."""
    def hashes(k: int) -> list[BlockHash]:
        return list(range(k % n * prompt_blocks, (k % n + 1) * prompt_blocks))

    return [Received(k, KVEventBatch(float(k), [BlockStored(hashes(k), None, list(range(prompt_blocks * B)), B,
                                                            None, "GPU"), BlockRemoved(hashes(k - cached), "GPU")]))
            for k in range(n)]


async def redraw_rate(fps: float, seconds: float, batches: list[Received], draw: bool = True) -> dict[str, float]:
    """Feed ``batches`` (cycled) to a ``RemoteCacheView`` through its subscriber's callbacks for ``seconds``, one
    per loop turn; the redraws counted from the first batch until the last pending one has run. ``draw=False``
    counts the redraws without drawing: the pacing alone, with nothing slowing the loop."""
    sub = Subscriber("tcp://127.0.0.1:1")  # never receives: the view starts it, it is closed at once
    view = RemoteCacheView(sub, fps=fps)
    await sub.aclose()
    drawn, redraw = [0], view.redraw

    def counted() -> None:
        drawn[0] += 1
        if draw:
            redraw()

    view.redraw = counted  # type: ignore[method-assign]
    fed, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        r = batches[fed % len(batches)]
        for fn in list(sub.callbacks):
            fn(Received(fed, r.batch))
        fed += 1
        await asyncio.sleep(0)
    fed_s = time.perf_counter() - t0
    while view._pending is not None:  # the redraw the last batches asked for
        await asyncio.sleep(view.interval / 4)
    elapsed = time.perf_counter() - t0
    view.close()
    return {"fps": fps, "batches": fed, "batch_rate": fed / fed_s, "redraws": drawn[0], "elapsed": elapsed,
            "frames_per_s": drawn[0] / elapsed, "cached": len(view.state.cache)}


def rate_rows(seconds: float, n_batches: int, cached: int = 100) -> list[dict[str, Any]]:
    batches = feed_batches(n_batches, cached=cached)
    rows = []
    for draw in (True, False):
        for fps in (4.0, 30.0):
            got = asyncio.run(redraw_rate(fps, seconds, batches, draw))
            what = f"fps={fps:g}, {'drawn' if draw else 'drawing skipped'}, {got['cached']:,} blocks cached"
            met = "met" if got["redraws"] <= fps * got["elapsed"] + 1 else "not met"
            rows += [{"name": f"view: redraws/s while fed as fast as the loop allows, {what}",
                      "value": round(got["frames_per_s"], 2), "unit": "frames/s", "baseline": fps,
                      "ratio": round(got["frames_per_s"] / fps, 3), "goal": f"<= fps ({met})"},
                     {"name": f"view: batches/s fed meanwhile (ratio: batches per redraw), {what}",
                      "value": round(got["batch_rate"]), "unit": "batches/s", "baseline": round(got["frames_per_s"], 2),
                      "ratio": round(got["batches"] / max(1, got["redraws"])), "goal": "-"}]
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    if quick:
        return (decode_rows(rounds=2, reps=20) + model_rows(rounds=2, n_batches=4)
                + view_rows((100, MAX_DRAWN + 1), rounds=1) + rate_rows(seconds=0.2, n_batches=30, cached=10))
    return (decode_rows(rounds=9, reps=300) + model_rows(rounds=9, n_batches=200)
            + view_rows((100, 1000, MAX_DRAWN, 50_000), rounds=5) + rate_rows(seconds=5.0, n_batches=400))


if __name__ == "__main__":
    from kvlab.app.bench import run_script

    run_script(run)
