"""A product of one or two rows with a dense weight on the CUDA cores: `gemv(x [M, K], w [K, N])`.

Why: a batch-1 step of a MoE model runs in a bucket of two tokens (engine/startup.py), and there
XLA's GEMM for the q/k/v projection (Qwen3-30B-A3B: [2048, 5120], 21 MB) took 11.4 us a layer on
an H200, 2.2x its bytes' time (session 37: a Triton GEMM of two rows without a K split, 80 CTAs
of 16-row tensor-core tiles). Two rows need no tensor core: each CTA streams a [K / k_splits,
block_n] strip of w and multiplies it by the rows on the CUDA cores, summing the products
elementwise in one [block_k, block_n] float32 tile per row (no reduction across threads a step)
that is reduced once at the end. With `k_splits` > 1 each split writes a float32 partial
[k_splits, M, N] that one XLA sum adds up (fused into the product's consumer where XLA can).

`gemv_ref` is the plain-jnp reference; `models/gemv_choice.py` measures the tilings against
XLA's dot per weight shape and row count at warm-up and `models/linear.linear` takes the choice.
A `pallas_call`: Triton on the GPU, Pallas' interpreter on the CPU (tests/test_gemv.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_ROWS = 2  # a [block_k, block_n] float32 accumulator a row: registers bound the rows


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_n: int = 64  # weight columns per CTA
    block_k: int = 64  # weight rows per step
    k_splits: int = 4  # CTAs along K per strip (float32 partials summed after)
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return f"gemv_{self.block_n}x{self.block_k}k{self.k_splits}"

    def fits(self, K: int, N: int) -> bool:
        return N % self.block_n == 0 and K % (self.block_k * self.k_splits) == 0


TILINGS = (Tiling(64, 64, 4), Tiling(64, 64, 8), Tiling(128, 64, 4), Tiling(64, 128, 2), Tiling(32, 64, 4))
BY_NAME = {t.name: t for t in TILINGS}


def gemv_ref(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)


def _kernel(x_ref, w_ref, o_ref, *, t: Tiling, k_steps: int, rows: int):
    j, ks = pl.program_id(0), pl.program_id(1)
    k0 = ks * (k_steps * t.block_k)

    def step(i, accs):
        k = k0 + i * t.block_k
        ws = w_ref[pl.ds(k, t.block_k), pl.ds(j * t.block_n, t.block_n)].astype(jnp.float32)
        return tuple(acc + x_ref[m, pl.ds(k, t.block_k)].astype(jnp.float32)[:, None] * ws
                     for m, acc in enumerate(accs))

    zero = jnp.zeros((t.block_k, t.block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, k_steps, step, (zero,) * rows)
    cols = pl.ds(j * t.block_n, t.block_n)
    for m, acc in enumerate(accs):
        out = jnp.sum(acc, axis=0)
        if t.k_splits > 1:
            o_ref[ks, m, cols] = out
        else:
            o_ref[m, cols] = out.astype(o_ref.dtype)


def unsupported(x_shape: tuple[int, ...], w_shape: tuple[int, ...], t: Tiling) -> str | None:
    """Why this tiling cannot take x [M, K] @ w [K, N], or None."""
    (M, K), (K2, N) = x_shape, w_shape
    if K != K2:
        return f"x's K {K} != w's {K2}"
    if not 1 <= M <= MAX_ROWS:
        return f"{M} rows (1..{MAX_ROWS})"
    if not t.fits(K, N):
        return f"tiling {t.name} does not fit K={K}, N={N}"
    return None


def gemv(x: jax.Array, w: jax.Array, tiling: Tiling = TILINGS[0], out_dtype=None,
         interpret: bool | None = None, partials: bool = False) -> jax.Array:
    """x [M, K] (M <= MAX_ROWS) @ w [K, N] -> [M, N] in `out_dtype` (default x's), float32 sums.
    `partials` (a tiling with k_splits > 1): the K splits' float32 partials [k_splits, M, N]
    unsummed, for a consumer that sums them as it loads (`rope_write.rope_write`)."""
    why = unsupported(x.shape, w.shape, tiling)
    if why:
        raise ValueError(f"gemv: {why}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    (M, K), N = x.shape, w.shape[1]
    out_dtype = out_dtype or x.dtype
    t = tiling
    shape = (t.k_splits, M, N) if t.k_splits > 1 else (M, N)
    out = pl.pallas_call(
        functools.partial(_kernel, t=t, k_steps=K // (t.block_k * t.k_splits), rows=M),
        grid=(N // t.block_n, t.k_splits),
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32 if t.k_splits > 1 else out_dtype),
        compiler_params=plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name="jaxllm_gemv",
    )(x, w)
    if partials:
        if t.k_splits == 1:
            raise ValueError(f"gemv: partials of {t.name}, a tiling without a K split")
        return out
    return out.sum(axis=0).astype(out_dtype) if t.k_splits > 1 else out
