"""The ``kvlab`` command line (also ``python -m kvlab``).

Each subcommand is one function registered with :func:`command`, next to a function that declares its
arguments; :func:`main` builds the parser from the registry. Adding ``kvlab run`` or ``kvlab bench`` is one more
registered pair. Exit codes: 0 success, 2 bad arguments or bad input (argparse's convention; the message says
which), 1 any other kvlab error or a file that could not be read or written while the command ran, 130
interrupted (at any moment, start-up included), 141 the reader of stdout went away. Every error is one line on
stderr, and a command that fails or is interrupted leaves no file half-written.

Start-up is quick: this module imports no torch, only the chosen command's arguments are declared (they may
import torch), and heavy modules are imported inside the handlers, so ``kvlab --help`` and ``kvlab --version``
answer at once (tests/test_cli_startup.py checks that neither imports torch).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvlab.core.errors import ConfigError, KVLabError

if TYPE_CHECKING:
    from kvlab.workloads.mixes import Workload

Handler = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]
_COMMANDS: dict[str, tuple[str, Configure, Handler]] = {}
INT32_MAX = 2**31 - 1  # kvlab's counts, sizes and ids are int32 (kvlab.core.checks.INT32_MAX, which imports torch)
# Optional modules -> the extra of kvlab that installs them (pyproject.toml), for a one-line "install this".
EXTRAS = {"jupyterlab": "lab", "ipykernel": "lab", "nbformat": "lab", "nbclient": "lab", "nbconvert": "lab",
          "mistune": "lab", "anywidget": "widgets", "ipywidgets": "widgets", "gguf": "llm", "tokenizers": "llm",
          "jinja2": "llm", "zmq": "events", "msgspec": "events"}


def command(name: str, help: str, configure: Configure) -> Callable[[Handler], Handler]:
    """Decorator: register ``handler`` as ``kvlab NAME``. ``configure(parser)`` declares its arguments;
    ``handler(args)`` runs it and returns the exit code."""
    def register(handler: Handler) -> Handler:
        if name in _COMMANDS:
            raise ConfigError(f"kvlab command {name!r} is registered twice")
        _COMMANDS[name] = (help, configure, handler)
        return handler
    return register


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: the usage block it prints by default buries the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def version_line() -> str:
    """What ``kvlab --version`` prints: kvlab's version and which of its compiled parts run, and if one does not,
    why and what fixes it (:func:`kvlab.fast.compiled.compiled_report`; neither imports torch)."""
    from kvlab import __version__
    from kvlab.fast.compiled import compiled_report

    return f"kvlab {__version__}; {compiled_report()}"


class _Version(argparse.Action):
    """``--version``: :func:`version_line`, worked out only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvlab`` parser, every command listed; the arguments are declared for ``commands`` only (None: all).
    :func:`main` declares those of the command it runs: declaring some imports torch."""
    parser = _Parser(prog="kvlab", description="See how a paged KV cache works.")
    parser.add_argument("--version", action=_Version,
                        help="print kvlab's version and whether its compiled parts are in use, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, configure, handler) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if commands is None or name in commands:
            configure(p)
            p.set_defaults(handler=handler)
    return parser


def _chosen(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word, since ``kvlab``'s own options (--help, --version) take none."""
    words = [a for a in argv if not a.startswith("-")]
    return words[0] if words and words[0] in _COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code. A user error ends
    in one line on stderr and a non-zero code, never a traceback; so does Ctrl-C, with 130, even while the
    command starts (torch importing); a reader that closed the pipe (``kvlab demo | head -1``) ends the command
    quietly with 141, as a shell's SIGPIPE would."""
    prog = "kvlab"
    try:  # from the first line: Ctrl-C lands anywhere
        argv = sys.argv[1:] if argv is None else list(argv)
        name = _chosen(argv)
        prog = f"kvlab {name}" if name else "kvlab"
        args = build_parser([name] if name else []).parse_args(argv)
        code = args.handler(args)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
        return int(code)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except KVLabError as e:  # bad input found after parsing: a trace file, a size the pool refuses
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError | ValueError) else 1
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit: point stdout at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a file the command read or wrote as it ran: gone, unwritable, a full disk
        print(f"{prog}: error: {_os_error(e)}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # an optional dependency (the checks before the work name most of them)
        if (e.name or "kvlab").partition(".")[0] == "kvlab":
            raise  # a part of kvlab itself missing is a broken install or a bug: the traceback says where
        print(f"{prog}: error: {_missing(e.name or str(e))}", file=sys.stderr)
        return 1
    except MemoryError:  # a size this machine cannot hold (kvlab run --requests 2000000000)
        print(f"{prog}: error: out of memory; ask for fewer requests, blocks or sizes", file=sys.stderr)
        return 1


def _reason(e: OSError) -> str:
    """Why the OS refused, in words: ``permission denied``."""
    reason = (e.strerror or str(e)).rstrip(".")
    return reason[:1].lower() + reason[1:]


def _os_error(e: OSError) -> str:
    """An OSError in words, naming the path(s): ``'/x/y': permission denied`` rather than ``[Errno 13] ...``."""
    paths = [repr(os.fsdecode(f)) for f in (e.filename, e.filename2) if f is not None]
    return f"{' -> '.join(paths)}: {_reason(e)}" if paths else _reason(e)


def _missing(module: str) -> str:
    """The line for an optional module that is not installed, naming the extra that brings it."""
    top = module.partition(".")[0]
    extra = EXTRAS.get(top)
    fix = f'pip install "kvlab[{extra}]"' if extra else f"pip install {top}"
    return f"this needs {top}, which is not installed: {fix}"


def require(*modules: str) -> None:
    """Refuse (:class:`~kvlab.KVLabError`, exit 1) before any work when an optional module is not installed,
    naming the extra to install; checked without importing them."""
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise KVLabError(_missing(module))


# ---------------------------------------------------------------------------------------------------- arguments
def _int(text: str, lo: int, hi: int, what: str) -> int:
    """``text`` as an int in ``lo..hi``, else an argparse error in words: not an integer, too small, or too large
    and the most there is (not Python's "int of 67 bits"; a number of thousands of digits is too large too)."""
    shown = text if len(text) <= 30 else f"{text[:20]}... ({len(text)} characters)"
    try:
        value = int(text)
    except ValueError:
        digits = text.strip().removeprefix("-").removeprefix("+")
        if not (digits.isdigit() and digits.isascii()):
            raise argparse.ArgumentTypeError(f"{shown!r} is not an integer") from None
        value = -(hi + 1) if text.strip().startswith("-") else hi + 1  # past Python's limit on digits
    if value > hi:
        raise argparse.ArgumentTypeError(f"{shown} is too large: {what} is at most {hi:,}")
    if value < lo:
        raise argparse.ArgumentTypeError(f"{shown} is not {what}" + (f" (at least {lo})" if lo > 1 else ""))
    return value


def _positive_int(text: str) -> int:
    """A count or size: 1..:data:`INT32_MAX`."""
    return _int(text, 1, INT32_MAX, "a positive integer")


def _port(text: str) -> int:
    """A TCP port to listen on, 1..65535 (0 would let the system choose; ``kvlab lab`` finds a free one itself)."""
    return _int(text, 1, 65535, "a port")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive finite number")
    return value


def _device(text: str) -> str:
    """A torch device this machine has (``cpu``, ``cuda``, ``cuda:1``), checked before any work starts."""
    from kvlab.core.checks import check_device  # imports torch: not for --help

    try:
        check_device(text, "--device")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _path(text: str) -> str:
    """A file or folder name the OS can take (argv from a shell never holds NUL, a call to main may)."""
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} holds a NUL character, which no path can")
    return text


