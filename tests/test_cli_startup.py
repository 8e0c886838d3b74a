"""kvlab starts at once and ends in one line (issue 36).

``import kvlab``, ``kvlab --help`` and ``kvlab --version`` import no torch (the ``kvlab`` module loads each public
name on first use, PEP 562), yet every name of ``__all__`` is the object it always was; Ctrl-C while the command
starts (torch importing) or runs is one line and exit 130; ``kvlab run --trace NAME`` fits its sizes to the trace
and says so; and a grid of bad arguments to the real commands each ends in one stderr line, exit 2 (bad use) or 1
(failure), with nothing written. Whether torch was imported is read from ``sys.modules`` in a child process,
never from a time.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab
from kvlab.app import cli
from kvlab.workloads.traces import DATA, TRACES

ENV = {**os.environ, "KVLAB_DEVICE": "cpu"}
HEAVY = ("torch", "numpy")


def as_from_a_terminal() -> None:
    """The child's Ctrl-C as a terminal gives it: a suite started in the background of a shell without job control
    (`make test &`) inherits SIGINT ignored, and Python then leaves it ignored in every child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def python(code: str, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env or ENV,
                          cwd=cwd, timeout=300, preexec_fn=as_from_a_terminal)


# ---------------------------------------------------------------------------------------------------- no torch
def test_import_kvlab_imports_no_torch_until_a_name_needs_it():
    p = python("import sys, kvlab\n"
               "from kvlab import ConfigError, KVLabError, __version__\n"
               f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
               "kvlab.BlockPool\n"
               f"print([m for m in {HEAVY!r} if m in sys.modules])\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["[]", "['torch', 'numpy']"]  # the pool does need both: the check can fail


CHECK_MAIN = ("import sys\n"
              "from kvlab.app.cli import main\n"
              "try:\n"
              "    code = main(sys.argv[1:])\n"
              "except SystemExit as e:\n"
              "    code = e.code\n"
              "print('imported:', sorted(m for m in ('torch', 'numpy') if m in sys.modules), file=sys.stderr)\n"
              "raise SystemExit(code)\n")


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["-h"], 0), (["--version"], 0), ([], 2),
                                        (["frobnicate"], 2)])
def test_help_version_and_a_bad_command_import_no_torch(args, code):
    p = python(CHECK_MAIN, *args)
    assert p.returncode == code, p.stderr
    assert p.stderr.splitlines()[-1] == "imported: []", p.stderr
    if args == ["--version"]:
        assert p.stdout.startswith(f"kvlab {kvlab.__version__}; FastBlockPool: ") and p.stdout.count("\n") == 1
    if args[:1] == ["--help"]:
        assert all(f"    {name}" in p.stdout for name in cli._COMMANDS), p.stdout  # every command still listed


def test_a_command_does_import_torch():
    """The same probe on a command that needs torch sees it: the test above can fail."""
    p = python(CHECK_MAIN, "run", "--requests", "2", "--no-progress")
    assert p.returncode == 0 and p.stderr.splitlines()[-1] == "imported: ['numpy', 'torch']", p.stderr


def test_the_console_script_imports_no_torch_for_help():
    """``kvlab --help`` through the installed entry point, its imports listed by Python itself (-X importtime)."""
    exe = Path(sys.executable).with_name("kvlab")
    assert exe.exists(), f"the kvlab console script is not installed next to {sys.executable}"
    for flag in ("--help", "--version"):
        p = subprocess.run([str(exe), flag], capture_output=True, text=True, timeout=300,
                           env={**ENV, "PYTHONPROFILEIMPORTTIME": "1"})
        imported = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
        assert p.returncode == 0 and "kvlab.app.cli" in imported, p.stderr[-500:]
        assert not {m for m in imported if m.split(".")[0] in HEAVY}, sorted(imported)


# ---------------------------------------------------------------------------------------------------- lazy kvlab
def _typing_imports() -> dict[str, tuple[str, str]]:
    """Public name -> (module, attribute) as the ``if TYPE_CHECKING:`` block of kvlab/__init__.py imports it."""
    tree = ast.parse(Path(kvlab.__file__).read_text(encoding="utf-8"))
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    out = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for a in node.names:
            out[a.asname or a.name] = (node.module or "", a.name)
    return out


