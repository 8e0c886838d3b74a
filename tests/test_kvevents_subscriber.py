"""kvlab.kvevents.subscriber on real ZeroMQ sockets (loopback, free ports): delivery in seq order, gaps filled by
replay (vLLM's and SGLang's reply frames), restarts, and every kind of bad input counted without stopping the
task; and ``kvlab watch``."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from kvlab.app.cli import main
from kvlab.core.errors import ConfigError, NoEventsError
from kvlab.kvevents import RemoteCache, Subscriber
from kvlab.kvevents.wire import BlockRemoved, BlockStored, KVEventBatch, encode_batch, seq_bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def payload(i: int) -> bytes:
    return encode_batch(KVEventBatch(float(i), [BlockRemoved([i], "GPU", 0)], 0))


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"waited 10 s for {what}")


class Sender:
    """The server's side: an XPUB (a PUB that tells when a subscriber's subscription has arrived), bound."""

    def __init__(self, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.linger = 0
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.topic = topic

    async def subscribed(self) -> None:
        async def arrived() -> bool:
            return bool(self.sock.poll(0)) and self.sock.recv()[:1] == b"\x01"
        for _ in range(1000):
            if await arrived():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no subscription arrived")

    def send(self, *seqs: int) -> None:
        for s in seqs:
            self.sock.send_multipart([self.topic, seq_bytes(s), payload(s)])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def replay_service(held: dict[int, bytes], shape: str = "vllm", answer: bool = True):
    """A ROUTER answering a replay request as vLLM (``[id, b"", topic, seq, payload]``) or SGLang (no topic)
    does, from ``held``; ``answer=False``: it reads requests and never answers. Yields its endpoint."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    requests: list[int] = []

    async def serve() -> None:
        while True:
            ident, empty, start = await router.recv_multipart()
            requests.append(int.from_bytes(start, "big"))
            if not answer:
                continue
            for s in sorted(held):
                if s >= requests[-1]:
                    body = [b"topic", seq_bytes(s), held[s]] if shape == "vllm" else [seq_bytes(s), held[s]]
                    await router.send_multipart([ident, b"", *body])
            end = [b"", seq_bytes(-1), b""] if shape == "vllm" else [seq_bytes(-1), b""]
            await router.send_multipart([ident, b"", *end])

    task = asyncio.create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}", requests
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)


async def listening(sender: Sender, **kw) -> Subscriber:
    sub = Subscriber(f"tcp://127.0.0.1:{sender.port}", on_warning=lambda w: None, **kw)
    sub.start()
    await sender.subscribed()
    return sub


def seqs(sub: Subscriber) -> list[int]:
    return [r.seq for r in sub.recent]


def test_batches_arrive_decoded_in_order_to_callbacks_iterators_and_recent():
    async def go():
        sender, got = Sender(), []
        sub = await listening(sender, on_batch=got.append)
        remote = RemoteCache()
        sub.subscribe(lambda r: remote.apply(r.batch.events))
        sender.send(0, 1, 2)
        seen = []
        async for r in sub:
            seen.append(r.seq)
            if len(seen) == 3:
                break
        assert seen == [0, 1, 2] == [r.seq for r in got] == seqs(sub)
        assert got[2].batch == KVEventBatch(2.0, [BlockRemoved([2], "GPU", 0)], 0)
        assert (sub.stats.messages, sub.stats.batches, sub.stats.events, sub.stats.joined_at) == (3, 3, 3, 0)
        assert remote.unknown_removed == 3 and not sub.warnings
        await sub.aclose()
        assert not sub.running
        sender.close()
    run(go())


def test_a_gap_without_replay_is_counted_and_marked_on_the_next_batch():
    async def go():
        sender = Sender()
        sub = await listening(sender)
        sender.send(0, 1, 4, 5)
        await until(lambda: sub.stats.batches == 4, "4 batches")
        assert seqs(sub) == [0, 1, 4, 5] and [r.missed for r in sub.recent] == [0, 0, 2, 0]
        assert (sub.stats.gaps, sub.stats.missed) == (1, 2)
        assert any("missed 2 batches" in w and "replay endpoint" in w for w in sub.warnings)
        await sub.aclose()
        sender.close()
    run(go())


