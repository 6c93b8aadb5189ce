"""Decode-sized matmul on quantized weights, the weights read once as stored.

`qmatmul(x [..., K], w: QArray int4 | int8 | fp8 for [K, N]) -> [..., N]` for up to MAX_ROWS
rows (decode steps). Per scale group of g rows along K the weight is w = q * s + o, so a
group's share of the product needs no dequantized weight at all:

    x_g . w_g = (x_g . q_g) * s_g + (sum x_g) * o_g

The kernel loads the stored integers ([p/2, BN] bytes of two nibbles for int4, [c, BN] int8),
converts them to the dot's dtype in registers, runs the dot on the tensor cores (float32
accumulation) and applies the group's scale row (and offset times the row sums of x) to the
[M, BN] partial. int4 bytes hold rows j (low nibble) and j + p/2 (high) of each run of p rows
(`QArray.pack`, p = g, or 64 for GGUF Q4_K), so a run is two dots: the low nibbles against x's
first p/2 columns of the run, the high against the next p/2; each half lies in one scale group
(p = g: the same one; p = 2g: consecutive ones). int8 runs are groups of g rows (per-channel
weights: chunks of BLOCK_K rows under the one scale). fp8 weights (stored [N, K] for XLA's fp8
GEMM, per-channel or HF 128 x 128 block scales) run as int8 does, weight-only (x stays in its
dtype; W8A16), their [BN, run] tiles converted in registers and contracted on their last axis.

Grid (N / BN column strips, K splits): at decode the work is streaming W, so a matrix is cut
into strips x `k_splits` row ranges, one CTA each, enough to cover the SMs; with k_splits > 1
each split stores a float32 partial [k_splits, M, N] that one XLA sum combines (M x N x 4
bytes per split: small at decode). Rows of x are padded to a power of two >= 16 (the
tensor-core minimum). A `pallas_call`: Triton on the GPU, Pallas' interpreter on the CPU
(tests/test_qmatmul.py checks it against `QArray.dequantize` there). Which path the engine
uses per mode is `quantization/kernels.py`'s measured table.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxllm.quantization.qarray import QArray

MAX_ROWS = 64  # decode-sized steps; larger ones are compute-bound: the XLA path
BLOCK_K = 256  # int8 per-channel: rows per dot


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_n: int = 128  # weight columns per CTA
    k_splits: int = 1  # CTAs along K per strip (float32 partials summed by XLA)
    num_warps: int = 4
    num_stages: int = 3
    unroll: int = 1  # runs per loop iteration, their loads issued before any of their dots
    magic: bool = False  # int4 / int8 to float by bit operations, not conversion instructions

    @property
    def name(self) -> str:
        extra = (f"u{self.unroll}" if self.unroll > 1 else "") + ("m" if self.magic else "") + (
            f"w{self.num_warps}" if self.num_warps != 4 else "") + (
            f"s{self.num_stages}" if self.num_stages != 3 else "")
        return f"q_{self.block_n}k{self.k_splits}{extra}"


# The shipped tilings (measured per layout at warm-up, `quantization/choice.py`). The first
# four are session 17's; the rest, after its H200 run (int8 at 3.4-4x its floor, int4 6.6x+,
# the loop latency-bound): more loads in flight per CTA (`unroll`), narrow strips that need no
# K split (one kernel, no float32 partials to sum), 8 warps.
TILINGS = (Tiling(128, 1), Tiling(64, 4), Tiling(128, 4), Tiling(64, 8),
           Tiling(128, 1, unroll=4), Tiling(64, 4, unroll=2), Tiling(32, 1, unroll=4),
           Tiling(32, 1, unroll=2, num_warps=2), Tiling(256, 1, unroll=2, num_warps=8),
           Tiling(128, 2, unroll=2, num_warps=8),
           Tiling(128, 1, unroll=4, magic=True), Tiling(64, 4, unroll=2, magic=True),
           Tiling(32, 1, unroll=4, magic=True))
BY_NAME = {t.name: t for t in TILINGS}


def fp8_group(w: QArray) -> int | None:
    """Rows of K per scale of an fp8 weight ([N, K] values): K per channel ([N, 1] scales), bk
    for [N/bn, K/bk] blocks; None when the blocks do not tile the matrix."""
    N, K = w.values.shape[-2:]
    nb, kb = w.scale.shape[-2:]
    if (nb, kb) == (N, 1):
        return K
    return K // kb if N % nb == 0 and K % kb == 0 else None


def group_of(w: QArray) -> int:
    return fp8_group(w) if w.kind == "fp8" else w.group


def run_rows(w: QArray, k_splits: int = 1, unroll: int = 1) -> int:
    """Rows of K per run of the kernel's loop: an int4 nibble run p, an int8 group, or for
    per-channel int8 the largest power of two <= BLOCK_K / unroll that tiles each K split (so
    an iteration's loads stay BLOCK_K rows: unrolling splits them, it does not add to them)."""
    K = w.shape[-2]
    if w.kind == "int4":
        return w.pack or w.group
    if group_of(w) != K:
        return group_of(w)
    r = max(16, BLOCK_K // unroll)
    while r > 16 and K % (r * k_splits):
        r //= 2
    return r


def unsupported(x_shape: tuple[int, ...], w: QArray, t: Tiling) -> str | None:
    """Why this kernel cannot take (x, w, t), or None when it can."""
    if w.kind not in ("int4", "int8", "fp8") or len(w.values.shape) != 2:
        return f"{w.kind} weights of {len(w.values.shape)} dims (takes 2-D int4 / int8 / fp8)"
    K, N = w.shape
    if w.kind == "fp8" and fp8_group(w) is None:
        return f"fp8 scale blocks {w.scale.shape} that do not tile [{N}, {K}]"
    if w.kind == "fp8" and t.magic:  # the same kernel as the plain twin: never measured twice
        return "the magic conversion is for int4 / int8 (fp8 converts as it is)"
    rows = 1
    for d in x_shape[:-1]:
        rows *= d
    if rows > MAX_ROWS:
        return f"{rows} rows (decode-sized steps only, <= {MAX_ROWS})"
    if N % t.block_n:
        return f"N={N} is not a multiple of block_n={t.block_n}"
    r, g = run_rows(w, t.k_splits, t.unroll), group_of(w)
    half = r // 2 if w.kind == "int4" else r
    if half < 16 or half & (half - 1):
        return f"runs of {half} rows (the dot needs a power of two >= 16)"
    if w.kind == "int4" and r not in (g, 2 * g):
        return f"int4 nibble runs of {r} rows over scale groups of {g} (takes p = g or 2g)"
    if w.kind != "int4" and g != K and g % r:
        return f"{w.kind} groups of {g} rows"
    if K % (r * t.k_splits):
        return f"K={K} is not a multiple of {r} x k_splits={t.k_splits}"
    if (K // (r * t.k_splits)) % t.unroll:
        return f"{K // (r * t.k_splits)} runs per K split do not divide by unroll={t.unroll}"
    return None


MAGIC_INT4_BIAS = 128.0  # `to_float` of an int4 nibble q with magic: 128 + q


def to_float(q: jax.Array, kind: str, dtype, magic: bool) -> jax.Array:
    """The stored integers as the dot's dtype. Conversion instructions (u8 -> f32 -> bf16) run at
    a quarter of the integer rate on Hopper, which session 17's int8 / int4 figures point at
    (the int4 kernel slower per weight than int8); `magic` uses bit operations instead:
      int4 nibble q (uint8 [0, 16)): the float whose bits are 128.0's with q in the low mantissa
        bits, i.e. 128 + q exactly (the caller subtracts 128 * sum(x) * s: MAGIC_INT4_BIAS);
      int8 q: u = (q as uint8) ^ 0x80 = q + 128 in the mantissa of float32 256.0, i.e. 384 + q,
        one float32 subtraction gives q, and bfloat16 keeps its high 16 bits (exact: |q| <= 128).
    """
    if not magic:
        return q.astype(dtype)
    bits = lambda a, t: jax.lax.bitcast_convert_type(a, t)  # noqa: E731 - same width
    if kind == "int4":
        if dtype == jnp.bfloat16:
            return bits(q.astype(jnp.uint16) | 0x4300, jnp.bfloat16)
        if dtype == jnp.float16:
            return bits((q.astype(jnp.uint16) << 3) | 0x5800, jnp.float16)
        return bits((q.astype(jnp.uint32) << 16) | 0x43000000, jnp.float32).astype(dtype)
    u = bits(q, jnp.uint8).astype(jnp.uint32) ^ 0x80
    f = bits((u << 15) | 0x43800000, jnp.float32) - 384.0
    if dtype == jnp.bfloat16:
        return bits((bits(f, jnp.uint32) >> 16).astype(jnp.uint16), jnp.bfloat16)
    return f.astype(dtype)


def _kernel(x_ref, v_ref, s_ref, *refs, kind: str, run: int, group: int, runs: int, t: Tiling):
    """One CTA: column strip j, K split ks; refs = (offset,) when the weight has one, then out."""
    o_ref, out_ref = (refs[0], refs[1]) if len(refs) == 2 else (None, refs[0])
    j, ks = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * t.block_n, t.block_n)
    half = run // 2 if kind == "int4" else run

    def part(xs, q, row):
        """(xs . q) * s[row] + sum(xs) * o[row]: one scale group's share, float32 [M, BN]."""
        dot = plt.dot(xs, to_float(q, kind, xs.dtype, t.magic), trans_b=kind == "fp8")  # fp8: [BN, run]
        s = s_ref[pl.ds(row, 1), cols]
        acc = dot.astype(jnp.float32) * s
        bias = MAGIC_INT4_BIAS if t.magic and kind == "int4" else 0.0
        if o_ref is not None or bias:
            o = -bias * s if o_ref is None else o_ref[pl.ds(row, 1), cols] - bias * s
            acc += jnp.sum(xs.astype(jnp.float32), axis=1, keepdims=True) * o
        return acc

    def load(u):
        """Run u's operands: (x columns, weight tile(s), scale rows) -- one tuple per dot."""
        k0 = u * run
        if kind == "int4":
            packed = v_ref[pl.ds(u * half, half), cols]  # uint8 [p/2, BN]
            return ((x_ref[:, pl.ds(k0, half)], packed & 15, k0 // group),
                    (x_ref[:, pl.ds(k0 + half, half)], packed >> 4, (k0 + half) // group))
        if kind == "fp8":  # values stored [N, K]
            return ((x_ref[:, pl.ds(k0, run)], v_ref[cols, pl.ds(k0, run)], k0 // group),)
        return ((x_ref[:, pl.ds(k0, run)], v_ref[pl.ds(k0, run), cols], k0 // group),)

    def step(i, acc):
        first = (ks * runs + i * t.unroll)  # run index along K
        tiles = [load(first + j) for j in range(t.unroll)]  # every load before any dot
        for dots in tiles:
            for xs, q, row in dots:
                acc += part(xs, q, row)
        return acc

    M = x_ref.shape[0]
    acc = jax.lax.fori_loop(0, runs // t.unroll, step, jnp.zeros((M, t.block_n), jnp.float32))
    if t.k_splits > 1:
        out_ref[ks, :, cols] = acc
    else:
        out_ref[:, cols] = acc.astype(out_ref.dtype)


def qmatmul(x: jax.Array, w: QArray, tiling: Tiling = TILINGS[0],
            interpret: bool | None = None) -> jax.Array:
    """x [..., K] @ w (int4 / int8 / fp8 QArray for [K, N]) -> [..., N] in x's dtype."""
    why = unsupported(x.shape, w, tiling)
    if why is not None:
        raise ValueError(f"qmatmul {tiling.name}: {why}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    K, N = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    Mp = max(16, 1 << (M - 1).bit_length())
    x2 = jnp.pad(x2, ((0, Mp - M), (0, 0)))
    run = run_rows(w, tiling.k_splits, tiling.unroll)
    runs = K // (run * tiling.k_splits)
    if tiling.k_splits > 1:
        out_shape = jax.ShapeDtypeStruct((tiling.k_splits, Mp, N), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((Mp, N), x.dtype)
    scale = w.scale.astype(jnp.float32)
    if w.kind == "fp8":  # as int8's [K/g, N]: per channel [N, 1] -> [1, N] (free), blocks repeated
        nb = scale.shape[-2]
        scale = scale.reshape(1, N) if nb == N else jnp.repeat(scale.T, N // nb, axis=1)
    parts = [x2, w.values, scale]
    if w.offset is not None:
        parts.append(w.offset.astype(jnp.float32))
    out = pl.pallas_call(
        functools.partial(_kernel, kind=w.kind, run=run, group=group_of(w), runs=runs, t=tiling),
        grid=(N // tiling.block_n, tiling.k_splits),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="jaxllm_qmatmul",
    )(*parts)
    if tiling.k_splits > 1:
        out = out.sum(axis=0)
    return out[:M].astype(x.dtype).reshape(*lead, N)


def reference(x: jax.Array, w: QArray) -> jax.Array:
    """The plain-jnp definition: x @ the dequantized weight, in float32."""
    return jnp.matmul(x.astype(jnp.float32), w.dequantize(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
