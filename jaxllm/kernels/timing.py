"""Checked timing of candidate implementations, for the choices made by measurement at warm-up
(`prefill_choice.measured_choice`, `quantization/choice.py`)."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

import jax
import numpy as np

log = logging.getLogger("jaxllm")


def time_checked(fns: dict[str, Callable], args: tuple, reps: int, what: str, where: str = "",
                 tol: float = 2e-2, catch: bool = False, ref=None) -> dict[str, float]:
    """Median seconds per call of each jitted fn(*args) after one checked run: its output must be
    finite and within `tol` (relative) of `ref` (default: the first fn's output), else it is
    logged and left out. `catch`: a fn that raises is logged and left out too (else the error
    propagates)."""
    first = None if ref is None else np.asarray(ref, np.float32)
    times = {}
    for name, fn in fns.items():
        try:
            f = jax.jit(fn)
            out = np.asarray(jax.block_until_ready(f(*args)), np.float32)
            if first is None:
                first = out
            err = float(np.linalg.norm(out - first) / max(np.linalg.norm(first), 1e-30))
            if not np.isfinite(out).all() or err > tol:
                log.warning("%s %s: wrong result%s (rel err %.3g), not timed", what, name, where, err)
                continue
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                ts.append(time.perf_counter() - t0)
            times[name] = statistics.median(ts)
        except Exception as e:  # noqa: BLE001 - only with `catch`: that candidate is never chosen
            if not catch:
                raise
            log.info("%s %s%s failed: %s", what, name, where, str(e)[:200])
    return times
