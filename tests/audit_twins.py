"""Planted bugs in the pool's twins: does the bad-input grid still catch what it caught before?

The twins (:class:`kvlab.FastBlockPool`, compiled from ``kvlab/fast/_fastpath.c``, and the Python
:class:`kvlab.fast.pool.PyFastBlockPool`) run a reduced grid (tests/test_badinput_grid.py), the reference the full one.
This script plants one small bug at a time in a copy of the project (a check dropped or loosened, an off-by-one,
an exact type test made loose), rebuilds the compiled pool when the bug is in C, and runs the twins' cases of the
grid: reduced (as ``make test`` runs them), and with ``--full`` the full grid too (``KVLAB_LONG=1``). With
``--suite`` a bug the grid misses also meets the equivalence property tests (tests/test_perf.py and
tests/test_pool_stateful.py, Hypothesis' derandomized ``ci`` profile).

    .venv/bin/python tests/audit_twins.py --full --suite      # docs/reliability.md's figures
    .venv/bin/python tests/audit_twins.py --only C-free-status # one bug

A bug whose text is no longer in its file is reported as "gone" (the source moved on: update its line here).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import REPO, copy_project  # noqa: E402

PY, C = "kvlab/fast/pool.py", "kvlab/fast/_fastpath.c"
# (name, file, text, replacement): each text must occur in the file exactly once.
BUGS: list[tuple[str, str, str, str]] = [
    # PyFastBlockPool (and whatever FastBlockPool inherits from it)
    ("py-allocate-bool-n", PY, "if (type(n) is int and n > 0", "if (isinstance(n, int) and n > 0"),
    ("py-allocate-zero-n", PY, "if (type(n) is int and n > 0", "if (type(n) is int and n >= 0"),
    ("py-allocate-size-class-falsy", PY, "type(size_class) is int and not size_class", "not size_class"),
    ("py-allocate-owner-range", PY, "and type(owner) is int and -1 <= owner <= INT32_MAX):",
     "and type(owner) is int and -1 <= owner):"),
    ("py-allocate-owner-bool", PY, "and type(owner) is int and -1 <= owner <= INT32_MAX):",
     "and isinstance(owner, int) and -1 <= owner <= INT32_MAX):"),
    ("py-allocate-status-type", PY, "status == ALLOCATED and type(status) in (int, BlockStatus)",
     "status == ALLOCATED"),
    ("py-free-one-range", PY, "if (type(b) is int and 0 <= b < self.num_blocks and self._status[b] == ALLOCATED",
     "if (type(b) is int and 0 <= b <= self.num_blocks and self._status[b] == ALLOCATED"),
    ("py-free-one-shared", PY, "and self._refs[b] == 1 and not self._reusable[b]):",
     "and self._refs[b] >= 1 and not self._reusable[b]):"),
    ("py-free-one-reusable", PY, "and self._refs[b] == 1 and not self._reusable[b]):", "and self._refs[b] == 1):"),
    ("py-free-many-range", PY, "v.max() >= self.num_blocks", "v.max() > self.num_blocks"),
    ("py-free-many-repeats", PY, "or m.reusable[v].any() or not self._distinct(v)):", "or m.reusable[v].any()):"),
    ("py-free-many-shared", PY, "or m.refcount[v].tobytes() != _ONE_REF * n\n", "\n"),
    ("py-release-status", PY, "or status[b] != ALLOCATED or not refs[b]:", "or not refs[b]:"),
    ("py-release-repeats", PY, "        if len(set(ids)) != len(ids):\n            return False\n", ""),
    ("py-check-ids-bool", PY, "            for b in ids:\n                if type(b) is not int or not 0 <= b < n:",
     "            for b in ids:\n                if not isinstance(b, int) or not 0 <= b < n:"),
    ("py-check-ids-range", PY, "            for b in ids:\n                if type(b) is not int or not 0 <= b < n:",
     "            for b in ids:\n                if type(b) is not int or not 0 <= b <= n:"),
    ("py-incref-status", PY, "or status[b] != ALLOCATED:", "or status[b] == FREE:"),
    ("py-mark-reusable-truthy", PY, "if reusable is True and type(ids) is list", "if reusable and type(ids) is list"),
    ("py-mark-reusable-status", PY, "or status[b] not in _HOLDS_DATA:", "or status[b] == FREE:"),
    ("py-token-counts-range", PY, "or not 0 <= c <= cap", "or not 0 <= c <= cap + 1"),
    ("py-token-counts-bool", PY, "or type(c) is not int or", "or not isinstance(c, int) or"),
    ("py-token-counts-free", PY, "or not 0 <= c <= cap \\\n                            or status[b] == FREE:",
     "or not 0 <= c <= cap:"),
    ("py-owner-range", PY, "if type(ids) is list and type(owner) is int and -1 <= owner <= INT32_MAX",
     "if type(ids) is list and type(owner) is int and -1 <= owner"),
    ("py-owner-float", PY, "if type(ids) is list and type(owner) is int and -1 <= owner <= INT32_MAX",
     "if type(ids) is list and owner == int(owner) and -1 <= owner <= INT32_MAX"),
    ("py-owner-free", PY, "or not 0 <= b < n or status[b] == FREE:", "or not 0 <= b < n:"),
    # FastBlockPool's compiled paths
    ("C-allocate-zero-n", C, "if (overflow || v < 1 || v > PY_SSIZE_T_MAX) return 0;",
     "if (overflow || v < 0 || v > PY_SSIZE_T_MAX) return 0;"),
    ("C-allocate-bool-n", C, "if (!PyLong_CheckExact(args[0])) return 0;", "if (!PyLong_Check(args[0])) return 0;"),
    ("C-allocate-owner-range", C, "if (overflow || *owner < -1 || *owner > INT32_MAX) return 0;",
     "if (overflow || *owner < -1) return 0;"),
    ("C-allocate-owner-bool", C, "|| !PyLong_CheckExact(o)) return 0;", "|| !PyLong_Check(o)) return 0;"),
    ("C-free-bool", C, "long long v = PyLong_CheckExact(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : -1;\n"
     "        if (overflow", "long long v = PyLong_Check(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : -1;\n"
     "        if (overflow"),
    ("C-free-repeats", C, "F(h, REFCOUNT, int32_t)[b] >= 1 && !h->seen[b];", "F(h, REFCOUNT, int32_t)[b] >= 1;"),
    ("C-free-shared", C, "plain && held && F(h, REFCOUNT, int32_t)[b] == 1 &&", "plain && held &&"),
    ("C-free-status", C, "held = F(h, STATUS, uint8_t)[b] == ALLOCATED && ", "held = "),
    ("C-index-bool", C, "long long v = PyLong_CheckExact(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : -1;\n"
     "    return", "long long v = PyLong_Check(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : -1;\n    return"),
    ("C-token-counts-range", C, "exact_index(PyList_GET_ITEM(counts, i), h->capacity + 1);",
     "exact_index(PyList_GET_ITEM(counts, i), h->capacity + 2);"),
    ("C-token-counts-free", C, "if (b < 0 || c < 0 || F(h, STATUS, uint8_t)[b] == FREE) break;",
     "if (b < 0 || c < 0) break;"),
    ("C-incref-status", C, "(F(h, STATUS, uint8_t)[v] == a || F(h, STATUS, uint8_t)[v] == b);",
     "F(h, STATUS, uint8_t)[v] != FREE;"),
    ("C-incref-repeats", C, "ok = v >= 0 && !h->seen[v] && ", "ok = v >= 0 && "),
    ("C-mark-reusable-args", C, "Py_ssize_t n = nargs == 1 && !kwnames && PyList_CheckExact(args[0])",
     "Py_ssize_t n = nargs >= 1 && !kwnames && PyList_CheckExact(args[0])"),
    ("C-mark-reusable-status", C,
     "if (b < 0 || (F(h, STATUS, uint8_t)[b] != ALLOCATED && F(h, STATUS, uint8_t)[b] != PENDING)) break;",
     "if (b < 0 || F(h, STATUS, uint8_t)[b] == FREE) break;"),
    ("C-owner-range", C, "overflow || owner < -1 ||\n        owner > INT32_MAX)", "overflow || owner < -2 ||\n"
     "        owner > INT32_MAX)"),
    ("C-owner-free", C, "if (b < 0 || F(h, STATUS, uint8_t)[b] == FREE) break;\n    }\n    if (i == n)\n"
     "        for (i = 0; i < n; i++) F(h, OWNER", "if (b < 0) break;\n    }\n    if (i == n)\n"
     "        for (i = 0; i < n; i++) F(h, OWNER"),
]


def build(root: Path) -> bool:
    """Compile ``kvlab/fast/_fastpath.c`` in ``root`` as the build hook does (its SHA-256 compiled in)."""
    src = root / C
    out = src.with_name("_fastpath" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    cmd = [*shlex.split(sysconfig.get_config_var("LDSHARED")), "-O2", "-DNDEBUG", "-fPIC",
           f"-I{sysconfig.get_paths()['include']}", f'-DKVLAB_SOURCE_SHA256="{sha}"', str(src), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def caught(root: Path, tests: list[str], *extra: str, env: dict[str, str] | None = None) -> bool:
    """Whether a test of ``tests`` fails (or crashes) in ``root``."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *extra, *tests]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if r.returncode not in (0, 1):  # not "passed" or "failed": a crash counts as caught, an error too
        print(f"    pytest exit {r.returncode}: {r.stdout.strip().splitlines()[-1:] if r.stdout else r.stderr[-200:]}")
    return r.returncode != 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="also run the full grid on the twins (KVLAB_LONG=1)")
    ap.add_argument("--suite", action="store_true", help="a bug the grid misses meets tests/test_perf.py and "
                    "tests/test_pool_stateful.py")
    ap.add_argument("--only", nargs="*", help="the bugs to plant, by name")
    args = ap.parse_args()
    bugs = [b for b in BUGS if not args.only or b[0] in args.only]
    grid = ["tests/test_badinput_grid.py", "-k", "FastBlockPool"]  # the twins' cases (PyFastBlockPool's too)
    suite = ["tests/test_perf.py", "tests/test_pool_stateful.py"]
    with tempfile.TemporaryDirectory(prefix="kvlab-audit-") as tmp:
        root = copy_project(Path(tmp) / "kvlab")
        for so in (REPO / "kvlab" / "fast").glob("_paged_attention*.so"):  # not under audit: the grid never calls it
            shutil.copy2(so, root / "kvlab" / "fast" / so.name)
        if not build(root):
            print("kvlab/fast/_fastpath.c does not compile here: nothing to audit")
            return 2
        rows = []
        for name, rel, text, repl in bugs:
            path = root / rel
            original = path.read_text()
            if original.count(text) != 1:
                rows.append((name, "gone", "", ""))
                print(f"{name:30} gone (its text is not in {rel} exactly once)")
                continue
            t0 = time.perf_counter()
            path.write_text(original.replace(text, repl))
            try:
                if rel == C and not build(root):
                    rows.append((name, "no build", "", ""))
                    continue
                reduced = caught(root, grid)
                full = caught(root, grid, env={"KVLAB_LONG": "1"}) if args.full else None
                rest = caught(root, suite, "--hypothesis-profile=ci") if args.suite and not reduced else None
            finally:
                path.write_text(original)
                if rel == C:
                    build(root)
            word = {True: "caught", False: "missed", None: "-"}
            rows.append((name, word[reduced], word[full], word[rest]))
            print(f"{name:30} grid {word[reduced]:7} full grid {word[full]:7} property tests {word[rest]:7}"
                  f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        planted = [r for r in rows if r[1] in ("caught", "missed")]
        print(f"\n{len(planted)} bugs planted; caught by the twins' reduced grid: "
              f"{sum(r[1] == 'caught' for r in planted)}"
              + (f", by their full grid: {sum(r[2] == 'caught' for r in planted)}" if args.full else ""))
        if args.suite:
            print(f"with the property tests: reduced grid {sum('caught' in (r[1], r[3]) for r in planted)}"
                  + (f", full grid {sum('caught' in (r[2], r[3]) for r in planted)}" if args.full else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