def _writable(folder: str) -> str | None:
    """Why nothing can be made in ``folder`` (an existing folder), or None: found by making a file there and
    removing it, since permissions do not tell (root may write anywhere by them, yet not into /proc)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvlab-probe-", dir=folder)
    except OSError as e:
        return _reason(e)
    os.close(fd)
    os.unlink(probe)
    return None


def _output_file(text: str) -> str:
    """A file to write: its folder must exist and take files, so a long run does not fail at its last step."""
    _path(text)
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {folder!r} does not exist")
    why = _writable(folder)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {folder!r} takes no new files ({why})")
    return text


def _output_folder(text: str) -> str:
    """A folder to write into: one that takes files, or one that can be made (its nearest existing parent takes
    files), checked before any work; nothing is made here."""
    _path(text)
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    parent = path
    while not os.path.isdir(parent):
        if os.path.lexists(parent):  # a file (or a broken link) where a folder would have to be made
            raise argparse.ArgumentTypeError(f"cannot make folder {text!r}: {parent!r} is not a folder")
        parent = os.path.dirname(parent)
    why = _writable(parent)
    if why:
        verb = "write into" if parent == path else "make"
        raise argparse.ArgumentTypeError(f"cannot {verb} folder {text!r}: {parent!r} takes no new files ({why})")
    return text


def _write_whole(path: str, write: Callable[[str], object]) -> None:
    """``write(name)`` into a new file beside ``path``, renamed over it once complete: a failure or an interrupt
    leaves ``path`` as it was, never half-written. The name keeps ``path``'s suffix (matplotlib reads it)."""
    folder, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=os.path.splitext(base)[1], dir=folder)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; the file gets the mode a plain open gives
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _figure_file(text: str) -> str:
    """:func:`_output_file` in a format matplotlib writes (by its suffix: .png, .svg, .pdf, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if os.path.splitext(text)[1].lstrip(".").lower() not in formats:
        raise argparse.ArgumentTypeError(f"{text!r}: a figure is written as one of {', '.join(sorted(formats))}")
    return _output_file(text)


def _seed(text: str) -> int:
    """A workload's or a model's seed, 0..2**32 - 1."""
    return _int(text, 0, 2**32 - 1, "a seed")


def _sizes(text: str) -> list[int]:
    """``"16,32,64"`` -> ``[16, 32, 64]``: distinct positive ints."""
    sizes = [_positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not sizes or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"{text!r} must be distinct positive integers separated by commas")
    return sizes


def _workload_args(p: argparse.ArgumentParser, requests: int, trace_requests: int | None = None) -> None:
    """Where the requests come from: a generated scenario (``--workload``, ``--requests``, ``--seed``) or a trace
    (``--trace`` a bundled name or a file, ``--format``, ``--requests`` its first N: ``trace_requests`` unless
    given, None for all)."""
    from kvlab.workloads.traces import FORMATS, trace_names
    from kvlab.workloads.mixes import ALIASES, WORKLOADS

    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=[*WORKLOADS, *ALIASES], help="generated scenario (default: chat)")
    src.add_argument("--trace", type=_path, metavar="NAME|PATH",
                     help=f"a bundled trace ({', '.join(trace_names())}) or a trace file (Azure CSV, Mooncake JSONL, "
                          "kvlab JSONL/CSV; .gz too) instead of a generated workload")
    p.add_argument("--format", choices=FORMATS, default=None, help="the trace file's format (default: detected)")
    if trace_requests == requests:
        said = f"requests to generate, or the first N of a trace (default: {requests})"
    else:
        first = "all" if trace_requests is None else f"{trace_requests}"
        said = f"requests to generate (default: {requests}), or the first N of a trace (default: {first})"
    p.add_argument("--requests", type=_positive_int, default=None, metavar="N", help=said)
    p.add_argument("--seed", type=_seed, default=0, help="workload seed (default: 0)")
    p.set_defaults(default_requests=requests, trace_requests=trace_requests)


def _load(args: argparse.Namespace, rate: float | None = None) -> tuple[Workload, int]:
    """The workload the arguments name, and how many requests its source holds (a trace's whole length)."""
    from kvlab.workloads.traces import load_trace
    from kvlab.workloads.mixes import Workload, make_workload

    if args.trace is None:
        if args.format is not None:
            raise ConfigError("--format describes a trace file: give it with --trace")
        name, n = args.workload or "chat", args.requests or args.default_requests
        w = make_workload(name, n, args.seed) if rate is None else make_workload(name, n, args.seed, rate=rate)
        return w, n
    workload = load_trace(args.trace, args.format)
    total, first = len(workload.requests), args.requests or args.trace_requests
    if first is not None and first < total:
        workload = Workload(workload.name, workload.requests[:first])
    return workload, total


def _workload(args: argparse.Namespace, rate: float | None = None) -> Workload:
    return _load(args, rate)[0]


def _print_json(obj: Any) -> None:
    """Print ``obj`` as one line of strict JSON: numpy scalars as numbers, tuples as lists, NaN and infinities
    (a figure that was not measured) as null, which every JSON reader accepts."""
    import json

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if hasattr(v, "item") and not isinstance(v, str | bytes):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v

    print(json.dumps(plain(obj), allow_nan=False, default=str))


# ---------------------------------------------------------------------------------------------------- sweep
def _sweep_args(p: argparse.ArgumentParser) -> None:
    from kvlab.memory.sizing import DEFAULT_SIZES, GOALS

    _workload_args(p, requests=500)
    p.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES), metavar="B,B,...",
                   help="block sizes in tokens (default: %(default)s)")
    p.add_argument("--goal", choices=GOALS, default="balanced", help="cost weights for the recommendation")
    p.add_argument("--no-attention", action="store_true", help="skip timing paged attention (counts only)")
    p.add_argument("--rounds", type=_positive_int, default=5, help="attention timing rounds (median of)")
    p.add_argument("--device", type=_device, default=None,
                   help="torch device for the attention timing (default: kvlab's)")
    p.add_argument("--plot", type=_figure_file, metavar="PNG", help="also save the sweep's figure to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("sweep", "measure internal waste, bookkeeping, prefix-sharing loss and attention time per block "
                  "size on a workload, and recommend a block size (text 2.2.1)", _sweep_args)
