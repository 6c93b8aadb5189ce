"""A matmul's activations quantized per token to fp8 in one pass, fused with what makes them.

fp8 W8A8 matmuls (`quantization.kernels`: XLA's fp8 GEMM, the ws GEMM, the Mosaic decode kernel)
take x quantized per row: x_q = x / s in float8_e4m3fn with s = max|x| / 448 per row. XLA
computes that as a reduction kernel and a convert kernel, each reading x, after the RMSNorm
(or silu(gate) * up) that wrote x: 17-25% of a prefill-sized fp8 matmul on an H200 (session 26).
Here the producer and the quantization are one kernel that reads its inputs from HBM once
(the second and third pass over a row re-read it from L2) and writes only x_q and s:

    norm_quant(x, w, eps)     = quantize(rms_norm(x, w, eps))       (before q/k/v, gate/up)
    silu_mul_quant(gate, up)  = quantize(silu(gate) * up)           (before down; or gate and
                                                                      up as one [T, 2F] array)

Each has a plain-jnp reference (the exact ops of `llama.rms_norm` / `jax.nn.silu` then
`quantization.kernels.quantize_rows_fp8`: the CPU path, so CPU output is unchanged) and a
`pallas_call` kernel: Triton on the GPU (memory-bound row work, where Triton's lowering is
enough), Pallas' interpreter on the CPU for the tests. One program per row; the row in
power-of-two chunks (Triton's block sizes) of up to CHUNK elements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

FP8_MAX = 448.0  # float8_e4m3fn
CHUNK = 4096  # elements of a row a program holds at once
NUM_WARPS = 4


def quantize_ref(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(y_q float8_e4m3fn [..., K], s float32 [..., 1]): the per-token quantization of every fp8
    W8A8 matmul (`quantization.kernels.quantize_rows_fp8`)."""
    yf = y.astype(jnp.float32)
    s = jnp.maximum(jnp.max(jnp.abs(yf), axis=-1, keepdims=True), 1e-12) / FP8_MAX
    return (yf / s).astype(jnp.float8_e4m3fn), s


