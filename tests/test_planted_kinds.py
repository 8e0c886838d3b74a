"""Behaviours that no test used to pin down, found by planting bugs one at a time (a quota's boundary, waiting
for another tenant's prefill, the order swapped requests come back in, timestamps going back after the first row,
the blocks counted as sent across block sizes, a str that lies, a fork whose parent and child then differ). Each
test here fails on the bug named in its docstring."""
from __future__ import annotations

import pytest
import torch

from kvlab import BlockPool, KVSpec, TraceFormatError, load_trace
from kvlab import exercises as ex
from kvlab.core.events import EventRecorder
from kvlab.exercises.framework import PREDICTIONS
from kvlab.core.sequence import SequenceManager
from kvlab.serve.engine import Engine
from kvlab.serve.events import Admitted, Preempted, SwappedIn
from kvlab.workloads.mixes import Request


def _finishes(engine: Engine, steps: int = 2000) -> dict:
    """Run to the end, or fail (instead of looping for ever) after ``steps`` steps."""
    s = engine.run(max_steps=steps)
    assert engine.done, f"not done after {steps} steps: {s}"
    return s


# ---------------------------------------------------------------- the scheduler
@pytest.mark.parametrize("memory", ["paged", "contiguous"])
def test_a_request_needing_exactly_its_tenants_quota_runs(memory):
    """Bug: ``held + need >= quota`` instead of ``>`` in ``Engine._fits`` (the request never fits: run() loops
    for ever). One block more than the quota is refused when the engine is built."""
    B, quota = 4, 5
    fits = Request(0, 0.0, quota * B - 3, 3, tenant="a")  # exactly `quota` blocks when done
    cfg = dict(num_blocks=32, block_size=B, max_model_len=quota * B, quotas={"a": quota}, memory=memory)
    s = _finishes(Engine([fits], **cfg))
    assert s["finished"] == 1
    with pytest.raises(Exception, match="more blocks than their tenant may ever hold"):
        Engine([Request(1, 0.0, quota * B - 2, 3, tenant="a")], **{**cfg, "max_model_len": quota * B + 1})


def test_a_request_does_not_wait_for_another_tenants_prefill():
    """Bug: ``prefill_in_flight`` looking at running requests of every tenant. Another tenant's blocks are
    salted apart and can never be hit, so waiting for them only delays: both tenants' requests are admitted at
    once, while the same tenant's second request waits (and then hits)."""
    doc = tuple(range(100, 164))
    reqs = [Request(i, 0.0, 72, 2, tenant=t, prompt_tokens=doc + tuple(range(i * 8, i * 8 + 8)))
            for i, t in enumerate(["a", "b", "a"])]
    e = Engine(reqs, num_blocks=64, block_size=8, max_batched_tokens=512, shared_prefill="wait")
    rec = EventRecorder(e.events, (Admitted,))
    _finishes(e)
    admitted = {ev.request_id: (ev.engine_step, ev.cached_tokens) for ev in rec}
    assert admitted[0] == (0, 0) and admitted[1] == (0, 0)  # tenant b did not wait for tenant a
    assert admitted[2][0] > 0 and admitted[2][1] == 64  # tenant a's second request waited and hit


def test_swapped_requests_come_back_oldest_first():
    """Bug: swapping in the newest swapped request first (a LIFO). Preemption by swap sends requests out one by
    one under pressure; they come back in the order they went out."""
    reqs = [Request(i, 0.0, 12, 40) for i in range(6)]
    e = Engine(reqs, num_blocks=40, block_size=4, max_model_len=64, preemption="swap", max_batched_tokens=64)
    rec = EventRecorder(e.events, (Preempted, SwappedIn))
    _finishes(e)
    out = [ev.request_id for ev in rec if isinstance(ev, Preempted)]
    back = [ev.request_id for ev in rec if isinstance(ev, SwappedIn)]
    assert len(out) >= 2, "the workload must swap at least two requests out"
    waiting: list[int] = []  # each swap-in takes the oldest request still out
    for ev in rec:
        if isinstance(ev, Preempted):
            waiting.append(ev.request_id)
        else:
            assert ev.request_id == waiting.pop(0), (out, back)