@pytest.mark.parametrize("shape", ["vllm", "sglang"])
def test_a_gap_is_filled_by_replay_in_either_engines_frames(shape):
    async def go():
        sender = Sender()
        async with replay_service({s: payload(s) for s in range(10)}, shape) as (replay, requests):
            sub = await listening(sender, replay_endpoint=replay, catch_up=False)
            sender.send(0, 1, 5, 6)
            await until(lambda: sub.stats.batches == 7, "7 batches")
            assert seqs(sub) == list(range(7)) and requests == [2]
            assert [r.replayed for r in sub.recent] == [False, False, True, True, True, False, False]
            assert [r.batch.ts for r in sub.recent] == [float(s) for s in range(7)]
            assert (sub.stats.gaps, sub.stats.missed, sub.stats.replayed) == (0, 0, 3)
            await sub.aclose()
        sender.close()
    run(go())


def test_a_subscriber_first_fetches_what_the_servers_buffer_holds():
    async def go():
        sender = Sender()
        async with replay_service({s: payload(s) for s in range(4)}) as (replay, requests):
            sub = await listening(sender, replay_endpoint=replay)  # a quiet server: nothing live
            await until(lambda: sub.stats.batches == 4, "4 batches")
            assert seqs(sub) == [0, 1, 2, 3] and all(r.replayed for r in sub.recent) and requests == [0]
            sender.send(3, 4)
            await until(lambda: sub.stats.batches == 5, "5 batches")
            assert seqs(sub)[-1] == 4 and sub.stats.duplicates == 1 and not sub.recent[-1].replayed
            await sub.aclose()
        sender.close()
    run(go())


def test_joining_a_running_stream_fetches_the_servers_buffer_then_catch_up_the_rest():
    async def go():
        sender = Sender()
        held = {s: payload(s) for s in range(1, 4)}  # the buffer no longer holds seq 0
        async with replay_service(held) as (replay, requests):
            sub = await listening(sender, replay_endpoint=replay, catch_up=False)
            sender.send(3)
            await until(lambda: sub.stats.batches == 3, "3 batches")
            assert seqs(sub) == [1, 2, 3] and sub.recent[0].missed == 1 and sub.stats.joined_at == 3
            held.update({s: payload(s) for s in (4, 5)})
            sub.catch_up()
            await until(lambda: sub.stats.batches == 5, "5 batches")
            sender.send(4, 5, 6)  # the live copies of what replay gave: dropped as duplicates
            await until(lambda: sub.stats.batches == 6, "6 batches")
            assert seqs(sub) == [1, 2, 3, 4, 5, 6] and requests == [0, 4] and sub.stats.duplicates == 2
            await sub.aclose()
        sender.close()
    run(go())


def test_a_replay_service_that_never_answers_is_counted_and_the_stream_goes_on():
    async def go():
        sender = Sender()
        async with replay_service({}, answer=False) as (replay, requests):
            sub = await listening(sender, replay_endpoint=replay, replay_timeout_s=0.2, catch_up=False)
            sender.send(0, 3)
            await until(lambda: sub.stats.batches == 2, "2 batches")
            assert seqs(sub) == [0, 3] and sub.recent[1].missed == 2 and requests == [1]
            assert sub.stats.replay_failures == 1 and any("replay service" in w for w in sub.warnings)
            await sub.aclose()
        sender.close()
    run(go())


def test_duplicates_and_out_of_order_seqs_are_counted_and_skipped():
    async def go():
        sender = Sender()
        sub = await listening(sender)
        sender.send(0, 1, 2, 2, 1, 3)
        await until(lambda: sub.stats.batches == 4, "4 batches")
        assert seqs(sub) == [0, 1, 2, 3]
        assert (sub.stats.duplicates, sub.stats.out_of_order, sub.stats.restarts) == (1, 1, 0)
        await sub.aclose()
        sender.close()
    run(go())


def test_a_publisher_restart_starts_a_new_stream():
    async def go():
        sender = Sender()
        sub = await listening(sender)
        sender.send(0, 1, 2, 0, 1)  # back to 0
        sender.send(5, 6)  # a gap
        sender.send(2, 3)  # behind, twice in a row: a restart whose first batches were lost
        await until(lambda: sub.stats.batches == 8, "8 batches")
        assert seqs(sub) == [0, 1, 2, 0, 1, 5, 6, 3]
        assert [r.restarted for r in sub.recent] == [False] * 3 + [True] + [False] * 3 + [True]
        assert sub.stats.restarts == 2 and sub.stats.out_of_order == 1  # seq 2 after 6, on its own, was behind
        assert any("publisher restarted" in w for w in sub.warnings)
        await sub.aclose()
        sender.close()
    run(go())


