"""The compiled single-block paths (``kvlab/_hotpath.c``) against the Python they repeat.

A pool built while ``kvlab.pool.HotPath`` is None runs the Python methods only: the reference. Every call of the
hypothesis test below goes to both pools, arguments the C code serves and arguments it must hand over (other
sizes, size classes, statuses, odd types, bad ids, shared or cached blocks, subscribers, an empty free stack);
both must answer alike and hold identical state after every step.
"""
from __future__ import annotations

import gc
import os
import shlex
import shutil
import sysconfig
import tracemalloc
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlab
import kvlab.pool
from kvlab import BlockPool, BlockStatus, ConfigError, EventRecorder, KVLabError, WallClock

from _util import assert_same_state, pool_state

compiled = pytest.mark.skipif(kvlab.pool.HotPath is None,
                              reason="kvlab/_hotpath.c is not compiled here (no C compiler or Python headers at "
                                     "`make install`, or KVLAB_PURE_PYTHON is set)")


def python_pool(monkeypatch, *args, **kw) -> BlockPool:
    with monkeypatch.context() as m:
        m.setattr(kvlab.pool, "HotPath", None)
        pool = BlockPool(*args, **kw)
    assert pool._hot is None
    return pool


def outcome(pool: BlockPool, op: str, *args, **kw):
    """What a call returns, or the type and message of what it raises (errors must be worded alike)."""
    try:
        return getattr(pool, op)(*args, **kw)
    except (KVLabError, TypeError, ValueError, OverflowError) as e:
        return type(e), str(e)


def test_built_wherever_a_compiler_is():
    # The compiler hatch_build.py uses: CC, else the first word of LDSHARED. A skip here fails under CI=true.
    cc = shlex.split(os.environ.get("CC", "").strip() or sysconfig.get_config_var("LDSHARED") or "")[:1]
    if not cc or not shutil.which(cc[0]):
        pytest.skip("no C compiler: kvlab runs its Python paths, as designed")
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(headers):
        pytest.skip(f"no Python headers ({headers}; Debian: python3-dev): kvlab runs its Python paths")
    if os.environ.get("KVLAB_PURE_PYTHON"):
        pytest.skip("KVLAB_PURE_PYTHON switches the compiled paths off")
    assert kvlab.pool.HotPath is not None, "a C compiler is here but kvlab/_hotpath.c was not built (make install)"
    pool = BlockPool(8, with_storage=False)
    assert pool._hot is not None and pool.allocate == pool._hot.allocate


@compiled
def test_wheel_ships_the_compiled_hot_path_and_its_source(wheel):
    names = set(wheel.namelist())
    assert f"kvlab/_hotpath{sysconfig.get_config_var('EXT_SUFFIX')}" in names and "kvlab/_hotpath.c" in names
    tags = [line for line in wheel.read(next(n for n in names if n.endswith("WHEEL"))).decode().splitlines()
            if line.startswith("Tag:")]
    assert tags and all("none-any" not in t for t in tags), tags  # a binary wheel names its platform


def test_building_the_wheel_leaves_the_checkout_binary_alone(wheel_build):
    # The build runs on a copy: rewriting the .so this process has loaded could crash it or leave a stale one.
    assert wheel_build.binaries_after == wheel_build.binaries_before


OWNERS = st.one_of(st.integers(-3, 4), st.sampled_from([2**31 - 1, 2**31, 2**70, -(2**70), True, "x", 1.0]))
SIZES = st.one_of(st.just(1), st.integers(0, 12), st.sampled_from([True, 1.0, "1", -1, 2**70, None]))


