"""The KV cache across ranks: disaggregated prefill/decode and tensor-parallel KV on torch.distributed (gloo,
127.0.0.1). Each test is one 2-process group (``spawn``) or two ranks as threads of this process (``run_threads``,
each with its own gloo group over loopback), every wait bounded by the link's timeout."""
from __future__ import annotations

import argparse
import json
import os
import time

import pytest
import torch

from _util import assert_same_state, pool_state
from kvlab import BlockStatus, EventRecorder, OutOfBlocksError, TinyConfig, TinyLlama
from kvlab.distributed import (BlocksReceived, BlocksSent, BlocksSkipped, KVReceiver, KVSender, RemoteRequest,
                               SpecMismatchError, TransferError, TransferTimeoutError, decode_rank, demo_batches,
                               prefill_rank, reference, run_disagg, run_threads, spawn)
from kvlab.distributed import backend_for
from kvlab.distributed.connector import MAX_RUNS, TAG_ANNOUNCE, TAG_PLAN, runs
from kvlab.distributed.disagg import configure, main as disagg_main, make_manager
from kvlab.distributed.exercises import transfer_bytes
from kvlab.distributed.tp import TPShard, generate as tp_generate, head_split, run_tp, single_process
import kvlab.distributed as kd
from kvlab.core.errors import ConfigError

CFG = TinyConfig()
BATCHES = demo_batches(3, 70, 40)  # two batches; 40 shared tokens = 2 full blocks of 16 cached on the decode rank


def _pending(manager) -> int:
    return int((manager.pool.arrays.status == int(BlockStatus.PENDING)).sum())


def test_two_processes_decode_what_one_process_decodes():
    res = run_disagg(BATCHES, 5, timeout=20)
    check = res.compare(reference(BATCHES, 5))
    assert check["tokens_equal"] and check["max_logit_diff"] <= 1e-4
    # batch 2 finds the shared prefix (2 blocks per prompt) in the decode rank's cache and does not receive it
    assert res.received.blocks_skipped == 3 * 2 and res.received.tokens_skipped == 3 * 32
    assert res.sent.blocks_sent == res.received.blocks_received == 3 * 5 + 3 * 3
    assert res.sent.bytes == res.received.bytes == res.sent.blocks_sent * CFG.kv_spec(16).bytes_per_block
    # per step, layer and half (K, V) one message per run of consecutive blocks, not per block. Here the runs
    # are broken: requests 1 and 2 computed the shared prefix beside request 0 and then took request 0's
    # registered blocks for it, on both ranks (so those rows repeat, and the copies they gave back are reused)
    per_half = 2 * CFG.num_layers
    assert res.sent.messages == res.received.messages and res.received.messages % per_half == 0
    assert res.received.messages < per_half * res.received.blocks_received
    # nothing shared, one batch on fresh pools: each request's blocks follow the last's, one run, one message
    one = run_disagg(demo_batches(3, 70, 0)[:1], 5, timeout=20)
    assert one.sent.messages == one.received.messages == per_half < one.sent.blocks_sent == 15


@pytest.mark.parametrize("interleaved,decode_block_size,fragmented",
                         [(False, 16, False), (True, 16, False), (True, 8, False), (False, 16, True), (True, 16, True)])
