"""kvlab.kvevents.publisher: a kvlab engine's prefix-cache events in vLLM's wire format, read back by kvlab's
subscriber exactly as sent (metadata mode and real-model mode), and the cache they describe is the engine's."""
from __future__ import annotations

import asyncio
import socket

import pytest
import zmq

from kvlab import Engine, EngineConfig, KVSpec, PrefixCache, Request, TinyLlama, make_workload
from kvlab.core.errors import ConfigError, UnknownBlockError
from kvlab.core.events import EventRecorder
from kvlab.core.pool import BlockPool
from kvlab.core.prefix import PrefixEvicted, PrefixStored
from kvlab.kvevents import KVEventPublisher, RemoteCache, Subscriber
from kvlab.kvevents.publisher import external_hash, publisher_binds
from kvlab.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, split_replay


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoints() -> tuple[str, str, str, str]:
    """(publisher's endpoint, its replay endpoint, the subscriber's, its replay endpoint's)."""
    p, r = free_port(), free_port()
    return f"tcp://*:{p}", f"tcp://*:{r}", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}"


def round_trip(engine: Engine) -> tuple[KVEventPublisher, Subscriber, EventRecorder, RemoteCache]:
    """Run ``engine`` to the end while publishing; a subscriber (started first) takes the live stream and, by
    replay, whatever of it the live stream missed."""
    pub_ep, replay_ep, sub_ep, sub_replay = endpoints()
    remote = RemoteCache()

    async def go():
        sub = Subscriber(sub_ep, replay_endpoint=sub_replay, on_warning=lambda w: None,
                         on_batch=lambda r: remote.apply(r.batch.events))
        async with sub:
            recorder = EventRecorder(engine.events, (PrefixStored, PrefixEvicted))
            with KVEventPublisher(engine, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kvlab") as pub:
                await asyncio.sleep(0.1)  # the subscription has a chance to arrive; replay covers it if not
                while engine.step():
                    await asyncio.sleep(0)
                sub.catch_up()
                for _ in range(1000):
                    if sub.stats.batches == pub.seq:
                        break
                    await asyncio.sleep(0.01)
        return pub, sub, recorder

    pub, sub, recorder = asyncio.run(asyncio.wait_for(go(), 60))
    return pub, sub, recorder, remote


def check_round_trip(engine: Engine, requests: list[Request]) -> None:
    pub, sub, recorder, remote = round_trip(engine)
    cache = engine.memory.cache
    assert pub.seq > 2 and sub.stats.batches == pub.seq
    # the subscriber reproduces exactly the batches the publisher sent, in order, each once
    assert [(r.seq, r.batch) for r in sub.recent] == list(pub.buffer)
    assert sub.stats.missed == sub.stats.malformed == 0 and not sub.stats.notes
    # ... and they are the events kvlab emitted: stores and removals, in order, under vLLM's hashes
    events = [e for r in sub.recent for e in r.batch.events]
    assert events[0] == AllBlocksCleared()
    sent = [(type(e).__name__, h) for e in events[1:] for h in e.block_hashes]
    emitted = [("BlockStored" if isinstance(e, PrefixStored) else "BlockRemoved",
                external_hash(bytes.fromhex(e.digest))) for e in recorder.events]
    assert sent == emitted and any(k == "BlockRemoved" for k, _ in sent)
    # what the events rebuild is the engine's cache: its blocks, and every prompt's hits
    entries = cache.entries().values()
    assert set(remote.blocks[("GPU", 0)]) == {external_hash(d) for d, _, _ in entries}
    for digest, parent, tokens in entries:
        block = remote.blocks[("GPU", 0)][external_hash(digest)]
        assert block.tokens == tokens and block.parent == (None if parent is None else external_hash(parent))
    hits = []
    for r in requests:
        prompt = engine.memory.prompt_ids(r)
        hits.append(remote.hit_blocks(prompt))
        assert hits[-1] == len(cache.peek(prompt, r.tenant))
    assert any(hits)


def metadata_run() -> tuple[Engine, list[Request]]:
    workload = make_workload("chat", 40, seed=3)
    return Engine(workload, EngineConfig(num_blocks=96, block_size=8, max_model_len=4096)), list(workload.requests)


def test_a_metadata_mode_run_round_trips_exactly():
    check_round_trip(*metadata_run())


def test_a_real_model_run_round_trips_exactly():
    shared = tuple(range(1, 25))
    reqs = [Request(i, 0.05 * i, 32, 6, prompt_tokens=shared + tuple(range(30 + i, 38 + i))) for i in range(6)]
    engine = Engine(reqs, EngineConfig(num_blocks=20, block_size=4, max_model_len=64), model=TinyLlama())
    check_round_trip(engine, reqs)
    assert engine.outputs and all(len(o) == 6 for o in engine.outputs.values())


def test_the_first_batch_clears_and_states_what_is_cached_already():
    engine, _ = metadata_run()
    engine.run()
    cache = engine.memory.cache
    with KVEventPublisher(engine, endpoint=f"tcp://*:{free_port()}", topic="t") as pub:
        (seq, first), = pub.buffer
    assert seq == 0 and first.events[0] == AllBlocksCleared() and first.data_parallel_rank == 0
    remote = RemoteCache()
    remote.apply(first.events)
    assert len(remote) == len(cache) == remote.counts()["stored"]
    seen = set()
    for e in first.events[1:]:  # parents first
        assert isinstance(e, BlockStored) and (e.parent_block_hash is None or e.parent_block_hash in seen)
        seen.update(e.block_hashes)
        assert (e.block_size, e.medium, e.group_idx, e.lora_id) == (8, "GPU", 0, None)
    for h in remote.blocks[("GPU", 0)]:  # every cached block is reached from the root by its chain's tokens
        chain = remote.chain(h, ("GPU", 0))
        assert chain[0].parent is None
        assert remote.hit_blocks([t for b in chain for t in b.tokens]) == len(chain)


def test_a_bare_prefix_cache_publishes_on_flush_and_its_replay_service_answers():
    pool = BlockPool(16, spec=KVSpec(block_size=4), with_storage=False)
    cache = PrefixCache(pool)
    pub_ep, replay_ep, _, sub_replay = endpoints()
    with KVEventPublisher(cache, endpoint=pub_ep, replay_endpoint=replay_ep, data_parallel_rank=2,
                          medium="CPU") as pub:
        ids = pool.allocate(3)
        hashes = [external_hash(d) for d in cache.store_blocks(ids, list(range(12)))]
        assert pub.flush() == 1 and pub.flush() is None
        batch = pub.buffer[1][1]
        assert batch.data_parallel_rank == 2  # one chain: one event
        assert batch.events == [BlockStored(hashes, None, list(range(12)), 4, None, "CPU", None, group_idx=0)]
        pool.free(ids)
        pool.allocate(16)  # evicts the three cached blocks, tails first
        assert pub.flush() == 2
        assert pub.buffer[2][1].events == [BlockRemoved([h], "CPU", 0) for h in hashes[::-1]]
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(sub_replay)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = [split_replay(dealer.recv_multipart()) for _ in range(3)]
        assert [(t, s) for t, s, _ in replies] == [(b"", 1), (b"", 2), (b"", -1)]
        assert decode_batch(replies[0][2]) == batch
        dealer.send_multipart([b"", b"bad"])  # a malformed request is ignored; the service goes on
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert [split_replay(dealer.recv_multipart())[1] for _ in range(4)] == [0, 1, 2, -1]
        ctx.destroy(linger=0)
    pub.close()  # twice: harmless
    assert not pool.events


def test_removals_are_one_event_per_block_as_vllm_sends_them():
    engine, _ = metadata_run()
    with KVEventPublisher(engine, endpoint=f"tcp://*:{free_port()}") as pub:
        engine.run()
    removed = [e for _, b in pub.buffer for e in b.events if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_hashes) == 1 and e.medium == "GPU" and e.group_idx == 0 for e in removed)