def test_after_a_restart_the_first_batch_delivered_says_so_even_a_replayed_one():
    async def go():
        sender = Sender()
        async with replay_service({s: payload(s) for s in range(3)}) as (replay, requests):
            sub = await listening(sender, replay_endpoint=replay, catch_up=False)
            sender.send(0, 1, 2, 3, 4)
            sender.send(2, 3)  # the restarted publisher's 2 and 3: its 0 and 1 come by replay
            await until(lambda: sub.stats.batches == 9, "9 batches")
            assert seqs(sub) == [0, 1, 2, 3, 4, 0, 1, 2, 3] and requests == [0]
            assert [(r.restarted, r.replayed) for r in sub.recent][5:] == [(True, True), (False, True),
                                                                          (False, True), (False, False)]
            await sub.aclose()
        sender.close()
    run(go())


def test_malformed_frames_oversized_and_unreadable_payloads_are_counted_never_raised():
    async def go():
        sender = Sender()
        sub = await listening(sender, max_payload=200)
        s = sender.sock
        s.send_multipart([b"", seq_bytes(0)])  # 2 frames
        s.send_multipart([b"", seq_bytes(0), payload(0), b"x"])  # 4 frames
        s.send_multipart([b"", b"\0" * 7, payload(0)])  # seq not 8 bytes
        sender.send(0)
        s.send_multipart([b"", seq_bytes(1), b"\0" * 201])  # over the cap
        s.send_multipart([b"", seq_bytes(2), payload(2)[:-3]])  # truncated
        s.send_multipart([b"", seq_bytes(3), encode_batch(KVEventBatch(3.0, [BlockRemoved([3])]))[:3] + b"\x91\x92"])
        s.send_multipart([b"", seq_bytes(4), msg_with_unknowns()])
        await until(lambda: sub.stats.batches == 2, "2 batches")
        assert seqs(sub) == [0, 4] and sub.recent[1].missed == 3  # seqs 1-3 arrived but could not be read
        assert (sub.stats.malformed, sub.stats.oversized, sub.stats.messages) == (5, 1, 8)
        assert sub.recent[1].batch.events == [BlockRemoved([4])]
        assert sub.stats.notes == {"unknown event type 'BlockPinned'": 1, "unknown field BlockRemoved.tier": 1}
        assert sub.running and len(sub.warnings) == 7
        assert "(skipped) unknown event type 'BlockPinned', unknown field BlockRemoved.tier" in sub.warnings[-1]
        await sub.aclose()
        sender.close()
    run(go())


def msg_with_unknowns() -> bytes:
    import msgspec
    return msgspec.msgpack.encode([4.0, [{"type": "BlockPinned"}, {"type": "BlockRemoved", "block_hashes": [4],
                                                                     "medium": None, "tier": 2}], None])


def test_a_callback_that_raises_is_counted_and_the_stream_goes_on():
    async def go():
        sender = Sender()
        sub = await listening(sender, on_batch=lambda r: 1 / 0)
        sender.send(0, 1)
        await until(lambda: sub.stats.batches == 2, "2 batches")
        assert sub.stats.errors == 2 and "ZeroDivisionError" in sub.warnings[0] and sub.running
        await sub.aclose()
        sender.close()
    run(go())


def test_memory_is_bounded():
    async def go():
        sender = Sender()
        sub = await listening(sender, keep=3)
        it = sub.__aiter__()  # an iterator that reads late: the oldest batches go
        sender.send(*range(10))
        await until(lambda: sub.stats.batches == 10, "10 batches")
        assert seqs(sub) == [7, 8, 9] and sub.stats.dropped == 7
        assert [(await it.__anext__()).seq for _ in range(3)] == [7, 8, 9]
        await sub.aclose()
        sender.close()
    run(go())


@pytest.mark.parametrize("listen", [False, True])
def test_an_endpoint_that_never_answers_explains_who_binds_and_the_task_lives_on(listen):
    async def go():
        port = free_port()
        endpoint = f"tcp://*:{port}" if listen else f"tcp://127.0.0.1:{port}"
        sub = Subscriber(endpoint, silence_s=0.1, on_warning=lambda w: None)
        assert sub.binds is listen
        sub.start()
        await until(lambda: sub.stats.silences >= 2, "two silences")
        assert len(sub.warnings) == 1  # said once per silence
        text = sub.warnings[0]
        assert "no KV events from" in text and "binds only when its endpoint has * or ::" in text
        assert ("this side listens" if listen else "this side connects") in text
        assert sub.running and (sub.stats.reconnects == 0 if listen else sub.stats.reconnects >= 2)
        assert isinstance(sub.wait_silence_error(), NoEventsError)
        await sub.aclose()
    run(go())