def test_every_token_arrives_bitwise(interleaved, decode_block_size, fragmented):
    """Rows sent straight from the pool in runs or gathered from scattered blocks (more than MAX_RUNS runs),
    received in place or, into a fragmented pool, through staging, and re-chunked token rows: all land where
    the receiver's block tables say."""
    prompts = [[(7 * i + j) % CFG.vocab_size for j in range(37 + 5 * i)] for i in range(12)]
    a, b = make_manager(CFG, 16, 256), make_manager(CFG, decode_block_size, 256)
    held = b.pool.allocate(256) if fragmented else []
    if fragmented:  # every other block free: the receiver's blocks come out one id apart
        b.pool.free(held[::2])
    seqs = [a.create(p) for p in prompts]
    if interleaved:  # block by block, request after request: each prompt's blocks lie far apart
        for at in range(0, max(map(len, prompts)), 16):
            a.append_tokens([s for s, p in zip(seqs, prompts) if len(p) > at],
                            [p[at:at + 16] for p in prompts if len(p) > at])
    else:
        a.append_tokens(seqs, prompts)
    a.pool.storage_of().kv.normal_()
    got = {}

    def send(link):
        conn = KVSender(link, a, 1)
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            conn.request_finished(RemoteRequest(i, tuple(p), 0), s)
        conn.start_save(conn.build_connector_meta())
        for layer in range(CFG.num_layers):
            conn.save_kv_layer(layer)
        conn.wait_for_save()
        got["runs"] = len(runs([r for s in seqs for r in s.block_table]))
        conn.finish()

    def receive(link):
        conn = KVReceiver(link, b, 0)
        for r in conn.poll_requests():
            q = b.create(list(r.prompt))
            b.append_tokens([q], [list(r.prompt)])
            conn.update_state_after_alloc(r, q)
            got.setdefault("seqs", []).append(q)
        conn.start_load_kv(conn.build_connector_meta())
        for layer in range(CFG.num_layers):
            conn.wait_for_layer_load(layer)
        assert conn.poll_requests() is None

    run_threads([send, receive], timeout=20)
    assert (got["runs"] > MAX_RUNS) == interleaved
    assert (len(runs([r for q in got["seqs"] for r in q.block_table])) > MAX_RUNS) == fragmented
    sa, sb = a.pool.storage_of(), b.pool.storage_of()
    for s, q in zip(seqs, got["seqs"]):
        for layer in range(CFG.num_layers):
            ka, va = sa.read_slots(layer, s.slots())
            kb, vb = sb.read_slots(layer, q.slots())
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    b.pool.free(held[1::2])
    b.check_invariants()