def _sweep(args: argparse.Namespace) -> int:
    import dataclasses

    from kvlab.memory.sizing import GOALS, ChunkSizeOptimizer, plot_sweep

    workload = _workload(args)
    opt = ChunkSizeOptimizer()
    result = opt.sweep(workload, args.sizes, attention=not args.no_attention, progress=not args.no_progress,
                       rounds=args.rounds, device=args.device)
    stats = opt.sequence_length_stats
    if args.plot:
        figure = plot_sweep(result, args.goal)
        _write_whole(args.plot, lambda name: figure.savefig(name, dpi=100))
    if args.json:
        _print_json({"workload": result.workload, "requests": result.requests, "attention": result.attention,
                          "goal": args.goal, "recommended": result.recommend(args.goal),
                          "recommendations": {g: result.recommend(g) for g in GOALS},
                          "rule_of_thumb": {g: opt.recommend_chunk_size(g) for g in GOALS},
                          "sequence_lengths": stats, "costs": result.costs(args.goal),
                          "rows": [{**dataclasses.asdict(r), "waste": r.waste, "prefix_loss": r.prefix_loss}
                                   for r in result.rows], "figure": args.plot})
        return 0
    print(result.to_markdown(args.goal))
    print(f"\nsequence lengths: mean {stats['mean']:.0f}, median {stats['median']:.0f}, p95 {stats['p95']:.0f}, "
          f"max {stats['max']}")
    print("text's rule of thumb (p95): " + ", ".join(f"{g} {opt.recommend_chunk_size(g)}" for g in GOALS))
    print("measured recommendation:    " + ", ".join(f"{g} {result.recommend(g)}" for g in GOALS))
    print(f"recommended block size ({args.goal}): {result.recommend(args.goal)}")
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------------------- run, demo
RUN_REQUESTS = 1000  # requests generated, or the first of a trace, unless --requests says otherwise
LONGEST_AT_ONCE = 4  # a pool sized from the workload holds this many of its longest requests (see _fit)


