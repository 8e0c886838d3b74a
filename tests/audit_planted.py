"""Planted bugs in the scheduler, the KV connector's accounting and the exercise checkers: do their tests catch them?

The same audit as tests/audit_twins.py, for three other areas. This script plants one small, realistic bug at a time
in a copy of the project (an off-by-one, ``<`` for ``<=``, a reversed order or tie-break, a counter counting calls or
tokens instead of blocks, a field not reset, a check dropped, a tolerance loosened, a wrong field compared) and runs
the tests related to it (``pytest -x -q``): a bug is caught when one of them fails.

* ``scheduler``: :class:`kvlab.serve.engine.Engine` (admission, preemption and the victim, the order swapped requests
  come back in, ``max_batched_tokens``, chunked prefill, tenant quotas and reservations, finishing) and the parts of
  ``kvlab/serve/job.py`` and ``kvlab/serve/memory.py`` its decisions rest on;
* ``connector``: ``kvlab/distributed/connector.py``'s :class:`TransferReport` counters, the start index each side
  uses, the block ids its events name and the limits ``check_plan`` / ``check_segments`` put on a peer;
* ``checkers``: ``kvlab/exercises/framework.py`` and the chapters' checkers (``ch2_2_*.py``): how an answer is judged
  right or wrong, tolerances, choice exercises, predictions.

No C is rebuilt: the copy gets this checkout's compiled extensions (``kvlab/fast/*.so``, built from the same
sources), and pytest runs in the copy, so its ``kvlab`` is the one imported (checked before anything is planted). Before
the bugs, the tests of each list must pass on the unplanted copy (``--no-baseline`` skips that check).

    .venv/bin/python tests/audit_planted.py                                # every bug, with the baseline
    .venv/bin/python tests/audit_planted.py --area connector               # one area
    .venv/bin/python tests/audit_planted.py --only sched-victim-oldest     # one bug (or several)
    .venv/bin/python tests/audit_planted.py --existing                     # without tests/test_planted_audit.py

``--existing`` leaves out tests/test_planted_audit.py, the tests written for the bugs the other tests missed: the
figure before them. A bug whose text is no longer in its file exactly once is reported as "gone" (the source moved
on: update its line here).
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import REPO, copy_project  # noqa: E402
from audit_twins import caught  # noqa: E402

ENGINE, JOB, MEMORY = "kvlab/serve/engine.py", "kvlab/serve/job.py", "kvlab/serve/memory.py"
CONN = "kvlab/distributed/connector.py"
FW, CH1, CH2, CH4, CH6 = ("kvlab/exercises/framework.py", "kvlab/exercises/ch2_2_1.py", "kvlab/exercises/ch2_2_2.py",
                          "kvlab/exercises/ch2_2_4.py", "kvlab/exercises/ch2_2_6.py")
AREAS = ("scheduler", "connector", "checkers")
AREA = {ENGINE: "scheduler", JOB: "scheduler", MEMORY: "scheduler", CONN: "connector"}
NEW = "tests/test_planted_audit.py"  # the tests written for what the others missed (left out with --existing)

# The related tests of each area, fastest and closest first (-x stops at the first failure).
SCHED = [NEW, "tests/test_engine.py", "tests/test_planted_kinds.py",
         "tests/test_interrupts.py::test_an_engine_step_completes_or_changes_nothing_and_the_run_finishes",
         "tests/test_engine_real.py", "tests/test_race.py"]
CONNECTOR = [NEW, "tests/test_planted_kinds.py::test_blocks_counted_across_block_sizes", "tests/test_distributed.py",
             "tests/test_connector_protocol.py",
             "tests/test_interrupts.py::test_a_disaggregated_step_interrupted_anywhere_frees_it_on_both_ranks"]
CHECKERS = [NEW, "tests/test_exercises_framework.py", "tests/test_exercises.py", "tests/test_exercises_canonical.py",
            "tests/test_planted_kinds.py::test_a_str_subclass_that_lies_is_judged_by_its_text",
            "tests/test_distributed.py::test_the_chapter_exercises_judge_by_running_kvlab",
            "tests/test_chapters_late.py", "tests/test_chapters_early.py", "-m", "not notebooks"]

# (name, file, text, replacement, tests): each text must occur in its file exactly once.
BUGS: list[tuple[str, str, str, str, list[str]]] = [
    # ------------------------------------------------------------------------------------------- the scheduler
    ("sched-prefill-chunks-first", ENGINE, "key=lambda j: len(j.tokens) - j.kv.num_tokens > 1)",
     "key=lambda j: len(j.tokens) - j.kv.num_tokens <= 1)", SCHED),
    ("sched-budget-stale-after-preemption", ENGINE,
     "        budget = cfg.max_batched_tokens - sum(n for _, n in batch)\n", "", SCHED),
    ("sched-swapped-newest-first", ENGINE, "job = self.swapped.popleft()", "job = self.swapped.pop()", SCHED),
    ("sched-admit-past-swapped", ENGINE, "        if not self.swapped:\n            self._admit(batch, budget)",
     "        self._admit(batch, budget)", SCHED),
    ("sched-max-num-seqs-off-by-one", ENGINE, "while budget and len(self.running) < cfg.max_num_seqs",
     "while budget and len(self.running) <= cfg.max_num_seqs", SCHED),
    ("sched-victim-oldest", ENGINE, "key = (over, i)", "key = (over, -i)", SCHED),
    ("sched-victim-other-tenant-under-own-quota", ENGINE, "            if own_quota and t != tenant:\n"
     "                continue\n", "", SCHED),
    ("sched-own-reservation-owed", ENGINE, "for t, r in cfg.reservations.items() if t != tenant)",
     "for t, r in cfg.reservations.items())", SCHED),
    ("sched-prefetch-no-decode-headroom", ENGINE, "self.memory.swap_need(job) + len(self.running)",
     "self.memory.swap_need(job)", SCHED),
    ("sched-round-robin-tries-not-reset", ENGINE, "            tried = 0\n            q.popleft()",
     "            q.popleft()", SCHED),
    ("sched-preempt-keeps-promise", ENGINE, "        self.promised -= job.pending\n", "", SCHED),
    ("sched-arrival-strict", ENGINE, "while arr and arr[0].arrival <= now:", "while arr and arr[0].arrival < now:",
     SCHED),
    ("sched-finish-charged-before-release", ENGINE,
     "                mem.release(job)\n                self._account(job)\n                job.state = FINISHED",
     "                self._account(job)\n                mem.release(job)\n                job.state = FINISHED",
     SCHED),
    ("job-last-prompt-token-is-a-decode", JOB,
     "n == 1 and self.kv.num_tokens + 1 == len(self.tokens) > self.req.prompt_len",
     "n == 1 and self.kv.num_tokens + 1 == len(self.tokens)", SCHED),
    ("mem-cached-hits-never-revived", MEMORY, "revived = sum(1 for b in hits if not refs[b])", "revived = 0", SCHED),
    # ------------------------------------------------------------------------------- the connector's accounting
    ("conn-sent-by-tokens-moved", CONN, "r.blocks_sent += -(-n // B) - m.start // B",
     "r.blocks_sent += -(-(n - m.start) // B)", CONNECTOR),
    ("conn-skipped-counts-requests", CONN, "r.blocks_skipped += m.start // B", "r.blocks_skipped += bool(m.start)",
     CONNECTOR),
    ("conn-tokens-skipped-in-blocks", CONN, "r.tokens_skipped += m.start", "r.tokens_skipped += m.start // B",
     CONNECTOR),
    ("conn-received-counts-skipped", CONN, "r.blocks_received += m.seq.num_blocks - m.start // B",
     "r.blocks_received += m.seq.num_blocks", CONNECTOR),
    ("conn-receiver-messages-per-layer", CONN, "r.messages += sum(map(len, self._recvs))",
     "r.messages += len(self._recvs)", CONNECTOR),
    ("conn-sender-messages-per-step", CONN, "r.messages += len(self._sends)", "r.messages += 1", CONNECTOR),
    ("conn-receiver-requests-per-step", CONN, "r.requests += len(self._step)\n        r.bytes += self._nbytes\n"
     "        r.messages += sum(", "r.requests += 1\n        r.bytes += self._nbytes\n        r.messages += sum(",
     CONNECTOR),
    ("conn-sender-bytes-one-layer", CONN, "        self._nbytes = len(flat) * self._row_bytes() * "
     "self.storage.spec.num_layers\n        self._sends = []",
     "        self._nbytes = len(flat) * self._row_bytes()\n        self._sends = []", CONNECTOR),
    ("conn-sender-start-not-recorded", CONN, "        for m, s in zip(meta, starts):\n            m.start = s\n", "",
     CONNECTOR),
    ("conn-sent-event-from-block-0", CONN,
     "ids = tuple(m.seq.block_table[m.start // B:-(-len(m.request.prompt) // B)])",
     "ids = tuple(m.seq.block_table[:-(-len(m.request.prompt) // B)])", CONNECTOR),
    ("conn-received-event-from-block-0", CONN, "ids = tuple(m.seq.block_table[m.start // B:])",
     "ids = tuple(m.seq.block_table)", CONNECTOR),
    ("conn-sent-event-bytes-per-block", CONN,
     "layer, ids,\n                                         per_row * len(rows)))",
     "layer, ids,\n                                         per_row * len(ids)))", CONNECTOR),
    ("conn-receiver-step-not-reset", CONN,
     "        r.seconds += time.perf_counter() - self._t0\n        self._step = []\n",
     "        r.seconds += time.perf_counter() - self._t0\n", CONNECTOR),
    ("conn-plan-start-at-prompt-end", CONN, "any(s >= n for s, n in zip(starts, lengths))",
     "any(s > n for s, n in zip(starts, lengths))", CONNECTOR),
    ("conn-segments-count-unchecked", CONN, "if sum(lengths) != n or len(lengths) > MAX_SEGMENTS:",
     "if sum(lengths) != n:", CONNECTOR),
    # -------------------------------------------------------------------------------------------- the checkers
    ("fw-hint-stage-unclamped", FW, "stage = min(max(stage, 1), len(HINT_STAGES))", "stage = max(stage, 1)",
     CHECKERS),
    ("fw-right-answer-counts-a-miss", FW,
     "    if not result.ok:\n        _PROGRESS.misses[key] = _PROGRESS.misses.get(key, 0) + 1\n",
     "    _PROGRESS.misses[key] = _PROGRESS.misses.get(key, 0) + 1\n", CHECKERS),
    ("fw-close-tolerance-loosened", FW, "rel_tol=max(rel_tol, 1e-9), abs_tol=1e-9)",
     "rel_tol=max(rel_tol, 1e-6), abs_tol=1e-9)", CHECKERS),
    ("fw-prediction-bound-exclusive", FW, "abs(c) <= PREDICTION_MAX", "abs(c) < PREDICTION_MAX", CHECKERS),
    ("fw-prediction-unlocked-after-reveal", FW, "    if key in _PROGRESS.revealed:\n        held =",
     "    if False:\n        held =", CHECKERS),
    ("fw-same-counts-right-items", FW, "wrong = sum(w != g for w, g in zip(want, got))",
     "wrong = sum(w == g for w, g in zip(want, got))", CHECKERS),
    ("fw-same-length-unchecked", FW, "    if len(got) != len(want):\n        return False, f\"答案应有 {len(want)} 项，"
     "你给了 {len(got)} 项 (expected {len(want)} items, got {len(got)})\"\n", "", CHECKERS),
    ("fw-scenario-error-is-a-wrong-answer", FW, "        except KVLabError:\n            raise  # a bug in the "
     "scenario itself must not read as a wrong answer\n", "", CHECKERS),
    ("fw-hint-stage-zero", FW, "not 1 <= stage <= len(HINT_STAGES)", "not 0 <= stage <= len(HINT_STAGES)", CHECKERS),
    ("ch221-utilisation-compared-exactly", CH1, 'pool_utilisation, "utilisation", close=True)',
     'pool_utilisation, "utilisation")', CHECKERS),
    ("ch221-band-upper-edge", CH1, "    if block_size <= 128:\n", "    if block_size < 128:\n", CHECKERS),
    ("ch222-transitions-subset-passes", CH2, "    if legal == given:", "    if given <= legal:", CHECKERS),
    ("ch224-curve-peak-of-the-minimum", CH4, "peak = moves.index(max(moves))", "peak = moves.index(min(moves))",
     CHECKERS),
    ("ch224-one-size-order-swapped", CH4, "same(answer, (percent, moves), ", "same(answer, (moves, percent), ",
     CHECKERS),
    ("ch226-choice-unchecked", CH6, "    c = canon(answer)\n    if c not in choices:\n        raise Unreadable(f\"请从 "
     "{list(choices)} 中选一个 (choose one of them), 而不是 {c!r}\")\n    return str(c)",
     "    return str(canon(answer))", CHECKERS),
]


def area_of(rel: str) -> str:
    return AREA.get(rel, "checkers")


def imported_from(root: Path) -> tuple[str, bool]:
    """Where pytest in ``root`` takes ``kvlab`` from, and whether its compiled pool loaded (``python -m`` puts the
    working directory first on the path, as it does for ``python -m pytest``)."""
    code = "import kvlab, kvlab.fast.pool as p; print(kvlab.__file__); print(p.COMPILED)"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    where, compiled = out.split()[-2:]
    return where, compiled == "True"


def forget_bytecode(path: Path) -> None:
    """Drop ``path``'s cached bytecode: a plant and its undoing of the same size within one second of each other
    would otherwise leave the planted module's bytecode looking current."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="the bugs to plant, by name")
    ap.add_argument("--area", nargs="*", choices=AREAS, help="the areas to audit (default: all)")
    ap.add_argument("--existing", action="store_true", help=f"leave out {NEW} (the figure before it)")
    ap.add_argument("--no-baseline", action="store_true", help="skip running each test list on the unplanted copy")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a test may run (a planted bug may loop)")
    args = ap.parse_args()
    unknown = set(args.only or ()) - {b[0] for b in BUGS}
    if unknown:
        ap.error(f"no bug named {sorted(unknown)}")
    bugs = [b for b in BUGS if (not args.only or b[0] in args.only) and (not args.area or area_of(b[1]) in args.area)]
    extra = ["--timeout", str(args.timeout), "--hypothesis-profile=ci"]  # derandomized: the same figure every run
    if importlib.util.find_spec("pytest_randomly") is not None:
        extra += ["-p", "no:randomly"]

    with tempfile.TemporaryDirectory(prefix="kvlab-planted-") as tmp:
        root = copy_project(Path(tmp) / "kvlab")
        leave_out = args.existing or not (root / NEW).exists()  # what the copy holds, whatever happens here later

        def tests_of(tests: list[str]) -> list[str]:
            return [t for t in tests if not (t == NEW and leave_out)]

        for so in (REPO / "kvlab" / "fast").glob("*.so"):  # built from the sources copied: no rebuild
            shutil.copy2(so, root / "kvlab" / "fast" / so.name)
        where, compiled = imported_from(root)
        if not Path(where).resolve().is_relative_to(root.resolve()):
            print(f"the copy imports kvlab from {where}, not from {root}: nothing to audit")
            return 2
        print(f"kvlab imported from the copy ({where}); compiled pool: {compiled}")
        if not args.no_baseline:
            for tests in dict.fromkeys(tuple(tests_of(b[4])) for b in bugs):
                t0 = time.perf_counter()
                if caught(root, list(tests), *extra):
                    print(f"the tests fail before any bug is planted: {' '.join(tests)}")
                    return 2
                print(f"baseline passes ({time.perf_counter() - t0:.0f} s): {' '.join(tests)}", flush=True)
        rows: list[tuple[str, str, str]] = []
        for name, rel, text, repl, tests in bugs:
            path = root / rel
            original = path.read_text()
            if original.count(text) != 1:
                rows.append((area_of(rel), name, "gone"))
                print(f"{name:44} gone (its text is not in {rel} exactly once)", flush=True)
                continue
            t0 = time.perf_counter()
            path.write_text(original.replace(text, repl))
            forget_bytecode(path)
            try:
                hit = caught(root, tests_of(tests), *extra)
            finally:
                path.write_text(original)
                forget_bytecode(path)
            rows.append((area_of(rel), name, "caught" if hit else "MISSED"))
            print(f"{name:44} {'caught' if hit else 'MISSED':7} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    for area in AREAS:
        mine = [r for r in rows if r[0] == area]
        if not mine:
            continue
        planted = [r for r in mine if r[2] != "gone"]
        missed = [r[1] for r in planted if r[2] == "MISSED"]
        gone = len(mine) - len(planted)
        print(f"{area}: {sum(r[2] == 'caught' for r in planted)} of {len(planted)} caught"
              + (f" (missed: {', '.join(missed)})" if missed else "") + (f"; {gone} gone" if gone else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
