"""The ``kvlab`` command line: end to end in a subprocess, argument errors, and the command registry."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab import ConfigError, make_workload, write_trace
from kvlab import cli

SMALL = ["sweep", "--sizes", "16,64", "--requests", "20", "--rounds", "2"]
# the table: block, blocks, waste %, table entries, alloc calls, prefix loss %, attention slots,
# attention ms (median [min-max], not in the cost), cost (**<-**: the pick)
ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| (\d+) \| (\d+) \| ([\d.]+) \| (\d+) \| (?:[\d.]+ \[[\d.]+-[\d.]+\]|-) "
                 r"\| ([\d.]+)(?: \*\*<-\*\*)? \|$", re.M)


def run(*args: str, exe: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVLAB_DEVICE": "cpu"}
    return subprocess.run([*(exe or [sys.executable, "-m", "kvlab"]), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def balanced_costs(stdout: str) -> dict[int, tuple[float, float]]:
    """``{block: (printed balanced cost, the cost recomputed from the printed columns)}``, the weights written out
    (waste 1, prefix loss 0.5, entries + calls 0.5, attention slots 0.5; the last two relative to the largest)."""
    rows = [(int(b), float(w) / 100, int(e) + int(c), float(loss) / 100, int(slots), float(cost))
            for b, _, w, e, c, loss, slots, cost in ROW.findall(stdout)]
    over, reads = max(r[2] for r in rows), max(r[4] for r in rows)
    return {b: (cost, w + 0.5 * loss + 0.5 * o / over + 0.5 * slots / reads)
            for b, w, o, loss, slots, cost in rows}


def test_python_m_kvlab_sweep_end_to_end():
    p = run(*SMALL, "--sizes", "16,1024", "--workload", "chat")
    assert p.returncode == 0, p.stderr
    assert [int(r[0]) for r in ROW.findall(p.stdout)] == [16, 1024]
    assert "paged_attention" in p.stdout and "median of 2 rounds" in p.stdout
    for printed, by_hand in balanced_costs(p.stdout).values():  # columns are rounded to 0.1% / 0.001 ms
        assert printed == pytest.approx(by_hand, abs=3e-3)
    # every cost term is a count, so these choices hold whatever the machine's timings
    assert "recommended block size (balanced): 16" in p.stdout
    assert "measured recommendation:    memory_efficient 16," in p.stdout and "balanced 16" in p.stdout
    assert "text's rule of thumb (p95): memory_efficient 512" in p.stdout
    assert p.stderr == ""  # stderr is a pipe here, not a terminal: no progress bar in a log


def test_console_script_counts_only():
    exe = Path(sys.executable).with_name("kvlab")
    if not exe.exists():
        pytest.fail(f"the kvlab console script is not installed next to {sys.executable}")
    p = run(*SMALL, "--workload", "dialogue", "--no-attention", "--no-progress", exe=[str(exe)])
    assert p.returncode == 0, p.stderr
    assert "attention: not measured" in p.stdout and p.stderr == ""
    costs = balanced_costs(p.stdout)
    assert {b: c for b, (c, _) in costs.items()} == {16: 0.570, 64: 0.467}  # counts only: exact every run
    for printed, by_hand in costs.values():
        assert printed == pytest.approx(by_hand, abs=3e-3)
    assert "measured recommendation:    memory_efficient 16, performance_optimal 64, balanced 64" in p.stdout
    assert "recommended block size (balanced): 64" in p.stdout


@pytest.mark.parametrize("args, word", [
    (["sweep", "--sizes", "16,abc"], "--sizes"),
    (["sweep", "--sizes", "16,0"], "--sizes"),
    (["sweep", "--sizes", "16,16"], "--sizes"),
    (["sweep", "--requests", "0"], "--requests"),
    (["sweep", "--workload", "chess"], "--workload"),
    (["sweep", "--goal", "fastest"], "--goal"),
    (["sweep", "--workload", "chat", "--trace", "t.jsonl"], "not allowed with"),
    (["run", "--format", "yaml"], "--format"),
    (["run", "--max-batched-tokens", "0"], "--max-batched-tokens"),
    (["frobnicate"], "invalid choice"),
    ([], "COMMAND"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, args, word):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    assert word in capsys.readouterr().err


def test_bad_trace_exits_2_naming_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "arrival": 0, "prompt_len": 4, "output_len": 1}\n{"id": 2}\n')
    assert cli.main(["sweep", "--trace", str(bad), "--no-progress"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert cli.main(["sweep", "--trace", str(tmp_path / "none.csv"), "--no-progress"]) == 2
    assert "cannot read trace" in capsys.readouterr().err


@pytest.mark.parametrize("args, word", [
    (["run", "--format", "azure"], "--format describes a trace file"),
    (["run", "--trace", "mooncake-conversation", "--rate", "5"], "brings its own timestamps"),
    (["run", "--trace", "no-such-trace"], "mooncake-conversation"),  # the message lists the bundled names
])
def test_run_refuses_contradictory_trace_arguments(capsys, args, word):
    assert cli.main([*args, "--no-progress"]) == 2
    assert word in capsys.readouterr().err


def test_run_a_bundled_trace_as_json():
    """``kvlab run --trace NAME --json``: stdout is one JSON object (the progress bar is on stderr) whose prompt
    tokens and prefix-hit bound are those of the trace's first N requests, computed here from the library."""
    import json

    from kvlab import load_trace, prefix_hit_bound
    from kvlab.workloads import Workload

    p = run("run", "--trace", "mooncake-conversation", "--requests", "40", "--block-size", "16", "--blocks",
            "60000", "--max-model-len", "131072", "--max-batched-tokens", "8192", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    first = Workload("first 40", load_trace("mooncake-conversation").requests[:40])
    assert out["requests"] == out["finished"] == 40
    assert out["prompt_tokens"] == sum(r.prompt_len for r in first)
    assert out["prefix_hit_bound"] == prefix_hit_bound(first, 16) > 0
    assert 0 < out["prefix_hit_tokens"] <= out["prefix_hit_bound"]
    assert out["prefix_hit_rate"] == pytest.approx(out["prefix_hit_tokens"] / out["prompt_tokens"])
    assert out["preemptions"] == 0  # 60,000 blocks hold everything these requests need
    assert 0 < out["usage_by_token"] <= out["usage_by_block"] <= 1  # tokens never fill more than their blocks
    assert out["wall_s"] > 0 and p.stderr == ""  # no bar: stderr is not a terminal


def test_sweep_a_trace_and_save_the_figure(tmp_path, capsys):
    trace = write_trace(make_workload("code", 30, 2), tmp_path / "code.csv")
    png = tmp_path / "sweep.png"
    assert cli.main(["sweep", "--trace", str(trace), "--sizes", "32,128", "--no-attention", "--no-progress",
                     "--goal", "memory_efficient", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "workload `code`, 30 requests" in out and "cost (memory_efficient)" in out
    assert "recommended block size (memory_efficient): 32" in out  # 0.144 vs 0.231, counts only
    assert "measured recommendation:    memory_efficient 32, performance_optimal 128, balanced 128" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_registering_a_command(capsys):
    seen = []

    def configure(p):
        p.add_argument("--times", type=int, default=1)

    @cli.command("echo-test", "say hello", configure)
    def echo(args):
        seen.append(args.times)
        print("hello " * args.times)
        return 3

    try:
        assert cli.main(["echo-test", "--times", "2"]) == 3
        assert seen == [2] and "hello hello" in capsys.readouterr().out
        with pytest.raises(ConfigError, match="echo-test"):
            cli.command("echo-test", "again", configure)(echo)
    finally:
        del cli._COMMANDS["echo-test"]
    with pytest.raises(SystemExit):
        cli.main(["echo-test"])
