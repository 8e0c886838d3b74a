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

SMALL = ["sweep", "--sizes", "16,64", "--requests", "20", "--rounds", "1"]


def run(*args: str, exe: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVLAB_DEVICE": "cpu"}
    return subprocess.run([*(exe or [sys.executable, "-m", "kvlab"]), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_python_m_kvlab_sweep_end_to_end():
    p = run(*SMALL, "--workload", "chat")
    assert p.returncode == 0, p.stderr
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \|", p.stdout, re.M)
    assert [r[0] for r in rows] == ["16", "64"]
    assert "paged_attention" in p.stdout
    best = re.search(r"recommended block size \(balanced\): (\d+)", p.stdout)
    assert best and best.group(1) in ("16", "64")
    assert "text's rule of thumb (p95): memory_efficient 512" in p.stdout
    assert "sweep chat" in p.stderr and "100%" in p.stderr  # the progress bar


def test_console_script_counts_only():
    exe = Path(sys.executable).with_name("kvlab")
    if not exe.exists():
        pytest.fail(f"the kvlab console script is not installed next to {sys.executable}")
    p = run(*SMALL, "--workload", "dialogue", "--no-attention", "--no-progress", exe=[str(exe)])
    assert p.returncode == 0, p.stderr
    assert "attention: not measured" in p.stdout and p.stderr == ""


@pytest.mark.parametrize("args, word", [
    (["sweep", "--sizes", "16,abc"], "--sizes"),
    (["sweep", "--sizes", "16,0"], "--sizes"),
    (["sweep", "--sizes", "16,16"], "--sizes"),
    (["sweep", "--requests", "0"], "--requests"),
    (["sweep", "--workload", "chess"], "--workload"),
    (["sweep", "--goal", "fastest"], "--goal"),
    (["sweep", "--workload", "chat", "--trace", "t.jsonl"], "not allowed with"),
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


def test_sweep_a_trace_and_save_the_figure(tmp_path, capsys):
    trace = write_trace(make_workload("code", 30, 2), tmp_path / "code.csv")
    png = tmp_path / "sweep.png"
    assert cli.main(["sweep", "--trace", str(trace), "--sizes", "32,128", "--no-attention", "--no-progress",
                     "--goal", "memory_efficient", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "workload `code`, 30 requests" in out and "cost (memory_efficient)" in out
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
