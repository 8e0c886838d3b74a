"""kvlab against vLLM 0.34.0's own KV event code, run in a subprocess from ``.venv-bench`` (installed as
benchmarks/requirements-vllm.txt says; CI's .ci/run does it): vLLM's ``ZmqEventPublisher`` sends to kvlab's
subscriber, and vLLM's decoder reads what kvlab's publisher writes. Without ``.venv-bench`` these tests skip,
except with ``CI=true``, where they fail (tests/conftest.py)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.kvevents import KVEventPublisher, Subscriber
from kvlab.kvevents.wire import decode_batch, encode_batch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".venv-bench"
FIXTURES = ROOT / "tests" / "fixtures" / "kv_events"
PEER = FIXTURES / "vllm_peer.py"
# The interpreter .venv-bench was installed with (its msgspec is compiled for it): .venv's, also when this suite
# runs on another CPython (make test-versions).
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable


@pytest.fixture
def vllm_env() -> dict[str, str]:
    if not (BENCH / "vllm" / "distributed" / "kv_events.py").is_file():
        why = ("vLLM 0.34.0 is not in .venv-bench: .venv/bin/python -m pip install --no-deps --target .venv-bench "
               "-r benchmarks/requirements-vllm.txt")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    return {**os.environ, "PYTHONPATH": str(BENCH)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllms_own_publisher_sends_to_kvlabs_subscriber(vllm_env):
    p, r, topic = free_port(), free_port(), "kv-events"
    peer = subprocess.Popen([PYTHON, str(PEER), f"tcp://*:{p}", f"tcp://*:{r}", topic], env=vllm_env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    async def go():
        sub = Subscriber(f"tcp://127.0.0.1:{p}", topic=topic, replay_endpoint=f"tcp://127.0.0.1:{r}",
                         on_warning=lambda w: None)
        async with sub:
            line = await asyncio.get_running_loop().run_in_executor(None, peer.stdout.readline)
            assert line == "sent 3\n", line + peer.stderr.read()
            sub.catch_up()  # what the live stream missed while the subscription travelled
            for _ in range(1000):
                if sub.stats.batches == 3:
                    break
                await asyncio.sleep(0.01)
        return sub

    try:
        sub = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        peer.communicate(timeout=30)  # closes its stdin: it shuts its publisher down
    want = [decode_batch((FIXTURES / f"vllm-0.34.0-{case}.map.msgpack").read_bytes()) for case in
            ("basic", "full", "bare")]
    want[2].data_parallel_rank = 0  # vLLM's publisher fills in its rank
    got = list(sub.recent)
    assert [(g.seq, g.topic, g.batch) for g in got] == [(i, topic.encode(), w) for i, w in enumerate(want)]
    assert sub.stats.missed == sub.stats.malformed == sub.stats.duplicates == 0 and not sub.stats.notes
    assert peer.returncode == 0


def test_vllms_own_decoder_reads_kvlabs_bytes(vllm_env, tmp_path):
    from kvlab import Engine, EngineConfig, make_workload

    engine = Engine(make_workload("chat", 20, seed=2), EngineConfig(num_blocks=96, block_size=8,
                                                                     max_model_len=4096))
    with KVEventPublisher(engine, endpoint=f"tcp://*:{free_port()}", data_parallel_rank=3) as pub:
        engine.run()
    files = []
    for seq, batch in pub.buffer:
        files.append(tmp_path / f"{seq}.msgpack")
        files[-1].write_bytes(encode_batch(batch))
    out = subprocess.run([PYTHON, str(PEER), "decode", *map(str, files)], env=vllm_env, text=True,
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    read = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(read) == len(pub.buffer) > 2
    for (_, batch), seen in zip(pub.buffer, read):
        assert seen["same_bytes"] and seen["rank"] == 3
        assert seen["events"] == [[type(e).__name__, *getattr(e, "block_hashes", [])] for e in batch.events]