# ---------------------------------------------------------------- traces
@pytest.mark.parametrize("stamps", [(0, 10, 5), (0, 10, 20, 15), (3, 3, 2)])
def test_timestamps_going_back_after_the_first_row_are_refused(tmp_path, stamps):
    """Bug: comparing each timestamp with the first row's instead of the row before (10 then 5 passes, since
    5 > 0). Arrivals must not go backwards anywhere; the error names the row that went back."""
    rows = "".join(f'{{"timestamp": {t}, "input_length": 4, "output_length": 1, "hash_ids": [{i}]}}\n'
                   for i, t in enumerate(stamps))
    (tmp_path / "m.jsonl").write_text(rows)
    bad = next(i for i in range(1, len(stamps)) if stamps[i] < stamps[i - 1]) + 1
    with pytest.raises(TraceFormatError, match=f"line {bad}: .*earlier than the record before"):
        load_trace(tmp_path / "m.jsonl", "mooncake")
    azure = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{t:02d}.0000000,4,1\n" for t in stamps)
    (tmp_path / "a.csv").write_text(azure)
    with pytest.raises(TraceFormatError, match=f"line {bad + 1}: .*earlier than the row before"):
        load_trace(tmp_path / "a.csv", "azure")


# ---------------------------------------------------------------- exercises
class LyingStr(str):
    """A str that claims to equal anything (and hashes like the right answer would)."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = str.__hash__


def test_a_str_subclass_that_lies_is_judged_by_its_text():
    """Bug: comparing the answer object itself (its own ``__eq__``) instead of its text. Every choice
    prediction refuses a lying str that is no choice, and one that spells a choice counts as that choice."""
    ex.reset()
    keys = [k for k in ex.list_predictions() if PREDICTIONS[k].choices]
    assert keys
    for key in keys:
        with pytest.raises(Exception, match="not one of the choices"):
            ex.predict(key, LyingStr("certainly no choice"))
        first = PREDICTIONS[key].choices[0]
        if isinstance(first, str):
            ex.predict(key, LyingStr(first))
            assert not ex.reveal(key, PREDICTIONS[key].choices[1]).ok  # it predicted `first`, nothing else
    ex.reset()


# ---------------------------------------------------------------- sequences
def test_a_fork_whose_parent_and_child_append_different_tokens_keeps_both():
    """Bug: the child appending into the shared, partly filled tail block without copying it first (or the copy
    landing in the parent). After a fork at 6 tokens (block size 4: the tail holds 2), the parent and the child
    each append their own tokens; each reads back exactly its own K/V, and the 4 shared tokens stay shared."""
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, device="cpu")
    pool = BlockPool(16, spec=spec)
    mgr = SequenceManager(pool)

    def write(seq, tokens):
        slots = seq.append(tokens)
        kv = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, 1, 2).contiguous()
        pool.storage.write_slots(0, slots, kv, -kv)

    def read(seq):
        slots = mgr.slot_mapping([seq], [0], [seq.num_tokens])
        k, v = pool.storage.read_slots(0, slots)
        return k[:, 0, 0].tolist(), seq.token_ids

    parent = mgr.create([])
    write(parent, [1, 2, 3, 4, 5, 6])
    child = mgr.fork(parent)
    write(parent, [7, 8])
    write(child, [70, 80, 90])
    assert read(parent) == ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8])
    assert read(child) == ([1, 2, 3, 4, 5, 6, 70, 80, 90], [1, 2, 3, 4, 5, 6, 70, 80, 90])
    assert parent.block_table[0] == child.block_table[0] and parent.block_table[1] != child.block_table[1]
    mgr.check_invariants()


# ---------------------------------------------------------------- the KV connector's accounting
@pytest.mark.parametrize("decode_block_size, received, skipped", [(8, 27 + 12, 15), (32, 9 + 6, 3), (16, 15 + 9, 6)])
def test_blocks_counted_across_block_sizes(decode_block_size, received, skipped):
    """Bug: counting the blocks sent by the tokens moved (``(n - start) // B``) or in the receiver's block size.
    Two batches of three 70-token prompts sharing 40 tokens; the sender's blocks are of 16 tokens, the
    receiver's of ``decode_block_size``. The second batch finds its shared prefix cached on the receiver (whole
    receiver blocks: 40, 32 or 32 tokens), so each rank counts, in its own blocks: a request's blocks
    (ceil(70 / B)) less the blocks before its start."""
    from kvlab.distributed import demo_batches, run_disagg

    batches = demo_batches(3, 70, 40)
    res = run_disagg(batches, 2, decode_block_size=decode_block_size, threads=True, timeout=20)
    start = 40 // decode_block_size * decode_block_size  # the second batch's first token to send
    assert res.sent.blocks_sent == 3 * 5 + 3 * (5 - start // 16)
    assert res.received.blocks_received == received and res.received.blocks_skipped == skipped
    assert res.sent.requests == res.received.requests == 6
