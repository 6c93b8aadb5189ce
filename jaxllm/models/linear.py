"""The dense linears of a model step: XLA's dot (a one-token product padded to two rows on a GPU)
or, where the warm-up measured it faster, `kernels/gemv.py`; quantized weights (QArray) take their
own matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels import gemv
from jaxllm.models import gemv_choice


def consumers(w: dict, *names: str) -> list:
    """The linears of `w` a normed input feeds (fp8 W8A8 ones take it quantized: `act.norm`)."""
    return [w[n] for n in names if n in w]


# Multiply-adds of a one-row matmul below which XLA's GPU compiler rewrites it as multiply-then-
# reduce (its threshold is 10M, `IsMatrixMultiplicationTooSmallForRewriting`), with a margin; larger
# ones stay GEMMs unpadded (Llama-3-8B's at batch 1: 1.07x the step's floor on an H100, session 25).
GEMV_REWRITE_BELOW = 12_000_000


def linear(x: jax.Array, w, spec: str | None = None, out_dtype=None) -> jax.Array:
    """x [T, ...] @ w (or `jnp.einsum(spec, x, w)`); a quantized weight (QArray) takes its own
    matmul (`x @ w`). `out_dtype`: the result's (default x's), summed in it.

    On a GPU a one-token product is computed on x padded to two rows: for a single row XLA's GPU
    compiler rewrites a vector-matrix product below ~10M multiply-adds as multiply-then-reduce,
    and inside a model step it kept the two apart, writing the weight-sized products to memory
    and summing them in a second kernel (3x the weight's bytes, the products rounded to bf16
    first): Qwen3-30B-A3B's q/k/v/o projections at batch 1, every layer, and Llama-3.2-1B's
    o projection (`scripts/aot_kernels.py`). Two rows stay a GEMM that reads the weight once;
    row 0 is the same product. Larger weights are left alone (`GEMV_REWRITE_BELOW`).

    One or two rows whose weight shape the warm-up measured faster through `kernels/gemv.py`
    (`gemv_choice`: CUDA-core products, a K split) take that kernel instead."""
    if not isinstance(w, jax.Array):
        return x @ w
    tiling = gemv_choice.tiling_for(x.shape[0], w) if x.ndim == 2 and x.shape[1] == w.shape[0] else None
    if tiling is not None:
        y = gemv.gemv(x, w.reshape(w.shape[0], -1), tiling, out_dtype=out_dtype or x.dtype)
        return y.reshape(x.shape[0], *w.shape[1:])
    return xla_linear(x, w, spec, out_dtype)


def xla_linear(x: jax.Array, w: jax.Array, spec: str | None = None, out_dtype=None) -> jax.Array:
    """`linear`'s XLA path: a one-row product padded to two rows on a GPU (see `linear`)."""
    pad = x.shape[0] == 1 and w.size < GEMV_REWRITE_BELOW and jax.default_backend() == "gpu"
    if pad:
        x = jnp.pad(x, ((0, 1),) + ((0, 0),) * (x.ndim - 1))
    kw = {} if out_dtype is None else dict(preferred_element_type=out_dtype)
    y = jnp.dot(x, w, **kw) if spec is None else jnp.einsum(spec, x, w, **kw)
    return y[:1] if pad else y