@pytest.mark.parametrize("decode_block_size", [8, 32])
def test_other_block_size_on_the_decode_rank_is_rechunked(decode_block_size):
    res = run_disagg(BATCHES, 4, decode_block_size=decode_block_size, threads=True, timeout=20)
    check = res.compare(reference(BATCHES, 4))
    assert check["tokens_equal"] and check["max_logit_diff"] <= 1e-4
    assert res.received.rechunked and res.sent.rechunked
    assert res.received.tokens_skipped == 3 * (40 // decode_block_size * decode_block_size)
    assert res.sent.tokens_moved == res.received.tokens_moved == 2 * 3 * 70 - res.received.tokens_skipped


def test_events_name_every_block_sent_received_and_skipped():
    managers = (make_manager(CFG, 16, 128), make_manager(CFG, 16, 128))
    recs = [EventRecorder(m.pool.events, (BlocksSent, BlocksReceived, BlocksSkipped)) for m in managers]
    res = run_disagg(BATCHES, 3, threads=True, managers=managers, timeout=20)
    sent, received = recs[0].of(BlocksSent), recs[1].of(BlocksReceived)
    skipped = recs[1].of(BlocksSkipped)
    assert len(sent) == len(received) == 6 * CFG.num_layers  # per request and layer
    assert sum(len(e.block_ids) for e in sent) == res.sent.blocks_sent * CFG.num_layers
    assert sum(len(e.block_ids) for e in received) == res.received.blocks_received * CFG.num_layers
    assert sum(e.nbytes for e in received) == res.received.bytes
    assert [e.request_id for e in skipped] == [3, 4, 5] and all(e.tokens == 32 for e in skipped)
    # the skipped blocks are the ones the decode rank received for the first batch: its own cached prefix
    first = {b for e in received if e.request_id == 0 for b in e.block_ids[:2]}
    assert all(set(e.block_ids) == first for e in skipped)
    for m in managers:
        m.check_invariants()
        assert len(m) == 0 and _pending(m) == 0


def test_mismatched_specs_are_refused_on_both_ranks_before_anything_moves():
    a, b = make_manager(CFG, 16, 64), make_manager(TinyConfig(num_layers=3), 16, 64)
    got = {}

    def rank(link, manager, cls):
        try:
            cls(link, manager, 1 - link.rank)
        except SpecMismatchError as e:
            got[link.rank] = str(e)

    run_threads([rank, rank], [{"manager": a, "cls": KVSender}, {"manager": b, "cls": KVReceiver}], timeout=10)
    assert set(got) == {0, 1} and all("layers" in m for m in got.values())
    for m in (a, b):
        assert m.pool.num_free_blocks == m.pool.num_blocks and m.pool.clock.now() == 0


def _survivor(link, **kw):
    """The decode rank, reporting how it failed and what its pool looks like afterwards."""
    manager = make_manager(CFG, 16, 128)
    t0 = time.monotonic()
    try:
        decode_rank(link, manager=manager, **kw)
        error = None
    except TransferError as e:
        error = type(e).__name__
    manager.check_invariants()
    return {"error": error, "seconds": time.monotonic() - t0, "pending": _pending(manager), "live": len(manager),
            "free": manager.pool.num_free_blocks, "cached": manager.pool.num_cached_blocks}


def _dies_after_one_layer(link, batches):
    """A prefill rank whose process exits after sending layer 0 of its first batch."""
    manager = make_manager(CFG, 16, 128)
    conn = KVSender(link, manager, 1)
    from kvlab import TinyLlama
    model = TinyLlama(CFG)
    seqs = [manager.create(p) for p in batches[0]]
    out = model.step(manager, seqs, [list(p) for p in batches[0]])
    for i, (s, p) in enumerate(zip(seqs, batches[0])):
        conn.request_finished(RemoteRequest(i, tuple(p), int(out[i].argmax())), s)
    conn.start_save(conn.build_connector_meta())
    conn.save_kv_layer(0)  # layer 0 is in flight; layer 1 never comes
    os._exit(3)


def _survivor_to_file(link, path, **kw):
    with open(path, "w") as f:
        json.dump(_survivor(link, **kw), f)


def test_a_peer_exiting_mid_transfer_is_a_typed_error_and_the_pool_stays_consistent(tmp_path):
    out = tmp_path / "survivor.json"
    with pytest.raises(TransferError, match="exited with codes \\[3\\]"):
        spawn([_dies_after_one_layer, _survivor_to_file], [{"batches": BATCHES},
                                                           {"path": str(out), "max_new_tokens": 3}], timeout=15)
    got = json.loads(out.read_text())
    assert got["error"] == "PeerLostError"
    assert got["pending"] == 0 and got["live"] == 0 and got["free"] == 128 and got["cached"] == 0


def test_the_surviving_rank_frees_what_the_dead_peer_was_sending():
    got = {}

    def dying(link, batches):  # as _dies_after_one_layer, but a thread cannot exit the process: it returns
        manager = make_manager(CFG, 16, 128)
        conn = KVSender(link, manager, 1)
        from kvlab import TinyLlama
        seqs = [manager.create(p) for p in batches[0]]
        out = TinyLlama(CFG).step(manager, seqs, [list(p) for p in batches[0]])
        for i, (s, p) in enumerate(zip(seqs, batches[0])):
            conn.request_finished(RemoteRequest(i, tuple(p), int(out[i].argmax())), s)
        conn.start_save(conn.build_connector_meta())
        conn.save_kv_layer(0)
        conn.wait_for_save()

    def survivor(link):
        got.update(_survivor(link, max_new_tokens=3))

    run_threads([dying, survivor], [{"batches": BATCHES}, {}], timeout=10)
    assert got["error"] == "PeerLostError"
    assert got["pending"] == 0 and got["live"] == 0 and got["free"] == 128 and got["cached"] == 0


def test_a_silent_peer_is_a_timeout_and_the_pool_stays_consistent():
    got = {}

    def silent(link, batches):
        manager = make_manager(CFG, 16, 128)
        conn = KVSender(link, manager, 1)
        link.send_json([[0, list(batches[0][0]), 1, None]], 1, TAG_ANNOUNCE)  # one request, then nothing
        link.recv_json(1, TAG_PLAN)
        time.sleep(3.5)
        del conn

    def survivor(link):
        got.update(_survivor(link, max_new_tokens=3))

    run_threads([silent, survivor], [{"batches": BATCHES}, {}], timeout=1.5)
    assert got["error"] == "TransferTimeoutError"
    assert got["pending"] == 0 and got["live"] == 0 and got["free"] == 128


def test_an_aborted_link_takes_no_late_message():
    got = {}

    def late(link):
        time.sleep(2.0)
        try:
            link.send(torch.ones(64), 1, 99)
        except TransferError as e:
            got["send"] = type(e).__name__

    def waits(link):
        buf = torch.zeros(64)
        work = link.irecv(buf, 0, 99)
        try:
            link.wait(work, "a message that comes too late")
        except TransferTimeoutError:
            got["wait"] = "timeout"
        link.abort()
        time.sleep(2.0)  # the late send has come and gone
        got["untouched"] = bool((buf == 0).all())

    run_threads([late, waits], timeout=1.0)  # waits gives up at ~1 s and aborts; the late send comes at ~2 s
    assert got == {"wait": "timeout", "send": "PeerLostError", "untouched": True}


def test_the_sender_frees_its_blocks_when_the_receiver_goes_away():
    got = {}

    def sender(link):
        manager = make_manager(CFG, 16, 128)
        try:
            prefill_rank(link, BATCHES, manager=manager)
        except TransferError as e:
            got["error"] = type(e).__name__
        manager.check_invariants()
        got["live"], got["pending"] = len(manager), _pending(manager)

    def leaves(link):
        KVReceiver(link, make_manager(CFG, 16, 128), 0).poll_requests()

    run_threads([sender, leaves], timeout=10)
    assert got["error"] in ("PeerLostError", "TransferTimeoutError") and got["live"] == 0 and got["pending"] == 0


def test_bad_input_is_refused_with_typed_errors():
    with pytest.raises(ConfigError, match="batch 0, prompt 1"):
        run_disagg([[[1, 2], [1, 500]]], threads=True)
    with pytest.raises(ConfigError, match="non-empty list of batches"):
        run_disagg([], threads=True)
    with pytest.raises(ConfigError, match="shared prefix 9"):
        demo_batches(2, 9, 9)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        run_threads([decode_rank], [{"max_new_tokens": 0}], timeout=5)


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=-1), "max_new_tokens must be a positive int, got -1"),
    (dict(max_new_tokens=None), "max_new_tokens .*got None"), (dict(decode_block_size=-1), "decode_block_size .*-1"),
    (dict(decode_block_size=0), "decode_block_size .*got 0"), (dict(num_blocks=1.5), "num_blocks .*got 1.5"),
    (dict(pace=-1), "pace .*got -1"), (dict(pace=float("nan")), "pace .*got nan"), (dict(cfg="x"), "cfg .*got 'x'"),
    (dict(managers=(None, None)), "SequenceManager, got None"),
    (dict(managers=(make_manager(CFG, 16, 8), make_manager(TinyConfig(num_layers=3), 16, 8))), "3 layers")])