def allocate_call(data) -> tuple[tuple, dict]:
    """allocate's arguments: mostly the hot path's own (n omitted or 1, maybe an owner), then everything else."""
    args = () if data.draw(st.booleans(), label="n omitted") else (data.draw(SIZES, label="n"),)
    kw = {}
    for name, values in (("owner", OWNERS), ("size_class", st.sampled_from([0, 1, 2, -1, "0"])),
                         ("status", st.sampled_from([BlockStatus.ALLOCATED, BlockStatus.PENDING, 2, 0])),
                         ("colour", st.just("red"))):
        if data.draw(st.integers(0, 9 if name == "colour" else 3), label=f"pass {name}") == 0:
            kw[name] = data.draw(values, label=name)
    return args, kw


def free_call(data, held: list[int], n: int) -> list | tuple | np.ndarray:
    """free's argument: mostly one held block in a list, else stale, foreign, odd or longer ones."""
    one = st.sampled_from(held) if held else st.integers(0, n - 1)
    return data.draw(st.one_of(
        one.map(lambda b: [b]), one.map(lambda b: [b]), one.map(lambda b: [b]), st.integers(0, n - 1).map(lambda b: [b]),
        st.sampled_from([[n], [-1], [2**70], [True], ["1"], [1.0], [None], []]),
        one.map(lambda b: (b,)), one.map(lambda b: np.array([b])), one.map(lambda b: [b, b]),
        st.lists(st.integers(0, n - 1), min_size=2, max_size=12, unique=True)), label="ids")