def _run_args(p: argparse.ArgumentParser) -> None:
    from kvlab.workloads.race import RACE_POLICIES
    from kvlab.serve.config import EngineConfig

    d = EngineConfig()
    _workload_args(p, requests=RUN_REQUESTS, trace_requests=RUN_REQUESTS)
    p.add_argument("--rate", type=_positive_float, default=None,
                   help="arrivals per second of a generated workload (default: 200; a trace has its own times)")
    p.add_argument("--blocks", type=_positive_int, default=None,
                   help=f"pool blocks (default: {d.num_blocks}, or room for {LONGEST_AT_ONCE} of the workload's "
                        "longest requests where that is more)")
    p.add_argument("--block-size", type=_positive_int, default=d.block_size, help="tokens per block")
    p.add_argument("--policy", default=d.policy, choices=list(RACE_POLICIES),
                   help="eviction policy (opt: Belady's, knowing the workload's future)")
    p.add_argument("--preemption", default=d.preemption, choices=["recompute", "swap"])
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help=f"longest sequence; the contiguous baseline reserves this much per request (default: "
                        f"{d.max_model_len}, or the workload's longest request where that is longer)")
    p.add_argument("--max-batched-tokens", type=_positive_int, default=d.max_batched_tokens,
                   help="tokens computed per step, prompt chunks included (default: %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--shared-prefill", default=d.shared_prefill, choices=["wait", "duplicate"],
                   help="a request whose next prompt block another request is computing: wait for it (default) "
                        "or compute it again, as vLLM does")
    p.add_argument("--baseline", action="store_true", help="also run the contiguous max-length baseline")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fit(workload: Workload, total: int, args: argparse.Namespace) -> dict[str, Any]:
    """The sizes ``kvlab run`` runs ``workload`` with, and why, so that any workload runs with no size given:

    * ``max_model_len``: ``--max-model-len``, or the engine's default (2048), or the workload's longest request
      (prompt + output) where that is longer;
    * ``num_blocks``: ``--blocks``, or the engine's default (4096), or room for :data:`LONGEST_AT_ONCE` of the
      longest requests where that is more (one alone would leave the pool to it, and the rest would be preempted
      again and again), and at least one contiguous region of ``max_model_len`` with ``--baseline``.

    A size given too small for some request to ever run is refused here, naming the flag and the least value that
    works, rather than by the engine in its own terms. Returns the sizes and a line saying where each came from."""
    from kvlab.serve.config import EngineConfig

    d, B = EngineConfig(), args.block_size
    longest = max(workload.requests, key=lambda r: (r.total_len, -r.id))
    need = -(-longest.total_len // B)  # blocks the longest request holds at its end
    what = f"request {longest.id} ({longest.prompt_len:,} prompt + {longest.output_len:,} output tokens)"
    if args.max_model_len is not None and longest.total_len > args.max_model_len:
        raise ConfigError(f"{what} is longer than --max-model-len {args.max_model_len:,}: give --max-model-len "
                          f"{longest.total_len} or more, or leave it out to fit the workload")
    if args.max_model_len is not None:
        mml, mml_why = args.max_model_len, "--max-model-len"
    elif longest.total_len > d.max_model_len:
        mml, mml_why = longest.total_len, "the longest request; --max-model-len to change"
    else:
        mml, mml_why = d.max_model_len, "the default; --max-model-len to change"
    region = -(-mml // B) if args.baseline else 0  # the contiguous baseline holds max_model_len per request
    if args.blocks is not None and args.blocks < max(need, region):
        if need >= region:
            raise ConfigError(f"{what} needs {need:,} blocks of {B} tokens, more than --blocks {args.blocks:,}: give "
                              f"--blocks {need} or more (or a larger --block-size), or leave it out")
        raise ConfigError(f"--baseline reserves --max-model-len {mml:,} tokens ({region:,} blocks of {B}) for each "
                          f"request, more than --blocks {args.blocks:,}: give --blocks {region} or more, or a smaller "
                          "--max-model-len")
    if args.blocks is not None:
        blocks, blocks_why = args.blocks, "--blocks"
    elif max(LONGEST_AT_ONCE * need, region) > d.num_blocks:
        blocks = max(LONGEST_AT_ONCE * need, region)
        blocks_why = (f"room for {LONGEST_AT_ONCE} of the longest requests" if blocks > region else
                      "one --max-model-len region of the baseline") + "; --blocks to change"
    else:
        blocks, blocks_why = d.num_blocks, "the default; --blocks to change"
    n = len(workload.requests)
    requests = f"{n:,} requests" if n == total or args.trace is None else f"the first {n:,} of {total:,} requests"
    line = (f"{workload.name}: {requests} (--requests), the longest {longest.total_len:,} tokens; "
            f"max_model_len {mml:,} ({mml_why}); {blocks:,} blocks of {B} tokens ({blocks_why})")
    return {"requests": n, "source_requests": total, "longest_request": longest.total_len, "max_model_len": mml,
            "num_blocks": blocks, "block_size": B, "max_batched_tokens": args.max_batched_tokens, "line": line}


RUN_KEYS = ("requests", "finished", "prompt_tokens", "prefix_hit_tokens", "prefix_hit_rate", "prefix_hit_bound",
            "preemptions", "preempted_hit_tokens", "utilisation", "usage_by_block", "usage_by_token", "wall_s")


@command("run", "run a workload or a real trace through the paged serving engine (metadata mode) and print a "
                "summary (text 2.2.6); sizes not given are fitted to the workload and stated", _run_args)
def _run_cmd(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from kvlab.serve.metrics import format_table
    from kvlab.serve.config import EngineConfig
    from kvlab.serve.engine import Engine
    from kvlab.workloads.traces import prefix_hit_bound

    if args.trace is not None and args.rate is not None:
        raise ConfigError("--rate sets a generated workload's arrivals; a trace brings its own timestamps")
    workload, total = _load(args, rate=200.0 if args.rate is None else args.rate)
    sizes = _fit(workload, total, args)
    cfg = EngineConfig(num_blocks=sizes["num_blocks"], block_size=args.block_size, policy=args.policy,
                       preemption=args.preemption, max_model_len=sizes["max_model_len"],
                       max_batched_tokens=args.max_batched_tokens, prefix_caching=not args.no_prefix_caching,
                       shared_prefill=args.shared_prefill)
    if not args.json:
        print(sizes["line"], flush=True)  # before the run: what it runs with, while the bar moves
    rows: dict[str, dict[str, Any]] = {}
    for memory in ("paged", "contiguous") if args.baseline else ("paged",):
        t0 = time.perf_counter()
        summary = Engine(workload, dataclasses.replace(cfg, memory=memory)).run(progress=not args.no_progress)
        summary["wall_s"] = time.perf_counter() - t0
        rows[memory] = summary
    paged = rows["paged"]
    paged["prompt_tokens"] = sum(r.prompt_len for r in workload)
    paged["prefix_hit_bound"] = prefix_hit_bound(workload, args.block_size) if cfg.prefix_caching else 0
    if not args.json:
        print(format_table(rows))
        return 0
    out = {"workload": workload.name, **{k: paged[k] for k in RUN_KEYS}, "sizes": sizes, "summary": paged}
    if args.baseline:
        out["contiguous"] = rows["contiguous"]
    _print_json(out)
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all; see --list)")
    p.add_argument("--list", action="store_true", help="name the benchmarks and where they were found, run none")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test that they run, not a measurement")
    p.add_argument("--json", action="store_true", help="print the rows, machine and versions as one JSON object")
    p.add_argument("--out", type=_output_file, default=None, metavar="JSON",
                   help="also write that JSON object to this file (nothing is written unless asked)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("bench", "run the benchmarks (shipped with kvlab): one table of figures, baselines, ratios and goals",
         _bench_args)
def _bench(args: argparse.Namespace) -> int:
    from kvlab.app import bench

    if args.list:
        print(f"# in {bench.benchmarks_dir()}")
        print("\n".join(bench.available()))
        return 0
    result = bench.run_all(args.names or None, quick=args.quick, progress=not args.no_progress)
    if args.json:
        _print_json(result)
    else:
        print(bench.report(result))
    if args.out:
        _write_whole(args.out, lambda name: bench.write_json(result, name))
        print(f"wrote {args.out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _html_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", default=None, help="chapters folder (default: the chapters shipped with kvlab)")
    p.add_argument("--out", type=_output_folder, default="site", help="output folder (default: site)")
    p.add_argument("--fast", action="store_true", help="small sizes (KVLAB_FAST=1)")
    p.add_argument("--no-solutions", action="store_true", help="leave out chapters/solutions/")
    p.add_argument("--timeout", type=_positive_int, default=600, help="seconds per cell")
    p.add_argument("--ipynb", action="store_true",
                   help="write the executed notebooks (outputs kept, widget state left out) instead of HTML pages, "
                        "for readers on a code host (the checkout's docs/chapters/)")


@command("html", "execute the chapters and render them to static HTML with widget state, for a course site "
                 "that works offline (its scripts are pinned copies in the site's _kvlab/ folder)", _html_args)
def _html(args: argparse.Namespace) -> int:
    # Checked before anything is written (a missing one used to stop the site half-made).
    require("nbformat", "nbclient", "nbconvert", "mistune", "ipykernel", "anywidget", "ipywidgets")
    from kvlab.app.render import render_chapters, write_executed

    if args.ipynb:
        if args.no_solutions:
            raise ConfigError("--ipynb writes the solutions too: their links from the chapters must resolve")
        written = write_executed(args.src, args.out, fast=args.fast, timeout=args.timeout)
    else:
        written = render_chapters(args.src, args.out, fast=args.fast, solutions=not args.no_solutions,
                                  timeout=args.timeout)
    for path in written:
        print(path)
    return 0


def _chapters_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", type=_output_folder, metavar="DEST",
                   help="folder to copy the notebooks into (created if missing)")
    p.add_argument("--no-solutions", action="store_true", help="leave out solutions/")
    p.add_argument("--force", action="store_true", help="overwrite notebooks already in DEST")


@command("chapters", "copy the course notebooks (shipped with kvlab) into a folder of your own", _chapters_args)
def _chapters(args: argparse.Namespace) -> int:
    from kvlab.app.resources import copy_chapters

    written = copy_chapters(args.dest, solutions=not args.no_solutions, overwrite=args.force)
    print(f"copied {len(written)} files (notebooks, glossary, notes) into {args.dest}; start with: "
          f"kvlab lab {args.dest}")
    return 0


def _exercise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", nargs="?", metavar="KEY", help="the exercise to draw, e.g. 2.2.4-moves (none: list them)")
    p.add_argument("-s", "--seed", type=_exercise_seed, default=None,
                   help="the problem's seed (default: a fresh one, shown)")
    p.add_argument("-c", "--compute", action="store_true", help="also show the answer and how it follows")


def _exercise_seed(text: str) -> int:
    """An exercise's seed, 0..:data:`kvlab.exercises.scenarios.SEED_MAX`."""
    from kvlab.exercises.scenarios import SEED_MAX

    return _int(text, 0, SEED_MAX, "an exercise's seed")


@command("exercise", "draw a chapter's exercise afresh from a seed (-s), the answer on request (-c), as OSTEP's "
                     "simulators do", _exercise_args)
def _exercise(args: argparse.Namespace) -> int:
    from kvlab.exercises import draw, list_scenarios, prompt

    if args.key is None:
        print("\n".join(f"{k}: {prompt(k).splitlines()[0][:70]}" for k in list_scenarios()))
        return 0
    problem = draw(args.key, args.seed)
    print(problem)
    if args.compute:
        print(problem.solution())
    return 0


def _lab_args(p: argparse.ArgumentParser) -> None:
    from kvlab.app.lab import DEFAULT_PORT

    p.add_argument("folder", nargs="?", default=".", metavar="FOLDER",
                   help="folder to serve: a kvlab checkout or one made by `kvlab chapters` (default: .)")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT,
                   help="port to listen on, or a free one if it is taken (default: %(default)s)")
    p.add_argument("--ip", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--no-browser", action="store_true", default=None,
                   help="do not open a browser (default: open one where a display is found)")
    p.add_argument("--dry-run", action="store_true", help="print the jupyter command instead of running it")