def test_a_listening_subscriber_takes_a_publisher_that_connects():
    async def go():
        port = free_port()
        sub = Subscriber(f"tcp://*:{port}", on_warning=lambda w: None)
        sub.start()
        ctx = zmq.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(1000):
            if pub.poll(0):
                break
            await asyncio.sleep(0.01)
        pub.send_multipart([b"", seq_bytes(0), payload(0)])
        await until(lambda: sub.stats.batches == 1, "a batch")
        await sub.aclose()
        ctx.destroy(linger=0)
    run(go())


def test_a_port_taken_is_warned_about_and_retried():
    async def go():
        sender = Sender()
        sub = Subscriber(f"tcp://*:{sender.port}", silence_s=0.1, on_warning=lambda w: None)
        sub.start()
        await until(lambda: sub.stats.errors >= 1, "an error")
        assert "trying again" in sub.warnings[0] and sub.running
        await sub.aclose()
        sender.close()
    run(go())


def test_only_the_topic_asked_for_arrives():
    async def go():
        sender = Sender(topic=b"kv@rank0")
        sub = await listening(sender, topic="kv@rank0")
        sender.sock.send_multipart([b"other", seq_bytes(0), payload(0)])
        sender.send(0)
        await until(lambda: sub.stats.batches == 1, "a batch")
        assert sub.recent[0].topic == b"kv@rank0" and sub.stats.messages == 1
        await sub.aclose()
        sender.close()
    run(go())


@pytest.mark.parametrize("kw, says", [
    ({"endpoint": "localhost:5557"}, "must be a ZeroMQ endpoint"),
    ({"endpoint": "tcp://host"}, "must be a ZeroMQ endpoint"),
    ({"endpoint": "tcp://host:70000"}, "port must be 1..65535"),
    ({"endpoint": 5557}, "must be a ZeroMQ endpoint"),
    ({"replay_endpoint": "tcp://*:5558"}, "replay service binds"),
    ({"topic": b"kv"}, "topic must be a str"),
    ({"keep": 0}, "keep must be a positive int"),
    ({"silence_s": 0}, "silence_s must be"),
    ({"on_batch": 3}, "must be callable"),
    ({"catch_up": "yes"}, "catch_up must be True or False"),
])
def test_bad_settings_are_refused_with_the_value_named(kw, says):
    with pytest.raises(ConfigError, match=says):
        Subscriber(**{"endpoint": "tcp://127.0.0.1:5557", **kw})


def test_start_needs_a_running_loop_and_catch_up_a_replay_endpoint():
    sub = Subscriber("ipc:///tmp/kvlab-none.sock")
    with pytest.raises(ConfigError, match="running asyncio loop"):
        sub.start()
    with pytest.raises(ConfigError, match="replay endpoint"):
        sub.catch_up()


# ------------------------------------------------------------------------------------------------- kvlab watch
def watch(argv: list[str], sender: Sender, *seqs: int) -> int:
    """``kvlab watch`` in a thread while ``sender`` sends ``seqs`` once it is subscribed; its exit code."""
    code: list[int] = []
    t = threading.Thread(target=lambda: code.append(main(["watch", f"tcp://127.0.0.1:{sender.port}", *argv])))
    t.start()
    asyncio.run(sender.subscribed())
    sender.send(*seqs)
    t.join(30)
    assert code, "kvlab watch did not stop"
    return code[0]


def test_watch_json_prints_one_object_per_event_with_vllms_names(capsys):
    sender = Sender()
    stored = KVEventBatch(5.5, [BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0),
                                BlockStored([b"\xab" * 16], 2, [5, 6], 2, None, "GPU", None)], 1)
    t = threading.Thread(target=lambda: sender_after(sender, stored))
    t.start()
    assert main(["watch", f"tcp://127.0.0.1:{sender.port}", "--json", "--count", "2"]) == 0
    t.join()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["type"], x["seq"], x["ts"], x["data_parallel_rank"]) for x in lines] == [("BlockStored", 0, 5.5, 1)] * 2
    assert lines[0]["block_hashes"] == [1, 2] and lines[1]["block_hashes"] == ["ab" * 16]
    assert list(lines[0])[4:] == list(BlockStored.__struct_fields__)
    sender.close()