@pytest.mark.parametrize("source, kw, says", [
    ("engine", {}, "KV events come from a prefix cache"),
    (None, {}, "KV events come from a prefix cache"),
    ("cache", {"endpoint": 5557}, "endpoint must be a str"),
    ("cache", {"buffer_steps": 0}, "buffer_steps must be a positive int"),
    ("cache", {"endpoint": "tcp://*:notaport"}, "cannot open KV event endpoint"),
    ("cache", {"replay_endpoint": "bogus://x"}, "cannot open KV event endpoint"),
])
def test_bad_sources_and_settings_are_refused(source, kw, says):
    pool = BlockPool(8, spec=KVSpec(block_size=4), with_storage=False)
    given = {"engine": Engine([Request(0, 0.0, 8, 2)], EngineConfig(num_blocks=8, prefix_caching=False)),
             "cache": PrefixCache(pool), None: None}[source]
    with pytest.raises(ConfigError, match=says):
        KVEventPublisher(given, **{"endpoint": f"tcp://*:{free_port()}", **kw})
    assert not pool.events  # nothing left listening


def test_vllms_bind_rule():
    assert publisher_binds("tcp://*:5557") and publisher_binds("tcp://[::]:5557") and publisher_binds("ipc:///x")
    assert publisher_binds("inproc://kv") and not publisher_binds("tcp://10.0.0.2:5557")
    assert not publisher_binds("tcp://0.0.0.0:5557")  # no * or ::: vLLM connects there


def test_prefix_cache_entry_is_one_block_of_entries():
    pool = BlockPool(8, spec=KVSpec(block_size=2), with_storage=False)
    cache = PrefixCache(pool)
    ids = pool.allocate(3)
    cache.store_blocks(ids[:2], [1, 2, 3, 4])
    assert [cache.entry(b) for b in ids[:2]] == [cache.entries()[b] for b in ids[:2]]
    assert cache.entry(ids[2]) is None
    with pytest.raises(UnknownBlockError):
        cache.entry(99)