@command("lab", "JupyterLab on the chapters: serves FOLDER, opens the chapter index, prints the URL", _lab_args)
def _lab(args: argparse.Namespace) -> int:
    from kvlab.app.lab import launch

    launch(args.folder, port=args.port, ip=args.ip, no_browser=args.no_browser, dry_run=args.dry_run)
    return 0


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("demo", "run the default workload through a pool and print the engine's report and the text's "
                 "2.2.6 claims beside kvlab's measurements", _demo_args)
def _demo(args: argparse.Namespace) -> int:
    import dataclasses

    from kvlab.serve.claims import claims_report, measure_claims, prefetch_effect
    from kvlab.serve.metrics import format_table
    from kvlab.serve.config import EngineConfig
    from kvlab.serve.engine import Engine
    from kvlab.workloads.mixes import make_workload

    w = make_workload("chat", 1000, 0, rate=200.0)
    rows = {m: Engine(w, EngineConfig(memory=m)).run(progress=not args.no_progress) for m in ("paged", "contiguous")}
    prefetch = prefetch_effect()
    claims = measure_claims(progress=not args.no_progress)
    if args.json:
        _print_json({"workload": w.name, "engine": rows, "prefetch": prefetch,
                     "claims": [dataclasses.asdict(c) for c in claims]})
        return 0
    print(format_table(rows))
    print()
    print("Prefetch (swap-in ahead of need) on a swap-heavy document workload, simulated seconds:")
    print(format_table(prefetch, ["finished", "steps", "preemptions", "swap_ins", "prefetched_swap_ins",
                                  "swap_stall_s", "swap_in_stall_s", "stall_steps", "latency_mean_s", "time_s"]))
    print()
    print(claims_report(claims))
    return 0