def test_run_disagg_refuses_bad_arguments_before_any_rank_starts(kw, match):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=match):
        run_disagg(demo_batches(1, 8, 4), **{"threads": True, "timeout": 15, **kw})
    assert time.monotonic() - t0 < 5  # no rank waited on a peer that refused


def test_the_disagg_command_refuses_a_bad_decode_block_size():
    parser = argparse.ArgumentParser()
    configure(parser)
    with pytest.raises(ConfigError, match="--decode-block-size must be a positive integer, got -1"):
        disagg_main(parser.parse_args(["--decode-block-size", "-1"]))


@pytest.mark.parametrize("call,match", [
    (lambda: backend_for(None), "None is not a torch device"), (lambda: backend_for("nope"), "'nope' is not"),
    (lambda: kd.spec_vector(None), "KVSpec, got None"), (lambda: make_manager(None, 16, 8), "TinyConfig, got None"),
    (lambda: demo_batches(shared=1.5), "shared .*got 1.5"), (lambda: demo_batches(vocab=0), "vocab .*got 0"),
    (lambda: demo_batches(seed="x"), "seed .*got 'x'"), (lambda: demo_batches(prompts=0), "prompts .*got 0"),
    (lambda: demo_batches(prompts=-1), "prompts .*got -1"), (lambda: demo_batches(prompt_len=True), "got True"),
    (lambda: kd.prefill_seconds(64, chunk=0), "chunk .*got 0"), (lambda: kd.prefill_seconds(64, chunk=-1), "got -1"),
    (lambda: kd.prefill_seconds(True), "prompt_len .*got True"), (lambda: transfer_bytes("8", 0), "got '8'"),
    (lambda: kd.prefill_seconds(64, model=CFG), "model must be a kvlab Llama"),
    (lambda: kd.prefill_seconds(64, CFG, model=TinyLlama(CFG)), "a model or a cfg, not both"),
    (lambda: head_split(CFG, 2, True), "rank .*got True"), (lambda: head_split(None, 2, 0), "LlamaConfig, got None"),
    (lambda: kd.TransferCase(block_size=0), "block_size .*got 0"),
    (lambda: kd.TransferCase(dtype="nope"), "got 'nope'"), (lambda: kd.TransferCase(tokens=1.5), "got 1.5"),
    (lambda: kd.measure_transfers([None]), "TransferCase, got \\[None\\]"),
    (lambda: reference(BATCHES, 0), "max_new_tokens .*got 0"), (lambda: kd.TPShard(None, 2, 0), "got None"),
    (lambda: run_tp([[1, 500]], 2), "token 1 is 500"), (lambda: run_tp(PROMPTS, -1), "max_new_tokens .*got -1")])
