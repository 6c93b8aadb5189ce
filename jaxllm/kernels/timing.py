"""Checked timing of candidate implementations, for the choices made by measurement at warm-up
(`prefill_choice.measured_choice`, `quantization/choice.py`)."""

from __future__ import annotations

import logging
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax
import numpy as np

log = logging.getLogger("jaxllm")


# Calls per iteration of a chained loop. Each iteration of XLA's loop costs the host a fixed
# ~28 us (the H100 of session 28: a trivial chained call's time), more than a decode-sized
# matmul's kernel (8 rows of Llama-3-8B's gate/up in fp8: ~20 us of bytes); one call an iteration,
# every candidate of that layout timed within 2% of the others, and the warm-up chose by noise.
# UNROLL calls an iteration put that much more kernel time against the overhead.
UNROLL = 4

# Bytes the calls of a timing loop read in turn before one repeats: twice the 50 MB L2 of an H100
# or H200, so each call reads its weights from HBM, as in a model step (which reads gigabytes
# between two uses of a layer's weight). Session 39's H100: one [2048, 5120] bf16 weight (21 MB)
# called again and again stayed in L2, where `kernels/gemv.py` beat XLA's dot; in the step, from
# HBM, it took 19 us a layer against XLA's 11, and the warm-up had chosen it (5.18 ms against
# 4.33 ms a Qwen3-30B-A3B batch-1 step).
TURN_BYTES = 128 << 20
MAX_TURNS = 16