def test_the_lazy_table_the_typing_imports_and_all_agree():
    """Three lists of one set of names: what __getattr__ loads, what mypy and IDEs read, and __all__."""
    lazy = {**{n: (m, kvlab._RENAMED.get(n, n)) for n, m in kvlab._WHERE.items()},
            **{n: tuple(m.rsplit(".", 1)) for n, m in kvlab._MODULE_NAMES.items()}}
    assert lazy == _typing_imports()
    assert sorted(lazy) == sorted(kvlab.__all__) and len(set(kvlab.__all__)) == len(kvlab.__all__)


@pytest.mark.parametrize("name", sorted(kvlab.__all__))
def test_every_public_name_is_the_object_its_module_defines(name):
    module, attribute = _typing_imports()[name]
    source = importlib.import_module(module)
    expected = getattr(source, attribute) if hasattr(source, attribute) else importlib.import_module(
        f"{module}.{attribute}")
    assert getattr(kvlab, name) is expected
    assert name in dir(kvlab)
    namespace: dict = {}
    exec(f"from kvlab import {name}", namespace)
    assert namespace[name] is expected


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'BlockPol'"):
        kvlab.BlockPol
    with pytest.raises(ImportError):
        exec("from kvlab import BlockPol", {})
    assert kvlab.__version__ and isinstance(kvlab.hotpath_compiled, bool)


def test_star_import_and_dotted_paths_work_after_a_bare_import():
    """As with the eager ``kvlab`` of before: ``import *`` gives __all__, and a folder read through ``kvlab``
    (``kvlab.core.checks``, ``kvlab.memory.sizing``) comes with its modules."""
    p = python("import kvlab\n"
               "print(kvlab.core.checks.SEED_MAX, kvlab.memory.sizing.GOALS[0],\n"
               "      'smollm2-135m' in kvlab.serve.loader.MODELS)\n"
               "ns = {}\n"
               "exec('from kvlab import *', ns)\n"
               "print(sorted(set(kvlab.__all__) - set(ns)))\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"{2**64 - 1} memory_efficient True", "[]"]


# ---------------------------------------------------------------------------------------------------- --version
def test_version_reports_the_compiled_parts_as_kvlab_loads_them(monkeypatch):
    """The --version line (worked out without torch) agrees with what kvlab.fast loads."""
    from kvlab.fast.attention import DECODE_KERNEL_COMPILED
    from kvlab.fast.pool import COMPILED

    line = cli.version_line()
    assert line.startswith(f"kvlab {kvlab.__version__}; FastBlockPool: ") and "\n" not in line
    assert ("FastBlockPool: compiled (kvlab/fast/_fastpath.c)" in line) == COMPILED, line
    assert ("CPU paged decode: compiled (kvlab/fast/_paged_attention.c)" in line) == DECODE_KERNEL_COMPILED, line
    monkeypatch.setenv("KVLAB_PURE_PYTHON", "1")
    line = cli.version_line()
    assert "FastBlockPool: pure Python" in line and "KVLAB_PURE_PYTHON" in line, line


def test_version_names_a_binary_older_than_its_source(tmp_path):
    """A checkout whose _fastpath.c changed after the build: --version says so, as the import warns."""
    src = Path(kvlab.__file__).parent
    shutil.copytree(src, tmp_path / "kvlab", ignore=shutil.ignore_patterns("__pycache__", "data"))
    c_file = tmp_path / "kvlab" / "fast" / "_fastpath.c"
    c_file.write_text(c_file.read_text() + "\n/* edited */\n")
    p = python("import kvlab, sys; from kvlab.app.cli import main; sys.exit(main(['--version']))", cwd=tmp_path,
               env={k: v for k, v in ENV.items() if k != "KVLAB_PURE_PYTHON"})
    assert p.returncode == 0 and p.stderr == "", p.stderr
    from kvlab.fast.pool import COMPILED

    assert "FastBlockPool: pure Python (no compiled kvlab/fast/_fastpath.c)" in p.stdout, p.stdout
    assert not COMPILED or "_fastpath.c changed after it was compiled" in p.stdout, p.stdout


# ---------------------------------------------------------------------------------------------------- Ctrl-C
INTERRUPT_AT = ("import builtins, os, signal, sys\n"
                "real = builtins.__import__\n"
                "def hook(name, *args, **kwargs):\n"
                "    if name == sys.argv[1]:\n"
                "        builtins.__import__ = real\n"
                "        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as this module starts importing\n"
                "    return real(name, *args, **kwargs)\n"
                "builtins.__import__ = hook\n"
                "from kvlab.app.cli import main\n"
                "raise SystemExit(main(sys.argv[2:]))\n")


@pytest.mark.parametrize("module", ["numpy", "torch", "kvlab.workloads.traces", "kvlab.serve.engine", "tqdm"])
def test_ctrl_c_while_the_command_starts_is_one_line_and_130(module):
    """SIGINT as each module of ``kvlab run`` starts importing (numpy and torch while the arguments are declared,
    the engine in the handler, tqdm as the run starts): one line, exit 130, never a traceback."""
    p = python(INTERRUPT_AT, module, "run", "--requests", "20", "--no-progress")
    assert (p.returncode, p.stderr) == (130, "kvlab run: interrupted\n"), (p.returncode, p.stderr)


def test_ctrl_c_from_a_terminal_at_any_moment_is_one_line_and_130():
    """A real SIGINT, sent once the command line module is imported (the first instants are Python's own), and
    again later: whatever the child was doing (importing torch, building, running), one line and 130."""
    for delay in (0.0, 1.0):
        child = subprocess.Popen([sys.executable, "-m", "kvlab", "run", "--requests", "200000", "--no-progress"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**ENV, "PYTHONPROFILEIMPORTTIME": "1"}, preexec_fn=as_from_a_terminal)
        assert child.stderr is not None
        for line in child.stderr:  # -X importtime lists each import as it ends
            if line.rstrip().endswith("| kvlab.app.cli"):
                break
        if delay:
            try:
                child.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                pass
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=300)
        lines = [ln for ln in err.splitlines() if not ln.startswith("import time:")]
        # "kvlab: interrupted" where the signal came before the command's name was read
        assert child.returncode == 130 and lines in (["kvlab run: interrupted"], ["kvlab: interrupted"]), \
            (child.returncode, err[-2000:])


