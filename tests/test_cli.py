"""The ``kvlab`` command line: end to end in a subprocess, argument errors, and the command registry."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _util import REPO

from kvlab import ConfigError, make_workload, write_trace
from kvlab.app import cli

SMALL = ["sweep", "--sizes", "16,64", "--requests", "20", "--rounds", "2"]
# the table: block, blocks, waste %, table entries, alloc calls, prefix loss %, attention slots,
# attention ms (median [min-max], not in the cost), cost (**<-**: the pick)
ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| (\d+) \| (\d+) \| ([\d.]+) \| (\d+) "
                 r"\| (?:[\d.]+ \[[\d.]+-[\d.]+\]|-) \| ([\d.]+)(?: \*\*<-\*\*)? \|$", re.M)


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
    assert {b: c for b, (c, _) in costs.items()} == {16: 1.015, 64: 0.967}  # counts only: exact every run
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


@pytest.mark.parametrize("shared, short", [("wait", 0), ("duplicate", 512)])
def test_run_passes_shared_prefill_to_the_engine(capsys, shared, short):
    """``--shared-prefill``: on the first 300 Mooncake requests, waiting for a prefill in flight reaches the
    bound; computing it again (vLLM's way) misses the one 512-token block request 1 computes beside request 0."""
    import json

    assert cli.main(["run", "--trace", "mooncake-conversation", "--requests", "300", "--block-size", "16",
                     "--blocks", "400000", "--max-model-len", "131072", "--max-batched-tokens", "8192",
                     "--shared-prefill", shared, "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefix_hit_bound"] - out["prefix_hit_tokens"] == short


def test_run_a_bundled_trace_as_json():
    """``kvlab run --trace NAME --json``: stdout is one JSON object (the progress bar is on stderr) whose prompt
    tokens and prefix-hit bound are those of the trace's first N requests, computed here from the library."""
    import json

    from kvlab import load_trace, prefix_hit_bound
    from kvlab.workloads.mixes import Workload

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


# ---------------------------------------------------------------------------------------------------- user errors
def _bad_values(tmp: Path) -> dict:
    """Bad values for every argument type the commands use; a new type without an entry fails the grid below."""
    (tmp / "a-file").write_text("x")
    huge = ["99999999999999999999", "9" * 5000]  # too large, not "an int of 67 bits" nor "not an integer"
    return {
        cli._positive_int: ["0", "-3", "1.5", "x", "", *huge],
        cli._positive_float: ["0", "-2", "nan", "inf", "x"],
        cli._seed: ["-1", str(2**32), "x", *huge],
        cli._exercise_seed: ["-1", str(2**31), "x", *huge],
        cli._port: ["0", "-1", "65536", "99999", "x", *huge],
        cli._device: ["nosuchdev", "cuda:7", "meta", ""],
        cli._figure_file: ["/nonexistent/x.png", str(tmp / "x.nosuchformat"), str(tmp), "a\0b.png", "/proc/x.png"],
        cli._output_file: ["/nonexistent/x.json", str(tmp), "a\0b.json", "/proc/x.json"],
        # a file, a folder under a file, a folder of the kernel's that takes no files (even root's)
        cli._output_folder: [str(tmp / "a-file"), str(tmp / "a-file" / "sub"), "/proc/x", "/proc/x/y", "a\0b"],
        cli._path: ["a\0b"],
        cli._sizes: ["16,abc", "16,16", ",", "0"],
        int: ["x", "1.5"],
        float: ["x"],
    }


def _typed_options() -> list[tuple[str, str, object]]:
    """``(command, option, type or choices)`` for every option of every registered command that takes a value."""
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found = []
    for name, p in sub.choices.items():
        for a in p._actions:
            if not a.option_strings or a.nargs == 0:
                continue
            found.append((name, a.option_strings[-1], tuple(a.choices) if a.choices else a.type))
    return found


OPTIONS = [o for o in _typed_options() if o[2] is not None]  # free text is checked by its command (below)
# positional arguments a command needs before its options are looked at
NEEDS = {"chapters": ["somewhere"]}


@pytest.mark.parametrize("command, option, kind", OPTIONS, ids=[f"{c} {o}" for c, o, _ in OPTIONS])
def test_every_bad_option_value_is_one_line_and_exit_2_before_any_work(command, option, kind, tmp_path, capsys,
                                                                      monkeypatch):
    """Generated from the parser: each option of each command with each bad value of its type (or a value outside
    its choices) exits 2 with one line naming the option, runs nothing and writes nothing."""
    def must_not_run(args):
        raise AssertionError(f"{command} ran with a bad {option}")

    for name, (help_, configure, _) in list(cli._COMMANDS.items()):
        monkeypatch.setitem(cli._COMMANDS, name, (help_, configure, must_not_run))
    bad = _bad_values(tmp_path)
    if isinstance(kind, tuple):
        values = ["no-such-choice"]
    else:
        assert kind in bad, f"{command} {option}: add bad values for its type {kind!r} to _bad_values"
        values = bad[kind]
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    for value in values:
        with pytest.raises(SystemExit) as e:
            cli.main([command, *NEEDS.get(command, []), f"{option}={value}"])
        err = capsys.readouterr().err
        assert e.value.code == 2, (option, value)
        assert err.count("\n") == 1 and option in err and err.startswith(f"kvlab {command}: error:"), (value, err)
        assert not (value.isdigit() and len(value) > 12) or "too large: " in err, err  # and the most allowed
    assert list(work.iterdir()) == []


def test_the_grid_covers_the_options_that_matter():
    names = {(c, o) for c, o, _ in OPTIONS}
    assert {("sweep", "--device"), ("sweep", "--plot"), ("run", "--rate"), ("run", "--seed"), ("bench", "--out"),
            ("lab", "--port")} <= names


def _one_line_error(p: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert all(w in p.stderr for w in words), p.stderr


def test_user_errors_end_in_one_line_never_a_traceback(tmp_path):
    _one_line_error(run("sweep", "--device", "nosuchdev"), 2, "--device", "nosuchdev")
    _one_line_error(run("sweep", "--plot", "/nonexistent/x.png", "--requests", "5"), 2, "/nonexistent")
    _one_line_error(run("run", "--rate", "nan"), 2, "--rate")
    bad_env = {**os.environ, "KVLAB_DEVICE": "nosuchdev"}
    p = subprocess.run([sys.executable, "-m", "kvlab", "run", "--requests", "5", "--no-progress"], env=bad_env,
                       capture_output=True, text=True, timeout=300)
    _one_line_error(p, 2, "KVLAB_DEVICE")
    (tmp_path / "file").write_text("x")
    _one_line_error(run("chapters", str(tmp_path / "file")), 2, "is a file")
    _one_line_error(run("lab", str(tmp_path / "nowhere")), 2, "not a folder")
    _one_line_error(run("lab", str(REPO), "--ip", "192.0.2.1", "--dry-run"), 2, "cannot listen")  # TEST-NET-1: not ours
    _one_line_error(run("run", "--trace", str(tmp_path / "none.csv")), 2, "cannot read trace")
    _one_line_error(run("bench", "bench_pool", "nosuch", "--quick"), 2, "nosuch", "bench_pool")
    # 100 blocks of 16 tokens hold no max-length region of 2,048: the baseline could never admit a request
    _one_line_error(run("run", "--requests", "3", "--blocks", "100", "--baseline"), 2, "--max-model-len 2,048",
                    "--blocks 128")


def test_running_out_of_memory_is_one_line_and_exit_1(capsys, monkeypatch):
    def too_big(args):
        raise MemoryError

    help_, configure, _ = cli._COMMANDS["run"]
    monkeypatch.setitem(cli._COMMANDS, "run", (help_, configure, too_big))
    assert cli.main(["run", "--requests", "2000000000"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvlab run: error: out of memory")


def test_a_closed_pipe_ends_quietly():
    """``kvlab run ... | head -0``: the reader is gone before kvlab prints; no BrokenPipeError, exit 141 (SIGPIPE's
    code in a shell), nothing on stderr."""
    p = subprocess.Popen([sys.executable, "-m", "kvlab", "run", "--requests", "20", "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "KVLAB_DEVICE": "cpu"})
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and err == b""


def test_progress_bars_show_on_a_terminal_only():
    """With stderr a terminal the sweep draws its bar; the same command into a pipe (every other test) does not."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    p = subprocess.Popen([sys.executable, "-m", "kvlab", *SMALL, "--no-attention"], stdout=subprocess.DEVNULL,
                         stderr=slave, env={**os.environ, "KVLAB_DEVICE": "cpu"})
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert p.wait(timeout=300) == 0
    assert b"sweep chat" in seen and b"100%" in seen, seen


# ---------------------------------------------------------------------------------------------------- --json
def test_sweep_json_is_the_library_sweep(capsys):
    from kvlab import ChunkSizeOptimizer
    from kvlab.memory.sizing import GOALS

    assert cli.main(["sweep", "--requests", "20", "--sizes", "16,64", "--no-attention", "--no-progress", "--json",
                     "--goal", "memory_efficient"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = ChunkSizeOptimizer().sweep(make_workload("chat", 20, 0), [16, 64], attention=False, progress=False)
    assert [r["block_size"] for r in out["rows"]] == [16, 64]
    assert out["recommendations"] == {g: ref.recommend(g) for g in GOALS}
    assert out["recommended"] == ref.recommend("memory_efficient") and out["goal"] == "memory_efficient"
    assert out["costs"] == {str(b): pytest.approx(c) for b, c in ref.costs("memory_efficient").items()}
    assert [r["waste"] for r in out["rows"]] == pytest.approx([r.waste for r in ref.rows])
    assert all(r["attention_ms"] is None for r in out["rows"])  # not measured: null, not NaN


def test_demo_json_holds_the_report():
    p = run("demo", "--json")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    out = json.loads(p.stdout)
    assert set(out["engine"]) == {"paged", "contiguous"} and out["engine"]["paged"]["finished"] == 1000
    assert set(out["prefetch"]) and out["claims"]
    assert all({"text", "baseline", "measured", "value", "threshold", "supported"} <= set(c) for c in out["claims"])
    assert all(c["supported"] == (c["value"] >= c["threshold"]) for c in out["claims"])


def test_bench_writes_a_file_only_with_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "bench_sizing", "--quick", "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {r["benchmark"] for r in result["rows"]} == {"bench_sizing"} and list(tmp_path.iterdir()) == []
    assert cli.main(["bench", "bench_sizing", "--quick", "--no-progress", "--out", "rows.json"]) == 0
    printed = capsys.readouterr().out
    assert "| benchmark | figure |" in printed and "wrote rows.json" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]
    assert {r["benchmark"] for r in json.loads((tmp_path / "rows.json").read_text())["rows"]} == {"bench_sizing"}


# ---------------------------------------------------------------------------------------------------- chapters
def test_chapters_copies_the_course_and_never_overwrites_unasked(tmp_path, capsys):
    from kvlab.app.resources import chapter_notebooks, shipped

    src, dest = shipped("chapters"), tmp_path / "course"
    assert cli.main(["chapters", str(dest), "--no-solutions"]) == 0
    assert sorted(p.relative_to(dest) for p in dest.rglob("*.ipynb")) == chapter_notebooks(solutions=False)
    (dest / "index.ipynb").write_text("my notes")
    before = {p: p.read_bytes() for p in dest.rglob("*")}
    assert cli.main(["chapters", str(dest)]) == 2
    assert "already in" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in dest.rglob("*")} == before  # refused: nothing written, not even solutions/
    assert cli.main(["chapters", str(dest), "--force"]) == 0
    names = chapter_notebooks()
    assert any(n.parts[0] == "solutions" for n in names)
    assert sorted(p.relative_to(dest) for p in dest.rglob("*.ipynb")) == names
    assert all((dest / n).read_bytes() == (src / n).read_bytes() for n in names)


def test_the_copied_course_carries_everything_its_links_point_at(tmp_path):
    """``kvlab chapters DEST``: every relative link of every notebook and Markdown file copied resolves in DEST."""
    import nbformat

    dest = tmp_path / "course"
    assert cli.main(["chapters", str(dest)]) == 0
    assert {"GLOSSARY.md", "TEACHING.md"} <= {p.name for p in dest.glob("*.md")}
    dead = []
    for f in sorted(dest.rglob("*.ipynb")) + sorted(dest.glob("*.md")):
        text = f.read_text(encoding="utf-8") if f.suffix == ".md" else "\n".join(
            c.source for c in nbformat.read(f, as_version=4).cells if c.cell_type == "markdown")
        dead += [(f.name, t) for t in re.findall(r"\]\(([^)#\s]+)", text)
                 if not re.match(r"[a-z]+:", t) and not (f.parent / t).exists()]
    assert not dead


# ---------------------------------------------------------------------------------------------------- lab
@pytest.mark.parametrize("as_root, no_browser", [(False, False), (True, False), (False, True), (True, True)])
def test_lab_command_line_for_root_and_headless(tmp_path, as_root, no_browser):
    from kvlab.app.lab import lab_argv

    argv = lab_argv(tmp_path, "chapters/index.ipynb", port=9999, token="t0k", as_root=as_root,
                    no_browser=no_browser)
    assert argv[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={tmp_path}" in argv  # the whole folder, not the notebook's
    assert "--LabApp.default_url=/lab/tree/chapters/index.ipynb" in argv
    assert ("--allow-root" in argv) == as_root and ("--no-browser" in argv) == no_browser
    assert "--ServerApp.port=9999" in argv and "--IdentityProvider.token=t0k" in argv


def test_lab_finds_a_display_or_not():
    from kvlab.app.lab import headless

    assert headless({}, "linux") and headless({"DISPLAY": ""}, "linux")
    assert not headless({"DISPLAY": ":0"}, "linux") and not headless({"WAYLAND_DISPLAY": "wayland-0"}, "linux")
    assert not headless({}, "darwin") and not headless({}, "win32") and not headless({"BROWSER": "w3m"}, "linux")


def test_lab_serves_the_folder_and_opens_the_index(tmp_path):
    """A real launch: ``kvlab lab`` on a folder made by ``kvlab chapters``; the printed URL answers, and the server
    lists the folder's notebooks. The server is stopped whatever happens."""
    import signal
    import urllib.request

    assert run("chapters", str(tmp_path / "course")).returncode == 0
    p = subprocess.Popen([sys.executable, "-m", "kvlab", "lab", str(tmp_path / "course"), "--port", "18999",
                          "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, "KVLAB_DEVICE": "cpu", "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
                              "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}, start_new_session=True)
    try:
        first, second = p.stdout.readline(), p.stdout.readline()
        assert first.strip() == f"kvlab lab: serving {tmp_path / 'course'}"
        url = second.strip().removeprefix("kvlab lab: open ")
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/lab/tree/index\.ipynb\?token=[0-9a-f]{48}", url), url
        base, token = url.split("/lab/")[0], url.rsplit("=", 1)[1]
        import time

        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                if time.monotonic() > deadline or p.poll() is not None:
                    raise
                time.sleep(0.5)
        with urllib.request.urlopen(f"{base}/api/contents?token={token}", timeout=10) as r:
            listing = {c["name"] for c in json.loads(r.read())["content"]}
        assert {"index.ipynb", "solutions"} <= listing
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.parametrize("ip", ["0.0.0.0", "::", ""])
def test_lab_url_shows_a_wildcard_address_as_the_machine_name(monkeypatch, ip):
    """Listening on every interface (``0.0.0.0``, ``::`` or empty) is no address a browser can open: the URL names
    the machine instead (never ``http://[::]:...``)."""
    from kvlab.app import lab

    monkeypatch.setattr(lab.socket, "gethostname", lambda: "gpu-box")
    assert lab.lab_url(ip, 8890, "chapters/index.ipynb", "t0k") == \
        "http://gpu-box:8890/lab/tree/chapters/index.ipynb?token=t0k"


@pytest.mark.parametrize("ip,host", [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]"), ("10.0.0.7", "10.0.0.7")])
def test_lab_url_keeps_a_specific_address(monkeypatch, ip, host):
    """A specific address is the one to open, an IPv6 one in brackets."""
    from kvlab.app import lab

    monkeypatch.setattr(lab.socket, "gethostname", lambda: "gpu-box")
    assert lab.lab_url(ip, 8890, "index.ipynb", "t0k") == f"http://{host}:8890/lab/tree/index.ipynb?token=t0k"


def test_json_output_writes_nan_and_infinities_as_null(capsys):
    """``--json`` output is strict JSON: NaN, +inf and -inf (python floats or numpy scalars, at any depth) are
    null, finite numbers stay numbers."""
    import numpy as np

    cli._print_json({"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "ok": 1.5,
                     "rows": [np.float64("inf"), (np.float32("-inf"), np.int64(3))]})
    out = capsys.readouterr().out
    assert out == '{"nan": null, "inf": null, "-inf": null, "ok": 1.5, "rows": [null, [null, 3]]}\n'
    assert json.loads(out)["rows"] == [None, [None, 3]]


@pytest.mark.parametrize("device", ["meta", "cuda:7" if __import__("torch").cuda.is_available() else "cuda",
                                    "tpu", "cuda" if __import__("torch").cuda.is_available() else "cpu:bogus"])
def test_disagg_refuses_a_device_it_would_not_run_on(device, capsys):
    """Two local ranks run on the CPU over gloo: a device they would ignore (or this machine lacks) is an error,
    not a run that exits 0 on something else."""
    assert cli.main(["disagg", "--device", device, "--prompts", "1", "--prompt-len", "4"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device" in err and "Traceback" not in err, err


@pytest.mark.parametrize("name", ["../kvlab/__init__", "/etc/passwd", "bench_pool.py", str(REPO / "benchmarks" /
                                                                                      "bench_sizing"), ""])
def test_bench_runs_its_own_benchmarks_only_never_a_path(name, tmp_path, capsys, monkeypatch):
    """``kvlab bench NAME`` takes a benchmark's name; a path (even to a benchmark) imports nothing."""
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    for arg in (name, str(evil), str(evil.with_suffix(""))):
        assert cli.main(["bench", arg]) != 0
        err = capsys.readouterr().err
        assert "unknown benchmark" in err and "Traceback" not in err, err
    assert not (tmp_path / "ran").exists()