# ---------------------------------------------------------------------------------------------------- disagg
def _disagg_args(p: argparse.ArgumentParser) -> None:
    from kvlab.distributed.disagg import configure

    configure(p)


@command("disagg", "disaggregated prefill/decode on torch.distributed: two ranks (gloo on 127.0.0.1, or this "
                   "rank of a torchrun group) ship prompts' KV blocks; prints the transfer report", _disagg_args)
def _disagg(args: argparse.Namespace) -> int:
    from kvlab.distributed.disagg import main as disagg_main

    return disagg_main(args)


# ---------------------------------------------------------------------------------------------------- chat
def _chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="questions, answered in turn on one session")
    p.add_argument("--model", type=_path, default="smollm2-135m", metavar="NAME|PATH",
                   help="a known model (smollm2-135m, the default) or a Llama-architecture .gguf file")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="system prompt starting every prompt (default: the chat template's own)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N",
                   help="longest answer in tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 answers greedily (default); above 0 samples, softer as T grows")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample only from the most likely tokens whose probability reaches P (default: 1, all)")
    p.add_argument("--seed", type=_seed, default=None, metavar="S", help="seed of the sampling (default: random)")
    p.add_argument("--history", action="store_true",
                   help="each prompt follows the earlier questions and answers (a conversation)")
    p.add_argument("--blocks", type=_positive_int, default=1024, help="pool blocks (default: %(default)s)")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (default: %(default)s)")
    p.add_argument("--device", type=_device, default=None, help="torch device (default: kvlab's)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of the text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while the model loads")


