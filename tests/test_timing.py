"""kernels/timing.py: the checked timings behind the warm-up's choices by measurement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import timing


def test_counted_runs_the_call_count_it_is_given_one_compile():
    traces = []

    def fn(x, w):
        traces.append(1)
        return x @ w

    loop = jax.jit(timing.counted(fn))
    x, w = jnp.ones((4, 8)), jnp.full((8, 8), 0.5)
    seen = []
    for n in (1, 3):
        x_out, out = loop(n, x, w)
        np.testing.assert_allclose(out, x @ w)  # x unchanged (x + 0 * out): every call the same
        np.testing.assert_allclose(x_out, x)
        seen.append(len(traces))
    assert seen[0] == seen[1]  # the count is an argument: no new trace, no new compile


def test_marginal_timing_checks_then_times_each_candidate():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((128, 128)), jnp.float32)
    fns = {"mm": lambda x: x @ x, "mm_t": lambda x: (x.T @ x.T).T, "wrong": lambda x: x @ x + 1.0}
    times = timing.time_checked(fns, (x,), 3, "matmul", marginal=(1, 5), tol=1e-4)
    assert set(times) == {"mm", "mm_t"}  # the wrong one is checked out before any timing
    assert all(np.isfinite(t) for t in times.values())


def test_a_failing_candidate_is_logged_on_one_line(caplog):
    """`catch`: a candidate that raises is left out, its error's first line logged (XLA's statuses
    carry a multi-line source trace after it)."""
    import logging

    def boom(x):
        raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded\n=== Source Location Trace: ===\nx.cc:1")

    with caplog.at_level(logging.INFO, logger="jaxllm"):
        times = timing.time_checked({"ok": lambda x: x * 2, "boom": boom}, (jnp.ones(4),), reps=1,
                                    what="test", catch=True)
    assert set(times) == {"ok"}
    line = next(r.getMessage() for r in caplog.records if "boom" in r.getMessage())
    assert line.endswith("failed: RESOURCE_EXHAUSTED: Shared memory size limit exceeded")


def test_candidates_compile_in_parallel_threads(monkeypatch):
    """`compile_all`: every candidate lowered in turn and compiled on a pool of threads (the
    warm-up's compiles side by side), each name to its executable or to what its lowering or
    compile raised, in the order given."""
    import threading

    compiled_on = []
    real = jax.stages.Lowered.compile

    def compile_(self, *a, **kw):
        compiled_on.append(threading.current_thread().name)
        return real(self, *a, **kw)
    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_)

    def make(k):
        def fn(x):
            if k == 2:
                raise ValueError("no such tiling")
            return x * k
        return jax.jit(fn)

    x = jnp.arange(4.0)
    monkeypatch.setattr(timing, "compile_threads", lambda: 4)
    out = timing.compile_all({f"c{k}": make(k) for k in range(4)}, (x,))
    assert list(out) == ["c0", "c1", "c2", "c3"] and isinstance(out["c2"], ValueError)
    for k in (0, 1, 3):
        np.testing.assert_allclose(out[f"c{k}"](x), x * k)
    assert len(compiled_on) == 3 and all(n.startswith("jaxllm-compile") for n in compiled_on)
    monkeypatch.setattr(timing, "compile_threads", lambda: 1)  # one at a time: in this thread
    compiled_on.clear()
    timing.compile_all({"a": make(1), "b": make(3)}, (x,))
    assert compiled_on == [threading.current_thread().name] * 2


def test_a_compile_that_fails_beside_others_is_tried_again_alone(monkeypatch):
    import threading

    real = jax.stages.Lowered.compile
    tries = []

    def compile_(self, *a, **kw):  # fails on a pool thread, as a compile short of memory might
        on_pool = threading.current_thread().name.startswith("jaxllm-compile")
        tries.append(on_pool)
        if on_pool and len(tries) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while autotuning")
        return real(self, *a, **kw)
    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_)
    monkeypatch.setattr(timing, "compile_threads", lambda: 2)
    x = jnp.arange(4.0)
    out = timing.compile_all({"a": jax.jit(lambda x: x + 1), "b": jax.jit(lambda x: x * 2)}, (x,))
    np.testing.assert_allclose(out["a"](x), x + 1)
    np.testing.assert_allclose(out["b"](x), x * 2)
    assert tries.count(True) == 2 and tries.count(False) == 1  # the failed one again, alone


def test_more_argument_sets_are_called_in_turn_and_counted():
    """`more`: each timed call runs fn on args and then on each further set (the checked output
    is the last set's), and the time a call is divided among them; `turns` gives enough sets to
    read more bytes than an L2 holds, at most MAX_TURNS; `copies` gives other buffers."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    w0, w1 = (jnp.asarray(rng.standard_normal((64, 32)), jnp.float32) for _ in range(2))
    fns = {"mm": lambda x, w: x @ w}
    assert set(timing.time_checked(fns, (x, w0), 1, "mm", chain=2, ref=x @ w1, more=((w1,),))) == {"mm"}
    assert timing.time_checked(fns, (x, w0), 1, "mm", chain=2, ref=x @ w0, more=((w1,),)) == {}
    run = timing.in_turn(lambda x, w: x @ w, 2)
    np.testing.assert_allclose(run(x, w0, w1), x @ w1, rtol=1e-6)
    assert timing.turns(21 << 20, "gpu") == 7 and timing.turns(1 << 30, "gpu") == 1
    assert timing.turns(0, "gpu") == timing.turns(4096, "gpu") == timing.MAX_TURNS
    assert timing.turns(4096, "cpu") == 1
    (c,) = timing.copies({"w": w0, "n": None}, 1)
    assert c["n"] is None and c["w"] is not w0
    np.testing.assert_array_equal(c["w"], w0)