def rms_norm_ref(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (the models' `llama.rms_norm`): float32 statistics, cast back before the weight
    (as HF does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def norm_quant_ref(x: jax.Array, w: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    return quantize_ref(rms_norm_ref(x, w, eps))


def silu_mul_ref(gate: jax.Array, up: jax.Array | None = None) -> jax.Array:
    """silu(gate) * up; up None: gate [..., 2F] holds gate then up."""
    if up is None:
        F = gate.shape[-1] // 2
        gate, up = gate[..., :F], gate[..., F:]
    return jax.nn.silu(gate) * up


def silu_mul_quant_ref(gate: jax.Array, up: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    return quantize_ref(silu_mul_ref(gate, up))


def chunk_of(K: int) -> int:
    """The largest power of two dividing K, at most CHUNK."""
    return min(K & -K, CHUNK)


def _cols(c, chunk: int, off: int = 0):
    """Chunk c of a row, from column `off` (c a Python int for a one-chunk row, else the loop's
    index)."""
    if isinstance(c, int):
        return pl.ds(off + c * chunk, chunk)
    return pl.ds(pl.multiple_of(off + c * chunk, chunk), chunk)


def _rows_loop(n: int, body, init):
    """body(c, carry) over the n chunks (a Python call for one chunk: no loop in the kernel)."""
    return body(0, init) if n == 1 else jax.lax.fori_loop(0, n, body, init)


def _quantize_out(y_of, n: int, q_ref, s_ref, cols, y0=None):
    """Second and third pass: s = max|y| / 448 over the chunks, then y / s stored as fp8."""
    if n == 1:
        y = y_of(0) if y0 is None else y0
        amax = jnp.max(jnp.abs(y.astype(jnp.float32)), axis=1, keepdims=True)
    else:
        amax = jax.lax.fori_loop(0, n, lambda c, m: jnp.maximum(
            m, jnp.max(jnp.abs(y_of(c).astype(jnp.float32)), axis=1, keepdims=True)),
            jnp.zeros((1, 1), jnp.float32))
    s = jnp.maximum(amax, 1e-12) / FP8_MAX
    s_ref[...] = s

    def store(c, carry):
        y = y_of(c) if (n > 1 or y0 is None) else y0
        q_ref[:, cols(c)] = (y.astype(jnp.float32) / s).astype(q_ref.dtype)
        return carry
    _rows_loop(n, store, 0)


def _norm_kernel(x_ref, w_ref, q_ref, s_ref, *, n: int, chunk: int, eps: float):
    K = n * chunk

    cols = functools.partial(_cols, chunk=chunk)

    def sumsq(c, acc):
        xf = x_ref[:, cols(c)].astype(jnp.float32)
        return acc + jnp.sum(xf * xf, axis=1, keepdims=True)
    ss = _rows_loop(n, sumsq, jnp.zeros((1, 1), jnp.float32))
    rinv = jax.lax.rsqrt(ss / K + eps)

    def y_of(c):
        x = x_ref[:, cols(c)]
        return w_ref[:, cols(c)] * (x.astype(jnp.float32) * rinv).astype(x.dtype)
    _quantize_out(y_of, n, q_ref, s_ref, cols)


def _silu_mul_kernel(g_ref, *refs, n: int, chunk: int):
    """refs: (up, q, s), or (q, s) with gate and up the two halves of g_ref's row."""
    u_ref, q_ref, s_ref = refs if len(refs) == 3 else (g_ref, *refs)
    u0 = 0 if len(refs) == 3 else n * chunk
    cols = functools.partial(_cols, chunk=chunk)

    def y_of(c):
        g = g_ref[:, cols(c)]
        sig = (1.0 / (1.0 + jnp.exp(-g.astype(jnp.float32)))).astype(g.dtype)
        return (g * sig) * u_ref[:, _cols(c, chunk, u0)]
    _quantize_out(y_of, n, q_ref, s_ref, cols)


def _call(kernel, rows: tuple, shared: tuple, K: int, interpret: bool):
    """One program per row of the `rows` arrays [T, *] (`shared` [1, *]: every program's);
    out: [T, K] fp8 and [T, 1] float32."""
    T = rows[0].shape[0]
    specs = ([pl.BlockSpec((1, a.shape[1]), lambda i: (i, 0)) for a in rows]
             + [pl.BlockSpec((1, a.shape[1]), lambda i: (0, 0)) for a in shared])
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T, K), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((T, 1), jnp.float32)),
        grid=(T,),
        in_specs=specs,
        out_specs=(pl.BlockSpec((1, K), lambda i: (i, 0)), pl.BlockSpec((1, 1), lambda i: (i, 0))),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="jaxllm_act_quant",
    )(*rows, *shared)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def norm_quant(x: jax.Array, w: jax.Array, eps: float, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [T, K], w [K] -> (rms_norm(x, w, eps) quantized per row: float8_e4m3fn [T, K], its
    scale float32 [T, 1])."""
    K = x.shape[1]
    chunk = chunk_of(K)
    kernel = functools.partial(_norm_kernel, n=K // chunk, chunk=chunk, eps=eps)
    return _call(kernel, (x,), (w.astype(x.dtype).reshape(1, K),), K, interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def silu_mul_quant(gate: jax.Array, up: jax.Array | None = None, interpret: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
    """gate, up [T, F] -> (silu(gate) * up quantized per row: float8_e4m3fn [T, F], float32
    [T, 1]); up None: gate is [T, 2F], gate then up in each row (a fused gate/up matmul's
    output, read in place: slices given to a kernel would be copied first)."""
    F = gate.shape[1] if up is not None else gate.shape[1] // 2
    chunk = chunk_of(F)
    kernel = functools.partial(_silu_mul_kernel, n=F // chunk, chunk=chunk)
    return _call(kernel, (gate,) if up is None else (gate, up), (), F, interpret)