@command("chat", "chat with a real language model whose K/V live in kvlab's paged pool: answers each PROMPT in "
                 "turn on one session (later prompts hit the prefix cache) and prints the cache report", _chat_args)
def _chat(args: argparse.Namespace) -> int:
    import dataclasses

    from kvlab.serve.chat import ChatSession
    from kvlab.serve.sampling import check_temperature, check_top_p
    from kvlab.serve.loader import load_model

    temperature = check_temperature(args.temperature, "--temperature")
    top_p = check_top_p(args.top_p, "--top-p")
    model = load_model(args.model, device=args.device, progress=not args.no_progress)
    session = ChatSession(model, num_blocks=args.blocks, block_size=args.block_size, system=args.system)
    for prompt in args.prompts:
        shown = ""

        def stream(i: int, token: int, text: str) -> None:
            nonlocal shown
            if text.startswith(shown) and not text.endswith("\ufffd"):  # a character still incomplete: wait
                print(text[len(shown):], end="", flush=True)
                shown = text

        if not args.json:
            print(f"> {prompt}")
        reply = session.ask(prompt, max_new_tokens=args.max_new_tokens, temperature=temperature, top_p=top_p,
                            seed=args.seed, history=args.history, on_token=None if args.json else stream)
        if args.json:
            _print_json({"prompt": prompt, **dataclasses.asdict(reply), "pool": session.usage()})
            continue
        print(reply.text[len(shown):] if reply.text.startswith(shown) else f"\n{reply.text}")
        print(f"[{reply.prompt_tokens} prompt tokens, {reply.prefix_hit_tokens} from the prefix cache; "
              f"{len(reply.tokens)} generated ({reply.finish_reason}); {reply.blocks_used} blocks; first token "
              f"{reply.ttft_s:.2f} s; {reply.decode_tokens_per_s:.1f} tokens/s]\n")
    if not args.json:
        print(session.report())
    return 0


