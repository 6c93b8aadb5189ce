"""The dense linears' path for one- and two-row steps, chosen by measurement at warm-up.

On a GPU, one device, the warm-up calls `measure` with the (K, N) of each distinct dense weight
of the per-layer (unrolled) weights and the token buckets of up to `gemv.MAX_ROWS` tokens. For
each it times XLA's dot (as `linear.linear` computes it: one row padded to two) against every
`kernels/gemv.py` tiling that fits, in chained loops (`timing.time_checked`, outputs checked
against XLA's first) over copies of the weight in turn (`timing.turns`: more bytes than the L2
holds, so the weight is read from HBM as in a step), and keeps a gemv tiling only where it is at
least `MARGIN` faster.
`linear.linear` reads the choice at trace time (`tiling_for`); a shape never measured (larger
buckets, tensor parallelism, the CPU) keeps XLA's dot. The choices and timings are logged.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from jaxllm.kernels import gemv
from jaxllm.kernels.timing import copies, time_checked, turns

log = logging.getLogger("jaxllm")

# The per-layer weights `linear.linear` multiplies by (their first axis K, the rest N).
LINEARS = ("wqkv", "wq", "wk", "wv", "wo", "w_gu", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")
MARGIN = 0.97  # a gemv tiling replaces XLA's dot only below this fraction of its time
_CHOICE: dict[tuple[int, int, int, str], str] = {}  # (K, N, rows, dtype) -> tiling name
TIMINGS: dict[tuple[int, int, int, str], dict[str, float]] = {}


def clear() -> None:
    _CHOICE.clear()
    TIMINGS.clear()


def tiling_for(rows: int, w: jax.Array) -> gemv.Tiling | None:
    """The measured gemv tiling for x [rows, K] @ w [K, ...], or None (XLA's dot)."""
    if rows > gemv.MAX_ROWS or not _CHOICE:
        return None
    name = _CHOICE.get((w.shape[0], math.prod(w.shape[1:]), rows, str(w.dtype)))
    return None if name is None else gemv.BY_NAME[name]


def dense_shapes(layers) -> set[tuple[int, int, str]]:
    """(K, N, dtype) of every dense linear in per-layer weight dicts (quantized ones excluded):
    arrays, or their shapes (`jax.eval_shape`, as scripts/aot_kernels.py has them)."""
    out = set()
    for layer in layers or ():
        for name in LINEARS:
            w = layer.get(name) if isinstance(layer, dict) else None
            if isinstance(w, (jax.Array, jax.ShapeDtypeStruct)) and w.ndim >= 2:
                out.add((w.shape[0], math.prod(w.shape[1:]), str(w.dtype)))
    return out


def measure(shapes: set[tuple[int, int, str]], rows: list[int], reps: int = 5,
            chain: int = 20) -> dict[tuple, str]:
    """Time XLA's dot against each fitting gemv tiling per (K, N, dtype) and row count."""
    from jaxllm.models.linear import xla_linear  # XLA's path as `linear` takes it (it imports this)

    key = jax.random.key(0)
    for K, N, dtype in sorted(shapes):
        w = (jax.random.normal(key, (K, N), jnp.float32) / math.sqrt(K)).astype(dtype)
        more = tuple((c,) for c in copies(w, turns(w.nbytes) - 1))  # from HBM, as in a step
        for M in sorted(r for r in set(rows) if r <= gemv.MAX_ROWS):
            x = jax.random.normal(jax.random.fold_in(key, M), (M, K), jnp.float32).astype(dtype)
            fns = {"xla": xla_linear}
            fns.update({t.name: (lambda x, w, t=t: gemv.gemv(x, w, t)) for t in gemv.TILINGS
                        if gemv.unsupported(x.shape, w.shape, t) is None})
            if len(fns) == 1:
                continue
            times = time_checked(fns, (x, w), reps, "dense gemv", f" at [{M}, {K}] x [{K}, {N}]",
                                 catch=True, chain=chain, more=more)
            k = (K, N, M, dtype)
            TIMINGS[k] = times
            if "xla" not in times:
                continue
            best = min((n for n in times if n != "xla"), key=times.get, default=None)
            if best is not None and times[best] < MARGIN * times["xla"]:
                _CHOICE[k] = best
    if TIMINGS:
        log.info("dense linears at 1-2 rows by measurement ((K, N, rows) -> gemv tiling, else XLA): %s",
                 {k[:3]: v for k, v in _CHOICE.items()})
        log.info("dense linears' timings (us): %s",
                 {k[:3]: {n: round(s * 1e6, 1) for n, s in v.items()} for k, v in TIMINGS.items()})
    return dict(_CHOICE)
