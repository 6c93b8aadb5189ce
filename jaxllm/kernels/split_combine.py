"""The decode kernel's split partials merged in one kernel (`pallas_call`: Triton on the GPU,
Pallas' interpreter on the CPU for the tests); `decode_schedule.combine` is its reference.

With few (token, KV head) pairs the decode kernel (`mosaic_decode.py`) cuts each context into
N splits and writes, per split, its normalized partial output and log2-sum-exp; merging them is
a softmax over N of the sums weighting the partials. XLA compiles the reference into three
kernels a layer (the weights with their max, their sum, the weighted sum), each a launch and a
round trip through memory; this is one, one program per (token, KV head): its N x G sums and
N x G x D partials are loaded once, merged in registers and written as the model's dtype
(cut by query rows over several programs where they are many, `chunk_rows`).
A batch-1 Llama-3-8B decode step (32 layers, split 16 ways) compiles to 492 kernels with the
reference and 426 with this (`scripts/aot_kernels.py --tokens 8`, jax 0.10.2 for an H100).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _kernel(active_ref, lse_ref, o_ref, out_ref, *, rows: int):
    """Program (t, k, c): rows c * rows .. (c + 1) * rows of token t's KV head k."""
    t, c = pl.program_id(0), pl.program_id(2)
    n = lse_ref.shape[0]
    split = jnp.arange(n, dtype=jnp.int32)
    ok = (split < active_ref[0]) & (t < active_ref[1])  # [N]: partials the kernel wrote
    lse = jnp.where(ok[:, None], lse_ref[:, pl.ds(c * rows, rows)], -jnp.inf)  # [N, rows]
    top = jnp.max(lse, axis=0)
    top = jnp.where(top > -jnp.inf, top, 0.0)  # all splits empty (padding): weights 0
    w = jnp.exp2(lse - top[None, :])
    o = jnp.where(ok[:, None, None], o_ref[...], 0.0)  # [N, G, D]
    num = jnp.sum(w[:, :, None] * o, axis=0)
    den = jnp.sum(w, axis=0)
    out_ref[...] = (num / jnp.where(den == 0.0, 1.0, den)[:, None]).astype(out_ref.dtype)


MAX_ELEMENTS = 16 * 8 * 128  # a program's partials in registers (64 KB of float32)
CHUNK_ELEMENTS = 4096  # partials a program takes when the rows can be cut (16 KB)


def fits(o_part: jax.Array) -> bool:
    """Triton's blocks are powers of two (the split count, rows and head dim must be), and a
    program holds its N x rows x D partials in registers (`MAX_ELEMENTS` for one row at least:
    N up to 128 splits at D 128)."""
    n, _, _, rows, d = o_part.shape
    return all(x & (x - 1) == 0 for x in (n, rows, d)) and n * d <= MAX_ELEMENTS


def chunk_rows(n: int, rows: int, d: int) -> int:
    """Rows a program merges: the most, a power of two dividing `rows`, whose N x rows x D
    partials stay within CHUNK_ELEMENTS (at least 1). Session 37's H200 profile: one program a
    (token, KV head) holding all 16 x 8 x 128 partials took 4.3 us a layer of a batch-1 step;
    cut by rows, the (token, KV head) pairs' loads spread over rows / chunk times the CTAs."""
    r = rows
    while r > 1 and n * r * d > CHUNK_ELEMENTS:
        r //= 2
    return r


def combine(o_part: jax.Array, lse: jax.Array, active: jax.Array, dtype,
            interpret: bool = False) -> jax.Array:
    """o_part [N, T, K, G, D] f32, lse [N, T, K, >= G] (log2), active [>= 2] int32 (splits in
    use, real tokens: `decode_schedule.active_splits`) -> [T, K * G, D] of `dtype`."""
    n, T, K, rows, D = o_part.shape
    rc = chunk_rows(n, rows, D)
    kernel = pl.pallas_call(
        lambda *refs: _kernel(*refs, rows=rc),
        out_shape=jax.ShapeDtypeStruct((T, K, rows, D), dtype),
        grid=(T, K, rows // rc),
        in_specs=[pl.BlockSpec((2,), lambda t, k, c: (0,)),
                  pl.BlockSpec((n, None, None, lse.shape[-1]), lambda t, k, c: (0, t, k, 0)),
                  pl.BlockSpec((n, None, None, rc, D), lambda t, k, c: (0, t, k, c, 0))],
        out_specs=pl.BlockSpec((None, None, rc, D), lambda t, k, c: (t, k, c, 0)),
        compiler_params=plt.CompilerParams(num_warps=4 if n * rc * D <= 8192 else 8, num_stages=1),
        interpret=interpret,
        name="jaxllm_split_combine",
    )
    out = kernel(active[:2].astype(jnp.int32), lse, o_part)
    return out.reshape(T, K * rows, D)