# ---------------------------------------------------------------------------------------------------- run --trace
@pytest.mark.parametrize("name", sorted(TRACES))
def test_run_a_bundled_trace_with_no_other_flag(name, monkeypatch, capsys):
    """``kvlab run --trace NAME`` alone: the first requests of the trace (fewer here than the 1,000 of the command,
    to keep the test short) run with sizes fitted to them, and the output says which and why."""
    from kvlab import load_trace

    monkeypatch.setattr(cli, "RUN_REQUESTS", 60)
    assert cli.main(["run", "--trace", name, "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    first = load_trace(name).requests[:60]
    longest = max(r.total_len for r in first)
    sizes = out["sizes"]
    assert out["finished"] == out["requests"] == sizes["requests"] == 60
    assert sizes["source_requests"] == len(load_trace(name).requests) and sizes["longest_request"] == longest
    assert sizes["max_model_len"] == max(2048, longest)
    assert sizes["num_blocks"] == max(4096, cli.LONGEST_AT_ONCE * -(-longest // 16))
    assert cli.main(["run", "--trace", name, "--no-progress"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"{name}: the first 60 of ") and "(--requests)" in line, line
    assert f"max_model_len {max(2048, longest):,} (" in line and "--max-model-len" in line and "--blocks" in line


@pytest.mark.parametrize("args, word", [
    (["--max-model-len", "2048"], "give --max-model-len 8030 or more"),  # request 2: 7,236 + 794 tokens
    (["--blocks", "100"], "give --blocks 502 or more"),  # the same request, 16 tokens a block
    (["--blocks", "510", "--block-size", "16", "--baseline", "--max-model-len", "9000"], "give --blocks 563 or more"),
])
def test_a_size_too_small_for_the_trace_names_the_flag_and_the_least_that_works(args, word, capsys):
    assert cli.main(["run", "--trace", "mooncake-conversation", "--requests", "5", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and word in err, err


# ---------------------------------------------------------------------------------------------------- bad input
def _tree(root: Path) -> dict:
    return {p.relative_to(root): (p.is_dir(), p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def _bad_runs(tmp: Path) -> list[tuple[list[str], int, tuple[str, ...]]]:
    """``(argv, exit code, words of the message)``: bad arguments to the real commands, none of which may write."""
    file, moon, azure = str(tmp / "a-file"), str(DATA / TRACES["mooncake-conversation"]), str(
        DATA / TRACES["azure-code-2023"])
    runs = [
        (["chapters", "/proc/x"], 2, ("DEST", "'/proc/x'", "takes no new files")),
        (["chapters", file], 2, ("DEST", "is a file, not a folder")),
        (["chapters", f"{file}/course"], 2, ("DEST", "is not a folder")),
        (["html", "--out", file], 2, ("--out", "is a file, not a folder")),
        (["html", "--out", "/proc/site"], 2, ("--out", "'/proc/site'")),
        (["lab", "--port", "99999", "--dry-run"], 2, ("--port", "too large", "65,535")),
        (["bench", "--out", "/proc/rows.json", "--quick"], 2, ("--out", "'/proc/rows.json'")),
        (["sweep", "--plot", "/proc/x.png", "--no-progress"], 2, ("--plot", "'/proc/x.png'")),
        (["exercise", "2.2.4-moves", "-s", "99999999999"], 2, ("--seed", "too large")),
        (["run", "--trace", moon, "--format", "azure", "--no-progress"], 2, ("line 1", "--format mooncake")),
        (["sweep", "--trace", azure, "--format", "mooncake", "--no-progress"], 2, ("line 1", "--format azure")),
        (["run", "--trace", str(tmp / "none.csv"), "--no-progress"], 2, ("cannot read trace",)),
        (["run", "--requests", "3", "--blocks", "100", "--baseline", "--no-progress"], 2, ("--blocks 128",)),
    ]
    for command in ("run", "sweep"):  # a count beyond kvlab's int32 sizes: "too large" and the most there is
        for value in ("99999999999999999999", "9" * 5000):
            runs.append(([command, "--requests", value], 2, ("--requests", "too large", "2,147,483,647")))
    return runs


def _exit_code(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse refuses by exiting
        return int(e.code or 0)


def test_bad_arguments_to_the_real_commands_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    """Each bad argument, given to the command itself (not a stand-in): exit 2 or 1, exactly one line on stderr
    naming what to change, no traceback, and nothing written in the folder it ran in or anywhere under tmp."""
    (tmp_path / "a-file").write_text("x")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    for argv, code, words in _bad_runs(tmp_path):
        got = _exit_code(argv)
        err = capsys.readouterr().err
        assert got == code, (argv[:4], got, err)
        assert err.count("\n") == 1 and "Traceback" not in err and err.startswith(f"kvlab {argv[0]}: error: "), err
        assert all(w in err for w in words), (argv[:4], err)
        assert _tree(tmp_path) == before, argv[:4]


def test_html_without_the_lab_extra_says_what_to_install_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """``kvlab html`` where nbclient is missing: one line naming the extra, exit 1 (nothing wrong with the
    arguments), and no site folder, not even an empty one."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nbclient" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["html", "--out", "site", "--fast"]) == 1
    err = capsys.readouterr().err
    assert err == 'kvlab html: error: this needs nbclient, which is not installed: pip install "kvlab[lab]"\n'
    assert list(tmp_path.iterdir()) == []


def test_a_missing_optional_module_while_running_is_one_line(monkeypatch, capsys):
    """An optional dependency found missing only as a command runs (not checked ahead) is still one line,
    exit 1, naming the extra."""
    def needs_gguf(args):
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

    help_, configure, _ = cli._COMMANDS["demo"]
    monkeypatch.setitem(cli._COMMANDS, "demo", (help_, configure, needs_gguf))
    assert cli.main(["demo"]) == 1
    assert capsys.readouterr().err == ('kvlab demo: error: this needs gguf, which is not installed: '
                                       'pip install "kvlab[llm]"\n')


def test_an_os_error_while_running_is_one_line_naming_the_path(monkeypatch, capsys):
    """A file that fails as the command runs (after the checks): exit 1, the path and the reason in words, not
    ``[Errno 13]``."""
    def denied(args):
        raise PermissionError(13, "Permission denied", "/srv/course/index.ipynb")

    help_, configure, _ = cli._COMMANDS["demo"]
    monkeypatch.setitem(cli._COMMANDS, "demo", (help_, configure, denied))
    assert cli.main(["demo"]) == 1
    assert capsys.readouterr().err == "kvlab demo: error: '/srv/course/index.ipynb': permission denied\n"