def sender_after(sender: Sender, batch: KVEventBatch) -> None:
    asyncio.run(sender.subscribed())
    sender.sock.send_multipart([b"", seq_bytes(0), encode_batch(batch)])


def test_watch_prints_events_in_words_and_marks_gaps(capsys):
    sender = Sender()
    assert watch(["--count", "2"], sender, 0, 3) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("seq 0  移除 (BlockRemoved) 1 块 (blocks) [0000000000000000], GPU group 0")
    assert out[1] == "-- 缺失 2 批 (missed 2 batches) --" and out[2].startswith("seq 3")
    sender.close()


@pytest.mark.parametrize("argv, says", [
    (["watch", "nonsense"], "endpoint must be a ZeroMQ endpoint"),
    (["watch", "tcp://h:1", "--replay", "tcp://*:2"], "replay service binds"),
    (["watch", "tcp://h:1", "--count", "0"], "--count"),
    (["watch", "tcp://h:1", "--timeout", "-1"], "--timeout"),
])
def test_watch_bad_use_is_one_line_and_exit_2(argv, says, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------- the remote cache
def fixture_events(case: str) -> list:
    from pathlib import Path

    from kvlab.kvevents.wire import decode_batch
    path = Path(__file__).parent / "fixtures" / "kv_events" / f"vllm-0.34.0-{case}.map.msgpack"
    return decode_batch(path.read_bytes()).events


def test_the_remote_cache_walks_stored_blocks_by_their_tokens():
    stored_a, stored_b, removed, cleared = fixture_events("basic")  # h0, h1 <- h2; remove h0; clear
    remote = RemoteCache()
    remote.apply([stored_a, stored_b])
    assert remote.hit_blocks(list(range(1, 13))) == 3 and remote.block_size == 4
    assert remote.hit_blocks([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12]) == 1  # the second block differs
    assert remote.hit_blocks(list(range(1, 12))) == 2  # the third block is not full
    assert [b.block_hash for b in remote.chain(stored_b.block_hashes[0], ("GPU", 0))] == [
        *stored_a.block_hashes, *stored_b.block_hashes]
    remote.apply([removed])  # the root block goes: nothing is reachable, though two blocks stay
    assert remote.hit_blocks(list(range(1, 13))) == 0 and len(remote) == 2
    remote.apply([removed, cleared])
    assert len(remote) == 0 and remote.counts() == {"blocks": 0, "stored": 3, "removed": 1, "unknown_removed": 1,
                                                    "mismatched": 0, "cleared": 1}


def test_the_remote_cache_keeps_tiers_apart():
    stored, removed = fixture_events("full")  # CPU, group 1, block_size 3, bytes hashes
    remote = RemoteCache()
    remote.apply([stored, *fixture_events("basic")[:2]])
    assert set(remote.tiers()) == {("CPU", 1), ("GPU", 0)}
    assert remote.hit_blocks([5, 6, 7, 8, 9, 10], 3, medium="CPU") == 2
    assert remote.hit_blocks([5, 6, 7, 8, 9, 10], 3, medium="GPU") == 0
    assert remote.hit_blocks([5, 6, 7, 8, 9, 10], 3, group=0) == 0
    remote.apply([removed])  # from STORAGE, where nothing was stored: the CPU copy stays
    assert remote.hit_blocks([5, 6, 7, 8, 9, 10], 3) == 2 and remote.unknown_removed == 1


def test_the_remote_cache_counts_what_does_not_add_up():
    remote = RemoteCache()
    assert remote.hit_blocks([1, 2, 3]) == 0  # no block size known yet
    remote.apply([BlockStored([1, 2], None, [1, 2, 3], 2, None, "GPU", None), BlockRemoved([7], "GPU")])
    assert (remote.mismatched, remote.unknown_removed) == (1, 1)
    remote.apply([BlockStored([2], None, [5, 6], 2, None, "GPU", None)])  # stored again elsewhere: re-linked
    assert remote.hit_blocks([5, 6]) == 1 and remote.hit_blocks([1, 2, 5, 6]) == 1
    with pytest.raises(ConfigError):
        remote.hit_blocks([1, 2], 0)
