"""kvlab.serve.realsim: a real-model run replayed in metadata mode schedules alike, and the report says so."""
from __future__ import annotations

import ast

import pytest

from kvlab.serve.config import EngineConfig
from kvlab.serve.engine import Engine
from kvlab.serve.model import TinyConfig, TinyLlama
from kvlab.serve.realsim import ACCOUNTING, answer_blocks, compare_real_and_metadata
from kvlab.workloads.mixes import Request

MODEL = TinyLlama(TinyConfig())


def _requests() -> list[Request]:
    return [Request(i, 0.0, 12 + 3 * i, 6, prompt_tokens=tuple((i * 5 + k) % 97 for k in range(12 + 3 * i)))
            for i in range(5)]


def _real(num_blocks: int) -> tuple[Engine, dict, list[Request]]:
    reqs = _requests()
    real = Engine(reqs, EngineConfig(num_blocks=num_blocks, block_size=4, max_model_len=64), model=MODEL)
    return real, real.run(), reqs


def test_replay_schedules_alike_and_reports_it():
    real, summary, reqs = _real(num_blocks=14)
    check = compare_real_and_metadata(real, summary, reqs)
    assert check.same and check.ranks
    assert check.sim.model is None                      # the replay is metadata mode
    assert all(check.sim_summary[k] == summary[k] for k in ACCOUNTING)
    for r in reqs:                                      # same first and last step for every request
        a, b = real.log.requests[r.id], check.sim.log.requests[r.id]
        assert (a.first_step, a.finish_step) == (b.first_step, b.finish_step)
    assert check.per_step == (summary["time_s"] / summary["steps"],
                              check.sim_summary["time_s"] / check.sim_summary["steps"])
    lines = str(check).splitlines()
    assert lines[0].startswith("块的账目")
    assert [ln.split()[0] for ln in lines[1:1 + len(ACCOUNTING)]] == list(ACCOUNTING)
    steps = next(ln for ln in lines if ln.startswith("steps "))
    assert steps.split()[1:] == [str(summary["steps"])] * 2
    rows = [ln for ln in lines if ln.split() and ln.split()[0].isdigit() and len(ln.split()) == 8]
    assert [int(ln.split()[0]) for ln in rows] == [r.id for r in reqs]
    assert sum(ln.startswith("结论") for ln in lines) == 4
    assert f"{summary['max_running']} / {len(reqs)} 个请求同时运行" in str(check)
    assert check._repr_markdown_() == "```\n" + str(check) + "\n```"


def test_pool_big_enough_for_everyone_is_refused():
    real, summary, reqs = _real(num_blocks=64)
    assert summary["max_running"] == len(reqs)
    with pytest.raises(AssertionError, match="too small"):
        compare_real_and_metadata(real, summary, reqs)


def test_different_accounting_is_refused():
    real, summary, reqs = _real(num_blocks=14)
    with pytest.raises(AssertionError, match="schedule alike"):
        compare_real_and_metadata(real, {**summary, "steps": summary["steps"] + 1}, reqs)


class _Ids:
    """A tokenizer whose text is the token ids themselves, so the blocks can be read back."""

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def test_answer_blocks_cut_prompt_end_and_answer_at_block_boundaries():
    real, summary, reqs = _real(num_blocks=14)
    text = answer_blocks(real, reqs, _Ids(), limit=2)
    lines = text.splitlines()
    assert lines[0] == "" and len(lines) == 2 * 4                # a blank line, then three lines per request
    for r, (head, answer, blocks) in zip(reqs[:2], (lines[1:4], lines[5:8])):
        out = real.outputs[r.id]
        seq = [*r.prompt_tokens, *out]
        first, last = r.prompt_len // 4, -(-len(seq) // 4) - 1
        assert head.startswith(f"请求 (request) {r.id}：提示 {r.prompt_len} 个 token + 回答 {len(out)} 个 token = "
                               f"{last + 1} 块")
        assert answer == f"  回答 (answer): {' '.join(map(str, out))!r}"
        label, pieces = blocks.split(": ", 1)
        assert label == f"  第 {first}..{last} 块（提示的结尾，然后是回答）(blocks)"
        assert [ast.literal_eval(p) for p in pieces.split(" | ")] == [" ".join(map(str, seq[k:k + 4]))
                                                           for k in range(first * 4, len(seq), 4)]