def test_public_helpers_refuse_bad_arguments(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


# ---------------------------------------------------------------------------------------------- tensor parallel
PROMPTS = demo_batches(3, 40, 20)[0]


def _same_as_one_process(results, ref):
    for r in results:
        assert r["tokens"] == ref["tokens"]
        assert float((torch.tensor(r["logits"]) - torch.tensor(ref["logits"])).abs().max()) <= 1e-4


def test_tensor_parallel_processes_equal_one_process():
    res = run_tp(PROMPTS, 4, tp=2, timeout=20)
    ref = single_process(PROMPTS, 4)
    _same_as_one_process(res, ref)
    assert [r["kv_heads"] for r in res] == [[0], [1]]
    assert all(r["bytes_per_block"] * 2 == ref["bytes_per_block"] for r in res)  # a block is 1/tp as large


@pytest.mark.parametrize("heads,kv,tp,held", [(4, 1, 2, [[0], [0]]), (8, 2, 4, [[0], [0], [1], [1]])])
def test_tp_above_the_kv_heads_replicates_them(heads, kv, tp, held):
    cfg = TinyConfig(num_heads=heads, num_kv_heads=kv)
    res = run_tp(PROMPTS, 3, tp=tp, cfg=cfg, threads=True, timeout=20)
    _same_as_one_process(res, single_process(PROMPTS, 3, cfg=cfg))
    assert [r["kv_heads"] for r in res] == held


@pytest.mark.parametrize("tp,match", [(3, "does not divide the 4 query heads"), (0, "positive int"),
                                      (True, "positive int")])
def test_tp_that_does_not_fit_is_refused_before_any_rank_starts(tp, match):
    with pytest.raises(ConfigError, match=match):
        run_tp(PROMPTS, 2, tp=tp)


def test_a_shard_refuses_a_pool_of_all_heads_before_anything_changes():
    model = TinyLlama(CFG)
    manager = make_manager(CFG, 4, 8)
    s = manager.create()
    before = pool_state(manager.pool)
    with pytest.raises(ConfigError, match="2 kv heads .* the model needs 2 layers x 1 kv heads"):
        TPShard(model, 2, 0).step(None, manager, [s], [[1, 2, 3]])
    assert s.num_tokens == 0 and s.block_table == []
    assert_same_state(before, pool_state(manager.pool))


def test_tp_generate_refuses_bad_input_before_creating_any_sequence():
    model = TinyLlama(CFG)
    manager = make_manager(CFG, 4, 8)
    before = pool_state(manager.pool)
    for prompts, n, match in (([[1, 2]], None, "got None"), ([[1, 2], [1.0]], 1, "prompt 1: token 0 is 1.0")):
        with pytest.raises(ConfigError, match=match):
            tp_generate(model.step, manager, prompts, n)
    assert len(manager) == 0
    assert_same_state(before, pool_state(manager.pool))


def test_replication_needs_tp_a_multiple_of_the_kv_heads():
    with pytest.raises(ConfigError, match="multiple of 4"):
        head_split(TinyConfig(num_heads=12, dim=96, num_kv_heads=4), 6, 0)
    with pytest.raises(ConfigError, match="does not divide the 4 kv heads"):
        head_split(TinyConfig(num_heads=12, dim=96, num_kv_heads=4), 3, 0)


def test_the_backend_follows_the_device():
    assert backend_for("cuda:0") == "nccl" and backend_for("cpu") == "gloo"


# ---------------------------------------------------------------------------------------------- measuring, exercises
def test_the_measurement_moves_the_same_bytes_as_the_plain_send():
    small = dict(num_layers=2, num_kv_heads=2, head_dim=16)
    runs_, scattered = kd.measure_transfers([kd.TransferCase(16, 100, 3, **small),
                                             kd.TransferCase(16, 100, 3, scattered=True, **small)],
                                            rounds=1, threads=True, timeout=20)
    for t in (runs_, scattered):
        assert t.blocks == 3 * 7 and t.bytes == 3 * 7 * CFG.kv_spec(16).bytes_per_block
        assert t.connector > 0 and t.plain > 0
    with pytest.raises(ConfigError, match="unknown layout fields \\['heads'\\]"):
        kd.measure_transfer(16, 100, heads=2)
    with pytest.raises(ConfigError, match="dtype must name a torch dtype"):
        kd.measure_transfer(16, 100, dtype="float99")
    with pytest.raises(ConfigError, match="prompt_len"):
        kd.prefill_seconds(0)


def test_prefill_seconds_runs_the_model_it_is_given(monkeypatch):
    model, seen = TinyLlama(TinyConfig(num_layers=1)), []
    step = model.step
    monkeypatch.setattr(model, "step", lambda m, seqs, new: seen.append([len(t) for t in new]) or step(m, seqs, new))
    assert kd.prefill_seconds(100, model=model, chunk=40, rounds=2) > 0
    assert seen == [[64], [40], [40], [20], [40], [40], [20]]  # the warm-up, then two rounds of 40-token chunks


def test_the_chapter_exercises_judge_by_running_kvlab():
    from kvlab import exercises as ex
    ex.reset()
    assert ex.check("2.2.7-bytes", 5 * CFG.kv_spec(16).bytes_per_block)
    assert not ex.check("2.2.7-bytes", 13 * CFG.kv_spec(16).bytes_per_block)
    half = CFG.kv_spec(16).bytes_per_block // 2
    assert ex.check("2.2.7-tp-block", (half, half))
    assert not ex.check("2.2.7-tp-block", (half, half // 2))
    assert {"2.2.7-skipped", "2.2.7-long-prompt"} <= set(ex.list_predictions("2.2.7"))
    ex.reset()


def test_a_decode_rank_out_of_blocks_gives_back_what_it_took():
    got = {}
    small = make_manager(CFG, 16, 8)  # 3 prompts of 70 tokens need 15 blocks

    def decode(link):
        try:
            decode_rank(link, manager=small)
        except OutOfBlocksError as e:
            got["decode"] = str(e)

    def prefill(link):
        try:
            prefill_rank(link, BATCHES)
        except TransferError as e:
            got["prefill"] = type(e).__name__

    run_threads([prefill, decode], timeout=10)
    assert "asked for" in got["decode"] and got["prefill"] in ("PeerLostError", "TransferTimeoutError")
    small.check_invariants()
    assert len(small) == 0 and small.pool.num_free_blocks == 8


def _cache_prompt(manager, prompt) -> None:
    """Put ``prompt``'s full blocks into ``manager``'s prefix cache (computed once, then freed: cached)."""
    seq = manager.create(list(prompt))
    manager.append_tokens([seq], [list(prompt)])
    manager.cache_full_blocks(seq)
    manager.free(seq)


def test_a_fully_cached_prompt_still_receives_its_last_block():
    """``get_num_new_matched_tokens`` leaves at least one prompt token to compute, as a local prefix hit does
    (the next token's logits need it): a 32-token prompt whose 2 blocks of 16 are all cached takes only 1 block
    from the cache and receives 16 tokens, never 0. A 33-token prompt receives its 1 uncached token; 40 tokens
    over a cached 32-token prefix receive 8; a prompt nothing matches receives everything."""
    b = make_manager(CFG, 16, 64)
    cached = [(3 * j) % CFG.vocab_size for j in range(40)]
    _cache_prompt(b, cached[:32])
    _cache_prompt(b, cached[:33])
    got = {}

    def send(link):
        KVSender(link, make_manager(CFG, 16, 8), 1).finish()

    def receive(link):
        conn = KVReceiver(link, b, 0)
        for n in (32, 33, 40):
            got[n] = conn.get_num_new_matched_tokens(RemoteRequest(n, tuple(cached[:n]), 0))
            seq = b.create(cached[:n])  # the local hit the scheduler will take
            got[n, "local"] = n - seq.num_tokens
            b.free(seq)
        got["other"] = conn.get_num_new_matched_tokens(RemoteRequest(9, tuple([5] * 32), 0))
        assert conn.poll_requests() is None

    run_threads([send, receive], timeout=20)
    assert got == {32: 16, (32, "local"): 16, 33: 1, (33, "local"): 1, 40: 8, (40, "local"): 8, "other": 32}
    b.check_invariants()


def test_both_reports_count_requests_not_steps():
    """A step of 4 requests then a step of 2: the sender's and the receiver's reports both read 6 requests (and
    agree on blocks and tokens moved), whatever the number of steps."""
    a, b = make_manager(CFG, 16, 64), make_manager(CFG, 16, 64)
    batches = [[[(5 * i + j) % CFG.vocab_size for j in range(20 + i)] for i in range(4)],
               [[(11 * i + j) % CFG.vocab_size for j in range(17)] for i in range(2)]]
    reports = {}

    def send(link):
        conn = KVSender(link, a, 1)
        rid = 0
        for batch in batches:
            seqs = [a.create(p) for p in batch]
            a.append_tokens(seqs, batch)
            for s, p in zip(seqs, batch):
                conn.request_finished(RemoteRequest(rid, tuple(p), 0), s)
                rid += 1
            conn.start_save(conn.build_connector_meta())
            for layer in range(CFG.num_layers):
                conn.save_kv_layer(layer)
            conn.wait_for_save()
            for s in seqs:
                a.free(s)
        conn.finish()
        reports["sender"] = conn.report

    def receive(link):
        conn = KVReceiver(link, b, 0)
        while (requests := conn.poll_requests()) is not None:
            seqs = []
            for r in requests:
                q = b.create(list(r.prompt))
                b.append_tokens([q], [list(r.prompt)])
                conn.update_state_after_alloc(r, q)
                seqs.append(q)
            conn.start_load_kv(conn.build_connector_meta())
            for layer in range(CFG.num_layers):
                conn.wait_for_layer_load(layer)
            for q in seqs:
                b.free(q)
        reports["receiver"] = conn.report

    run_threads([send, receive], timeout=20)
    sent, received = reports["sender"], reports["receiver"]
    assert sent.requests == received.requests == 6
    assert sent.blocks_sent == received.blocks_received == 4 * 2 + 2 * 2  # 17 to 23 tokens: 2 blocks of 16 each
    assert sent.tokens_moved == received.tokens_moved == (20 + 21 + 22 + 23) + 2 * 17


def test_transfer_timing_ratio_is_the_connectors_share_of_the_plain_speed():
    """``ratio`` is connector throughput over the plain send's, i.e. plain seconds / connector seconds: a
    connector taking 4x the plain send's time reaches 0.25 of it (1.0 would be the transport's limit)."""
    from kvlab.distributed.measure import TransferTiming

    t = TransferTiming(block_size=16, tokens=64, requests=2, blocks=8, bytes=4_000_000, connector=0.02, plain=0.005)
    assert t.ratio == 0.25
    assert (t.blocks_per_s, t.gb_per_s, t.plain_gb_per_s) == (400.0, 0.2, 0.8)


def test_plot_move_or_recompute_draws_both_times_in_milliseconds():
    rows = [kd.MoveOrRecompute(512, 1000, 0.002, 0.003, 0.001), kd.MoveOrRecompute(4096, 8000, 0.004, 0.005, 0.5)]
    fig = kd.plot_move_or_recompute(rows, "title")
    ax = fig.axes[0]
    (move, again) = ax.get_lines()
    assert list(move.get_xdata()) == [512, 4096] and list(move.get_ydata()) == [2.0, 4.0]
    assert list(again.get_ydata()) == [1.0, 500.0]
    assert ax.get_xscale() == ax.get_yscale() == "log" and ax.get_title() == "title"
    with pytest.raises(ConfigError):
        kd.plot_move_or_recompute([], "empty")