def _watch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("endpoint", metavar="ENDPOINT",
                   help="the server's KV event endpoint: tcp://SERVER:5557 when it binds (its endpoint tcp://*:5557), "
                        "or tcp://*:5557 to listen when it connects here (its endpoint names this host)")
    p.add_argument("--topic", default="", help="the server's topic (default: every topic)")
    p.add_argument("--replay", default=None, metavar="ENDPOINT",
                   help="the server's replay endpoint (tcp://SERVER:5558): fetches what its buffer holds, and "
                        "batches lost in transit")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per event: type, seq, ts, data_parallel_rank and vLLM's fields")
    p.add_argument("--count", type=_positive_int, default=None, metavar="N", help="stop after N events")
    p.add_argument("--timeout", type=_positive_float, default=10.0, metavar="S",
                   help="seconds without an event before saying what to check (default: %(default)s)")


@command("watch", "print a vLLM, SGLang or kvlab server's KV cache events (blocks stored and removed) as they "
                  "arrive, until interrupted or N events", _watch_args)
def _watch(args: argparse.Namespace) -> int:
    import asyncio

    require("zmq", "msgspec")
    from kvlab.kvevents.subscriber import Subscriber

    def warn(text: str) -> None:
        print(f"kvlab watch: {text}", file=sys.stderr, flush=True)

    sub = Subscriber(args.endpoint, topic=args.topic, replay_endpoint=args.replay, silence_s=args.timeout,
                     on_warning=warn)  # checked here: a bad endpoint is bad use (exit 2)

    async def follow() -> None:
        shown = 0
        async with sub:
            async for got in sub:
                if not args.json and (got.restarted or got.missed):
                    print(f"-- {'发布端重启 (publisher restarted)' if got.restarted else ''}"
                          f"{f'缺失 {got.missed} 批 (missed {got.missed} batches)' if got.missed else ''} --")
                for event in got.batch.events:
                    if args.json:
                        _print_json(_event_json(got, event))
                    else:
                        print(_event_line(got.seq, event), flush=True)
                    shown += 1
                    if args.count is not None and shown >= args.count:
                        return

    asyncio.run(follow())
    return 0


def _event_json(got: Any, event: Any) -> dict[str, Any]:
    """One event as ``kvlab watch --json`` prints it: type, seq, ts, rank, then vLLM's fields (hashes in bytes
    as hex)."""
    from kvlab.kvevents.wire import event_map

    fields = event_map(event)
    return {"type": fields.pop("type"), "seq": got.seq, "ts": got.batch.ts,
            "data_parallel_rank": got.batch.data_parallel_rank, **_hex_bytes(fields)}


def _hex_bytes(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {k: _hex_bytes(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_hex_bytes(x) for x in v]
    return v


def _event_line(seq: int, event: Any) -> str:
    """One event in words, Chinese first: what happened to which blocks, where."""
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        return f"seq {seq}  全部清空 (AllBlocksCleared)"
    hashes = event.block_hashes
    where = f"{event.medium or '?'} group {'?' if event.group_idx is None else event.group_idx}"
    shown = ", ".join(_short_hash(h) for h in hashes[:3]) + (f", ... ({len(hashes)})" if len(hashes) > 3 else "")
    if kind == "BlockStored":
        parent = "无 (none)" if event.parent_block_hash is None else _short_hash(event.parent_block_hash)
        return (f"seq {seq}  存入 (BlockStored) {len(hashes)} 块 (blocks) [{shown}] 父块 (parent) {parent}, "
                f"{len(event.token_ids)} tokens, {where}")
    return f"seq {seq}  移除 (BlockRemoved) {len(hashes)} 块 (blocks) [{shown}], {where}"


def _short_hash(h: int | bytes) -> str:
    """A block hash, short: 16 hex digits of an int hash, the first 8 bytes of a bytes one."""
    return f"{h:016x}" if isinstance(h, int) else h[:8].hex() + ("..." if len(h) > 8 else "")
