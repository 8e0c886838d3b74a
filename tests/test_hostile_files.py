"""Files are not trusted: every trace reader, given a generated grid of hostile files, answers with a typed kvlab
error that names the file (and the line, where there is one) in a message of bounded length, quickly, without
holding more than its limits; the CLI prints it as one line. No reader opens anything but a regular file."""
from __future__ import annotations

import contextlib
import gzip
import io
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvlab.core.files as files
import kvlab.workloads.mixes as mixes
from kvlab import ConfigError, KVLabError, TraceFormatError, load_trace, read_trace
from kvlab.app.cli import main
from kvlab.serve.loader import model_path

GOOD = b'{"id":0,"arrival":0.0,"prompt_len":4,"output_len":1}\n'
MOONCAKE = b'{"timestamp":0,"input_length":4,"output_length":1,"hash_ids":[1]}\n'

READERS: dict[str, Callable[[Path], object]] = {
    "load_trace": load_trace,
    "load_trace mooncake": lambda p: load_trace(p, "mooncake"),
    "load_trace azure": lambda p: load_trace(p, "azure"),
    "read_trace": read_trace,
}


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a reader that opens a FIFO would wait for a writer for ever)."""
    def fail(*_):
        raise AssertionError(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def hostile(kind: str, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, type[KVLabError], str]:
    """A hostile file of ``kind`` under ``tmp`` (limits shrunk where the attack is size), the error it must
    raise and a word its message must hold."""
    path = tmp / "t.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
        return path, ConfigError, "FIFO"
    if kind == "directory":
        path.mkdir()
        return path, ConfigError, "directory"
    if kind == "device":
        path.symlink_to("/dev/zero")
        return path, ConfigError, "character device"
    if kind == "missing":
        return tmp / "nowhere.jsonl", ConfigError, "No such file"
    if kind == "nul in path":
        return tmp / "t\0x.jsonl", ConfigError, "NUL"
    if kind == "too large":
        monkeypatch.setattr(files, "MAX_FILE_BYTES", 1000)
        path.write_bytes(GOOD * 100)
        return path, ConfigError, "at most 1,000"
    if kind == "gzip bomb":
        monkeypatch.setattr(files, "MAX_FILE_BYTES", 1 << 20)
        path = tmp / "t.jsonl.gz"
        path.write_bytes(gzip.compress(GOOD + b" " * (8 << 20), 9))  # 8 MiB from about 8 KB
        assert path.stat().st_size < 20_000
        return path, ConfigError, "decompresses to more than 1,048,576"
    if kind == "gzip bomb, one line":
        monkeypatch.setattr(files, "MAX_FILE_BYTES", 1 << 20)
        path = tmp / "t.jsonl.gz"
        path.write_bytes(gzip.compress(b'{"id":"' + b"x" * (8 << 20) + b'"}\n', 9))
        return path, ConfigError, "gzip bomb"
    if kind == "deep JSON, first line":
        path.write_bytes(b"[" * 200_000 + b"]" * 200_000 + b"\n")
        return path, TraceFormatError, "line 1"
    if kind == "deep JSON, later line":
        path.write_bytes(GOOD + b'{"id":' + b"[" * 200_000 + b"]" * 200_000 + b"}\n")
        return path, TraceFormatError, "line 2"
    if kind == "long line":
        monkeypatch.setattr(mixes, "MAX_LINE", 10_000)
        path.write_bytes(GOOD + b'{"id":1,"arrival":0.0,"prompt_len":4,"output_len":1,"tenant":"' + b"t" * 20_000
                         + b'"}\n')
        return path, TraceFormatError, "at most 10,000"
    if kind == "huge value in a message":
        path.write_bytes(GOOD + b'{"id":1,"arrival":0.0,"prompt_len":4,"output_len":1,"tenants":"' + b"t" * 500_000
                         + b'"}\n')
        return path, TraceFormatError, "line 2"
    if kind == "lone surrogate tenant":
        path.write_bytes(GOOD + b'{"id":1,"arrival":0.0,"prompt_len":4,"output_len":1,"tenant":"a\\ud800"}\n')
        return path, TraceFormatError, "UTF-8"
    raise AssertionError(kind)


KINDS = ["fifo", "directory", "device", "missing", "nul in path", "too large", "gzip bomb", "gzip bomb, one line",
         "deep JSON, first line", "deep JSON, later line", "long line", "huge value in a message",
         "lone surrogate tenant"]
# Every reader with every kind it can meet: read_trace takes no gzip (a .gz name is no trace of its); the Azure and
# Mooncake readers refuse a kvlab record on its first line (another TraceFormatError), which the grid checks too.
GRID = [(reader, kind) for reader in READERS for kind in KINDS
        if not (reader == "read_trace" and kind.startswith("gzip bomb"))]


@pytest.mark.parametrize("reader, kind", GRID)
def test_a_hostile_file_gets_a_typed_short_error_naming_it(tmp_path, monkeypatch, reader, kind):
    path, error, word = hostile(kind, tmp_path, monkeypatch)
    with deadline(20), pytest.raises(KVLabError) as got:
        READERS[reader](path)
    message = str(got.value)
    assert len(message) < 1200, message[:200]
    assert "\n" not in message
    if reader in ("load_trace", "read_trace") or error is ConfigError:
        assert isinstance(got.value, error), message
        assert word in message, message
    else:  # a production reader refuses a kvlab record at once: a trace error naming the file all the same
        assert isinstance(got.value, (error, TraceFormatError)), message
    if kind != "nul in path":
        assert str(path)[:50] in message


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "deep JSON, later line", "gzip bomb"])
def test_the_cli_says_it_in_one_line(tmp_path, monkeypatch, capsys, kind):
    path, error, word = hostile(kind, tmp_path, monkeypatch)
    with deadline(20):
        code = main(["run", "--trace", str(path), "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and word in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_model_path_must_be_a_regular_file(tmp_path, monkeypatch, kind):
    path, error, word = hostile(kind, tmp_path, monkeypatch)
    with deadline(20), pytest.raises(ConfigError, match=word):
        model_path(path)


def test_a_gzip_stream_at_the_limit_is_read_and_one_byte_more_is_not(monkeypatch):
    """The bound is exact: what fits is read whole, multi-member streams included."""
    data = b"x" * 3000
    packed = gzip.compress(data[:1000]) + gzip.compress(data[1000:])
    fault = lambda out, problem: TraceFormatError("f", 1, problem)  # noqa: E731
    assert files.gunzip(packed, "f", fault, limit=3000) == data
    with pytest.raises(ConfigError, match="more than 2,999"):
        files.gunzip(packed, "f", fault, limit=2999)


def test_a_trace_error_message_is_cut_but_keeps_its_file_and_line():
    e = TraceFormatError("p" * 5000, 7, "v" * 10**6)
    assert len(str(e)) < 1000 and ", line 7: " in str(e) and "1,000,000 characters" in str(e)
    assert sys.getsizeof(e.problem) < 2000
    assert io.StringIO(str(e)).read().count("\n") == 0
