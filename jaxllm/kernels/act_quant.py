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
enough), Pallas' interpreter on the CPU for the tests. One program per row, held in registers
as power-of-two chunks (Triton's block sizes) of up to CHUNK elements, so it is read from HBM
once: a loop over chunks re-reading the row for the scale pass ran at 2.2x the bytes floor on
an H100 (silu*mul at 16,384 x 14,336: its rows overflowed the L2), and a one-row decode step
took 13 us for its 7 dependent chunk passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxllm.quantization.qarray import FP8_MAX
CHUNK = 4096  # elements of a row in one register block
MAX_CHUNKS = 16


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


def norm_quant_ref(x: jax.Array, w: jax.Array, eps: float, out_rows: int | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    return pad_rows(*quantize_ref(rms_norm_ref(x, w, eps)), out_rows)


def silu_mul_ref(gate: jax.Array, up: jax.Array | None = None) -> jax.Array:
    """silu(gate) * up; up None: gate [..., 2F] holds gate then up."""
    if up is None:
        F = gate.shape[-1] // 2
        gate, up = gate[..., :F], gate[..., F:]
    return jax.nn.silu(gate) * up


def silu_mul_quant_ref(gate: jax.Array, up: jax.Array | None = None, out_rows: int | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    return pad_rows(*quantize_ref(silu_mul_ref(gate, up)), out_rows)


def chunk_of(K: int) -> int:
    """The largest power of two dividing K, at most CHUNK."""
    return min(K & -K, CHUNK)


def supported(K: int) -> str | None:
    """Why a row of K elements is not taken (None: it is): the kernel holds a row in registers
    as K / chunk power-of-two chunks, unrolled."""
    if chunk_of(K) < 16 or K // chunk_of(K) > MAX_CHUNKS:
        return f"a row of {K} is not {MAX_CHUNKS} or fewer power-of-two chunks of 16 or more"
    return None


def num_warps(K: int) -> int:
    """About 32 float32 values of the row per thread, at least 4 warps, at most 16."""
    return max(4, min(16, 1 << max(0, (K // 1024 - 1).bit_length())))


def _quantize_out(ys: list, q_ref, s_ref, chunk: int, rows: int | None = None) -> None:
    """s = max|y| / 448 over the row's chunks (in registers), then y / s stored as fp8. `rows`:
    programs from this one on write a padding row (values and scale 0, as jnp.pad gives)."""
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(y.astype(jnp.float32)), axis=1, keepdims=True)
                                          for y in ys])
    s = jnp.maximum(amax, 1e-12) / FP8_MAX
    keep = None if rows is None else pl.program_id(0) < rows
    s_ref[...] = s if keep is None else jnp.where(keep, s, 0.0)
    for c, y in enumerate(ys):
        q = y.astype(jnp.float32) / s
        q_ref[:, pl.ds(c * chunk, chunk)] = (q if keep is None else jnp.where(keep, q, 0.0)).astype(q_ref.dtype)


def _norm_kernel(x_ref, w_ref, q_ref, s_ref, *, n: int, chunk: int, eps: float, rows: int | None = None):
    xs = [x_ref[:, pl.ds(c * chunk, chunk)] for c in range(n)]  # the row, read once
    ss = functools.reduce(jnp.add, [jnp.sum(jnp.square(x.astype(jnp.float32)), axis=1, keepdims=True) for x in xs])
    rinv = jax.lax.rsqrt(ss / (n * chunk) + eps)
    ys = [w_ref[:, pl.ds(c * chunk, chunk)] * (x.astype(jnp.float32) * rinv).astype(x.dtype)
          for c, x in enumerate(xs)]  # held in x's dtype, as the reference rounds them
    _quantize_out(ys, q_ref, s_ref, chunk, rows)


def _silu_mul_kernel(g_ref, *refs, n: int, chunk: int, hold, rows: int | None = None):
    """refs: (up, q, s), or (q, s) with gate and up the two halves of g_ref's row. silu(g) * u in
    float32 (XLA's fusion keeps the same excess precision), held until the scale is known as
    `hold` (float32; bfloat16 halves the registers, rounding y as the bf16 reference does)."""
    u_ref, q_ref, s_ref = refs if len(refs) == 3 else (g_ref, *refs)
    u0 = 0 if len(refs) == 3 else n * chunk
    ys = []
    for c in range(n):
        g = g_ref[:, pl.ds(c * chunk, chunk)].astype(jnp.float32)
        u = u_ref[:, pl.ds(u0 + c * chunk, chunk)].astype(jnp.float32)
        ys.append((g / (1.0 + jnp.exp(-g)) * u).astype(hold))
    _quantize_out(ys, q_ref, s_ref, chunk, rows)


def _call(kernel, rows: tuple, shared: tuple, K: int, interpret: bool, warps: int | None = None,
          out_rows: int | None = None):
    """One program per row of the `rows` arrays [T, *] (`shared` [1, *]: every program's);
    out: [T, K] fp8 and [T, 1] float32. `out_rows` (> T): that many rows out, those past T
    padding (zeros), so a consumer that pads x (the Mosaic fp8 decode matmul) gets it padded
    without a kernel of its own; their programs read row T - 1 and discard it."""
    T = rows[0].shape[0]
    R = out_rows or T
    if R > T:
        kernel = functools.partial(kernel, rows=T)
    last = lambda i: (jnp.minimum(i, T - 1), 0)  # noqa: E731
    specs = ([pl.BlockSpec((1, a.shape[1]), last) for a in rows]
             + [pl.BlockSpec((1, a.shape[1]), lambda i: (0, 0)) for a in shared])
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((R, K), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((R, 1), jnp.float32)),
        grid=(R,),
        in_specs=specs,
        out_specs=(pl.BlockSpec((1, K), lambda i: (i, 0)), pl.BlockSpec((1, 1), lambda i: (i, 0))),
        compiler_params=plt.CompilerParams(num_warps=warps or num_warps(K), num_stages=1),
        interpret=interpret,
        name="jaxllm_act_quant",
    )(*rows, *shared)


def pad_rows(q: jax.Array, s: jax.Array, out_rows: int | None) -> tuple[jax.Array, jax.Array]:
    """The references' padding rows (zeros), as the kernels' `out_rows` write them."""
    if not out_rows or out_rows == q.shape[0]:
        return q, s
    pad = ((0, out_rows - q.shape[0]), (0, 0))
    return jnp.pad(q, pad), jnp.pad(s, pad)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "out_rows"))
def norm_quant(x: jax.Array, w: jax.Array, eps: float, interpret: bool = False,
               out_rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, K], w [K] -> (rms_norm(x, w, eps) quantized per row: float8_e4m3fn [T, K], its
    scale float32 [T, 1]); `out_rows` rows where given, zeros past T."""
    K = x.shape[1]
    chunk = chunk_of(K)
    kernel = functools.partial(_norm_kernel, n=K // chunk, chunk=chunk, eps=eps)
    return _call(kernel, (x,), (w.astype(x.dtype).reshape(1, K),), K, interpret, out_rows=out_rows)


@functools.partial(jax.jit, static_argnames=("interpret", "hold", "warps", "out_rows"))
def silu_mul_quant(gate: jax.Array, up: jax.Array | None = None, interpret: bool = False,
                   hold: str = "float32", warps: int | None = None,
                   out_rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """gate, up [T, F] -> (silu(gate) * up quantized per row: float8_e4m3fn [T, F], float32
    [T, 1]); up None: gate is [T, 2F], gate then up in each row (a fused gate/up matmul's
    output, read in place: slices given to a kernel would be copied first). `hold` / `warps`:
    variants the benchmark times (scripts/bench_act_quant.py); the defaults are the engine's."""
    F = gate.shape[1] if up is not None else gate.shape[1] // 2
    chunk = chunk_of(F)
    kernel = functools.partial(_silu_mul_kernel, n=F // chunk, chunk=chunk, hold=jnp.dtype(hold))
    return _call(kernel, (gate,) if up is None else (gate, up), (), F, interpret, warps, out_rows)
