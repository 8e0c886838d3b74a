"""The CI guard in conftest.py: under ``CI=true`` a skip fails, naming its reason; gpu tests without CUDA and
xfails are left as they are. Each case runs in an inner pytest session with only the guard plugged in."""
from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CASES = """
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("chromium is missing")

@pytest.mark.skipif(True, reason="no C compiler")
def test_skipif():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu():
    pass

@pytest.mark.xfail(reason="known bug", strict=True)
def test_xfail():
    assert False
"""


@pytest.fixture
def run(pytester, pytestconfig):
    guard = type(pytestconfig.pluginmanager.get_plugin("kvlab-ci-guard"))
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs CUDA\n")

    def run(cuda: bool = False, source: str = CASES):
        pytester.makepyfile(test_cases=source)
        return pytester.runpytest_inprocess("-rA", "-p", "no:cacheprovider", plugins=[guard(cuda=cuda)])
    return run


def test_without_ci_a_skip_is_a_skip(run, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = run()
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)


def test_under_ci_a_skip_fails_and_names_its_reason(run, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = run()
    # a skip in the test body fails its call; a skipif mark fails its setup, which pytest counts as an error
    result.assert_outcomes(passed=1, failed=1, errors=1, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines(["FAILED *test_skips - *may not skip*: chromium is missing"])
    result.stdout.fnmatch_lines(["ERROR *test_skipif - *may not skip*: no C compiler"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_under_ci_a_gpu_test_may_skip_only_without_cuda(run, monkeypatch):
    monkeypatch.setenv("CI", "true")
    run(cuda=True).assert_outcomes(passed=1, failed=1, errors=2, xfailed=1)


def test_under_ci_a_module_level_skip_fails(run, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = run(source="import pytest\npytest.importorskip('no_such_module_here')\n\ndef test_x():\n    pass\n")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*may not skip*no_such_module_here*"])


def test_under_ci_an_unstrict_xpass_and_a_pass_are_untouched(run, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = run(source="import pytest\n\n@pytest.mark.xfail(reason='flaky')\ndef test_x():\n    pass\n")
    result.assert_outcomes(xpassed=1)
    assert result.ret == pytest.ExitCode.OK