def turns(nbytes: int, platform: str | None = None) -> int:
    """Argument sets a timing takes in turn (`time_checked(more=...)`) when each call reads
    `nbytes` of weights: enough to exceed TURN_BYTES, at most MAX_TURNS; one off a GPU (the
    warm-up measures on GPUs only, and Pallas' interpreter would run each set in turn)."""
    if (platform or jax.default_backend()) != "gpu":
        return 1
    return max(1, min(MAX_TURNS, -(-TURN_BYTES // max(int(nbytes), 1))))


def copies(tree, n: int) -> list:
    """n fresh copies of a pytree of arrays (other buffers, the same values)."""
    return [jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, tree) for _ in range(n)]


def in_turn(fn: Callable, sets: int) -> Callable:
    """fn(x, *rest) over `sets` argument sets in turn: (x, *set_1, ..., *set_n) -> the last call's
    output, each call's x depending on the previous call's output (as `chained`)."""
    def run(x, *flat):
        n = len(flat) // sets
        out = None
        for i in range(sets):
            if out is not None:
                x = x + (out.reshape(-1)[0] * 0).astype(x.dtype)
            out = fn(x, *flat[i * n:(i + 1) * n])
        return out
    return run


def chained(fn: Callable, n: int, unroll: int = 1) -> Callable:
    """fn(x, *rest) run n times in one jitted loop, each call's x depending on the last call's
    output (x + 0 * out[0]) and its other arguments passed through an optimization barrier
    with x (else XLA hoists their loop-invariant work, a weight's dequantization, out of the
    loop), so XLA neither hoists nor merges the calls: the loop's time / n is the kernel's time
    without a host dispatch per call. Returns (x, the last call's output): one compile serves
    the check and the timing. A decode-sized matmul takes microseconds; timed one call at a
    time (block_until_ready around each), the H100 warm-up of session 21 read 150-300 us for
    every fp8 layout, the dispatch's time, and chose among the paths by noise. `unroll`: calls
    per iteration of the loop (still n in all), so its fixed cost an iteration is shared."""
    return lambda x, *rest: _loop(fn, n, x, rest, unroll=max(1, min(unroll, n)))


def counted(fn: Callable) -> Callable:
    """`chained` with the call count an argument: (n, x, *rest) -> (x, the last call's output),
    one compile for every n (XLA's while loop, no unrolling), so two counts time the marginal
    cost of a call without what each execution costs once (`time_checked(marginal=...)`)."""
    return lambda n, x, *rest: _loop(fn, n, x, rest)


def _loop(fn: Callable, n, x, rest: tuple, unroll: int = 1):
    def body(_, carry):
        x, _ = carry
        x, args = jax.lax.optimization_barrier((x, rest))
        out = fn(x, *args)
        return x + (out.reshape(-1)[0] * 0).astype(x.dtype), out
    first = jax.eval_shape(fn, x, *rest)
    return jax.lax.fori_loop(0, n, body, (x, jax.numpy.zeros(first.shape, first.dtype)), unroll=unroll)


def loop_floor(x: jax.Array, reps: int = 5, chain: int = 20, unroll: int = 1) -> float:
    """Seconds per call that `time_checked(..., chain=chain)` reports for a call that does almost
    nothing (x[..., :1]): the loop's and the dispatch's share of every chained timing, logged
    beside them so a reader can tell kernel time from overhead (it is the same for every
    candidate, so it never changes a choice)."""
    return time_checked({"floor": lambda x: x[..., :1]}, (x,), reps, "timing floor",
                        chain=chain, unroll=unroll)["floor"]


def compile_threads() -> int:
    """Compiles at once: half the host's cores, at most 8 (each compile is multi-threaded too);
    the step's buckets (`engine/compile.py`) and the warm-up's candidates alike."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def compile_all(jitted: dict[str, Callable], args: tuple, compiler_options: dict | None = None
                ) -> dict[str, Callable | Exception]:
    """Each jitted fn lowered for `args` in turn (tracing holds the GIL) and compiled on a thread
    pool (XLA's compiles do not): name -> its executable, or the exception its lowering or
    compile raised. A warm-up's candidates (about 20 MoE grouped-matmul implementations at each
    row count, most of them Mosaic or Triton kernels) then compile side by side rather than one
    after another, and are timed one at a time. A compile that fails on the pool is tried again
    alone (one that cannot compile at all is thus tried twice)."""
    out: dict[str, Callable | Exception] = {}
    lowered = {}
    for name, fn in jitted.items():
        try:
            lowered[name] = fn.lower(*args)
        except Exception as e:  # noqa: BLE001 - reported where that candidate is checked
            out[name] = e

    def build(low):
        try:
            return low.compile(*([compiler_options] if compiler_options else []))
        except Exception as e:  # noqa: BLE001 - as above
            return e
    workers = min(len(lowered), compile_threads())
    if workers <= 1:
        out.update({name: build(low) for name, low in lowered.items()})
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="jaxllm-compile") as pool:
            futures = {name: pool.submit(build, low) for name, low in lowered.items()}
            out.update({name: f.result() for name, f in futures.items()})
        for name, low in lowered.items():  # a compile that failed beside others (device memory
            if isinstance(out[name], Exception):  # for autotuning, say) is tried again alone
                out[name] = build(low)
    return {name: out[name] for name in jitted}


def time_checked(fns: dict[str, Callable], args: tuple, reps: int, what: str, where: str = "",
                 tol: float = 2e-2, catch: bool = False, ref=None, chain: int = 0,
                 compiler_options: dict | None = None, unroll: int = 1,
                 marginal: tuple[int, int] | None = None, more: tuple[tuple, ...] = ()
                 ) -> dict[str, float]:
    """Median seconds per call of each jitted fn(*args) after one checked run: its output must be
    finite and within `tol` (relative) of `ref` (default: the first fn's output; a `ref` with
    fewer leading rows than the outputs is compared with their first rows), else it is
    logged and left out. `catch`: a fn that raises is logged and left out too (else the error
    propagates). `chain` > 0: each of the `reps` timings runs `chained(fn, chain)` and counts
    one call as its time / chain (kernels shorter than a dispatch; `unroll` calls an iteration
    of its loop). `marginal` (a, b): each timing runs `counted(fn)` with a and with b calls and
    counts (t_b - t_a) / (b - a), a call's cost without what an execution costs once (one compile;
    the check runs one call). `compiler_options`: XLA's, for every fn's compile (e.g. no GEMM
    autotuning). `more`: further sets of the arguments after x (other weights, other routings;
    `turns`, `copies`), each call of the timing running fn on args and then on each set in turn
    (`in_turn`) and counting as 1 + len(more) calls; the output checked is the last set's."""
    first = None if ref is None else np.asarray(ref, np.float32)
    sets = 1 + len(more)
    if more:
        fns = {name: in_turn(fn, sets) for name, fn in fns.items()}
        args = (*args, *(a for m in more for a in m))
    # chained / counted: one program, checked on its (last) call's output, then timed
    if marginal:
        lead, per, wrap = (marginal[0],), 1, counted
    elif chain:
        lead, per, wrap = (), chain, lambda fn: chained(fn, chain, unroll)
    else:
        lead, per, wrap = (), 1, lambda fn: fn
    compiled = compile_all({name: jax.jit(wrap(fn)) for name, fn in fns.items()}, (*lead, *args),
                           compiler_options)
    times = {}
    for name in fns:
        try:
            timed = compiled[name]
            if isinstance(timed, Exception):
                raise timed
            out = timed(*lead, *args)
            out = np.asarray(jax.block_until_ready(out[1] if marginal or chain else out), np.float32)
            if first is None:
                first = out
            head = out[:first.shape[0]] if out.ndim and first.ndim and first.shape[0] < out.shape[0] else out
            err = float(np.linalg.norm(head - first) / max(np.linalg.norm(first), 1e-30))
            if not np.isfinite(out).all() or err > tol:
                log.warning("%s %s: wrong result%s (rel err %.3g), not timed", what, name, where, err)
                continue
            def clock(*lead, timed=timed) -> float:
                t0 = time.perf_counter()
                jax.block_until_ready(timed(*lead, *args))
                return time.perf_counter() - t0
            ts = []
            for _ in range(reps):
                if marginal:  # the difference of two call counts: a call's cost alone
                    a, b = marginal
                    t_a = clock(a)
                    ts.append((clock(b) - t_a) / (b - a) / sets)
                else:
                    ts.append(clock() / per / sets)
            times[name] = statistics.median(ts)
        except Exception as e:  # noqa: BLE001 - only with `catch`: that candidate is never chosen
            if not catch:
                raise
            # the message's first line (XLA appends a multi-line source trace to its statuses)
            msg = (str(e).strip() or type(e).__name__).splitlines()[0][:200]
            log.info("%s %s%s failed: %s", what, name, where, msg)
    return times