@compiled
@pytest.mark.parametrize("sizes", [None, [4, 8, 16]], ids=["uniform", "size classes"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_compiled_paths_equal_python(monkeypatch, sizes, data):
    n = 24
    kw = dict(with_storage=False, block_sizes=sizes, eviction_policy=data.draw(st.sampled_from(["lru", "lfu"])))
    fast, ref = BlockPool(n, **kw), python_pool(monkeypatch, n, **kw)
    recorders: list[tuple[EventRecorder, EventRecorder]] = []
    held: list[int] = []
    for step in range(data.draw(st.integers(10, 40), label="steps")):
        op = data.draw(st.sampled_from(["allocate"] * 4 + ["free"] * 4 + ["incref", "mark_reusable", "reserve",
                                                                          "set_token_count", "subscribe",
                                                                          "unsubscribe"]))
        if op == "subscribe":
            recorders.append((EventRecorder(fast.events), EventRecorder(ref.events)))
            continue
        if op == "unsubscribe":
            for rec in recorders.pop() if recorders else ():
                rec.close()
            continue
        if op == "allocate":
            args, kwargs = allocate_call(data)
        elif op == "free":
            args, kwargs = (free_call(data, held, n),), {}
        elif op == "reserve":
            args, kwargs = (), {}
        elif op == "set_token_count":
            args, kwargs = (data.draw(st.sampled_from(held)) if held else 0, data.draw(st.integers(0, 4))), {}
        else:
            args, kwargs = ([data.draw(st.sampled_from(held))] if held else [0],), {}
        got, want = outcome(fast, op, *args, **kwargs), outcome(ref, op, *args, **kwargs)
        assert got == want, (step, op, args, kwargs)
        assert_same_state(pool_state(ref), pool_state(fast))
        assert fast.clock.now() == ref.clock.now() and fast.lock_acquisitions == ref.lock_acquisitions
        for a, b in recorders:
            assert a.events == b.events
        fast.check_invariants()
        if isinstance(got, list) and op in ("allocate", "reserve"):
            held.extend(got)
        held = [b for b in held if fast.refs_np[b] > 0]


@compiled
def test_every_argument_form_is_answered_alike(monkeypatch):
    """The edges of what the C code serves, each tried on a fresh pair of pools."""
    calls = [((), {"owner": o}) for o in (-2, -1, 0, 2**31 - 1, 2**31, 2**63, True, "x", None)]
    calls += [((n,), {}) for n in (0, 1, 2, True, 1.0, "1", -1, 2**63, None)]
    calls += [((1,), {"owner": 5, "size_class": 0}), ((), {"status": BlockStatus.PENDING}), ((), {"colour": 1})]
    calls += [((1, 2), {}), ((1,), {"n": 1})]
    for args, kw in calls:
        fast, ref = BlockPool(4, with_storage=False), python_pool(monkeypatch, 4, with_storage=False)
        for pool in (fast, ref):
            pool.set_token_count(pool.allocate(owner=7)[0], 3)  # block 0, an owner and tokens to reset
        assert outcome(fast, "allocate", *args, **kw) == outcome(ref, "allocate", *args, **kw), (args, kw)
        assert_same_state(pool_state(ref), pool_state(fast))
    for ids in ([0], (0,), [np.int64(0)], np.array([0]), [0, 0], [], [4], [-1], [2**63], [True], ["0"], [0.0]):
        fast, ref = BlockPool(4, with_storage=False), python_pool(monkeypatch, 4, with_storage=False)
        for pool in (fast, ref):
            pool.set_token_count(pool.allocate(owner=7)[0], 3)
        assert outcome(fast, "free", ids) == outcome(ref, "free", ids), ids
        assert_same_state(pool_state(ref), pool_state(fast))
        assert fast.clock.now() == ref.clock.now()


@compiled
def test_the_compiled_paths_leak_nothing():
    pool = BlockPool(4096, with_storage=False)
    pool.allocate(1000)  # ids past CPython's small-int cache: every id object is allocated, so a leak shows

    def churn():
        for _ in range(5000):
            pool.free(pool.allocate(1, owner=3))
            pool.free(pool.allocate())
            for bad in ([10**6], [0, 0]):  # handed to Python, which raises
                try:
                    pool.free(bad)
                except KVLabError:
                    pass
    churn()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        churn()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 10_000, f"{grown} bytes still held after 20,000 calls"
    pool.check_invariants()


@compiled
def test_a_pool_with_compiled_paths_is_collected():
    pool = BlockPool(16)
    pool.free(pool.allocate())
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None


@compiled
def test_subclasses_that_override_allocate_or_free_keep_their_methods():
    class Counting(BlockPool):
        calls = 0

        def allocate(self, *args, **kw):
            Counting.calls += 1
            return super().allocate(*args, **kw)

    pool = Counting(8, with_storage=False)
    assert pool._hot is None
    pool.free(pool.allocate())
    assert Counting.calls == 1 and pool.num_free_blocks == 8


@compiled
def test_a_binary_built_from_other_source_is_refused(tmp_path):
    edited = tmp_path / "_hotpath.c"
    edited.write_text("/* edited after the build */\n")
    with pytest.warns(UserWarning, match="changed after it was compiled"):
        assert kvlab.pool._load_hotpath(edited) is None
    assert kvlab.pool._load_hotpath() is kvlab.pool.HotPath  # the shipped source matches its binary


def test_kvlab_pure_python_switches_the_compiled_paths_off(monkeypatch):
    monkeypatch.setenv("KVLAB_PURE_PYTHON", "1")
    assert kvlab.pool._load_hotpath() is None


def test_clocks_must_count_in_ints():
    class FloatClock:
        def now(self):
            return 0.5

        tick = now

    with pytest.raises(ConfigError, match="0.5"):
        BlockPool(4, with_storage=False, clock=FloatClock())
    pool = BlockPool(4, with_storage=False, clock=WallClock())
    a, b = pool.allocate(), pool.allocate()
    assert 0 < pool.created_np[a[0]] < pool.created_np[b[0]]  # nanoseconds
    pool.free(a)
    pool.check_invariants()


@compiled
def test_replacing_the_clock_or_a_free_stack_is_caught():
    pool = BlockPool(4, with_storage=False)
    pool.check_invariants()
    pool.clock = kvlab.LogicalClock()
    with pytest.raises(AssertionError, match="fixed at construction"):
        pool.check_invariants()
    pool = BlockPool(4, with_storage=False)
    pool._free[0] = type(pool._free[0])("i", pool._free[0])
    with pytest.raises(AssertionError, match="fixed at construction"):
        pool.check_invariants()
