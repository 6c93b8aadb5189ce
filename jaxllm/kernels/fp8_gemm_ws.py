"""Warp-specialized Hopper fp8 W8A8 GEMM for prefill-sized steps (Mosaic GPU), scales fused.

`fp8_gemm(xq [M, K] e4m3, sx [M] f32, w [N, K] e4m3, sw [N] f32) -> [M, N] bf16` =
(xq @ w^T) * sx[:, None] * sw[None, :], the per-token / per-channel W8A8 product of vLLM's
`--quantization fp8`. Through XLA the fp8 GEMM (cuBLASLt) writes a float32 product and one more
fusion scales it: on the H200, 1,050-1,120 TFLOP/s at 8,192 tokens against torch's
`_scaled_mm` at 1,330-1,470 (issue 17 wants >= 1,300). Here the scales are applied to the
accumulator in registers and bf16 is all that is written.

Schedule (the structure of JAX's `hopper_matmul_mgpu.py`, for 8-bit operands): a persistent CTA
per SM walks the (row block, column strip) tiles in snake order (`_snake`: a band of up to
`band` strips at a time, so the strips' weights stay in L2 while the row blocks pass); a memory
warpgroup streams the tile's [bm, bk] rows of xq and [bn, bk] rows of w through a `stages`-deep
ring (`plgpu.emit_pipeline_warp_specialized`, 40 registers); two compute warpgroups each take
64 of the bm = 128 rows and the whole strip: wgmma with A = their rows of the xq tile and
B = the w tile's transposed view (8-bit wgmma wants both operands K-major, which is how
both are stored), accumulators [64, bn] float32 in registers. Each compute warpgroup TMA-copies
its rows' sx and the strip's sw into shared memory when its tile starts, scales the accumulator
when the K loop ends, and TMA-stores the bf16 tile through shared memory while the next tile's
copies are in flight.

Checked against the plain product in Mosaic GPU's CPU interpreter (race detector on) and
lowered for cuda in tests/test_fp8_gemm_ws.py; timed by `bench_quant.py matmul --tokens 8192`
("fp8_w8a8_ws_*" beside XLA's fp8 GEMM and torch `_scaled_mm`): on an H200 1.07-1.18x XLA's
GEMM with the activations' quantization, 1,474-1,582 TFLOP/s alone. The engine routes a layout's
prefill-sized steps to it where its warm-up measures it faster (`quantization/choice.measure_gemm`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import mgpu_compat

KERNEL_NAME = "jaxllm_fp8_gemm"
WG_ROWS = 64  # wgmma M: rows a compute warpgroup multiplies
SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class GemmTiling:
    block_n: int = 256  # columns a tile (both compute warpgroups)
    block_k: int = 128  # K a pipeline step (128 fp8 bytes: one swizzle row)
    stages: int = 3
    band: int = 8  # strips walked together (planar_snake's tile width)
    block_m: int = 2 * WG_ROWS
    chained: bool = False  # a CTA's tiles as one pipeline of pipelines (as moe_gmm_ws.WsTiling's)

    @property
    def name(self) -> str:
        return f"fg_{self.block_m}x{self.block_n}x{self.block_k}s{self.stages}b{self.band}" + (
            "c" if self.chained else "")

    def smem_bytes(self) -> int:
        ring = self.stages * (self.block_m + self.block_n) * self.block_k  # 1-byte operands
        return ring + 2 * WG_ROWS * self.block_n * 2 + 2 * (WG_ROWS + self.block_n) * 4 + 1024

    def unsupported(self, M: int, K: int, N: int) -> str | None:
        if N % self.block_n or K % self.block_k or self.block_k % 128:
            return f"N={N} / K={K} not multiples of block_n={self.block_n} / block_k={self.block_k} (a multiple of 128)"
        if self.smem_bytes() > SMEM_LIMIT:
            return f"{self.smem_bytes()} bytes of shared memory"
        if self.chained and (K // self.block_k) % self.stages:
            return f"chained: K={K} is {K // self.block_k} steps, not a multiple of the {self.stages}-deep ring"
        return None


TILINGS = (GemmTiling(256, 128, 3), GemmTiling(128, 128, 5), GemmTiling(256, 128, 3, band=16))
CHAINED = (GemmTiling(256, 128, 2, chained=True), GemmTiling(128, 128, 4, chained=True))  # untimed
BY_NAME = {t.name: t for t in TILINGS + CHAINED}



def _snake(idx, m_iters: int, n_iters: int, band: int):
    """Tile idx -> (row block, strip): bands of `w` strips (w the largest divisor of n_iters up
    to `band`), each walked row block by row block, every other band bottom-up, so a band's
    weights stay in L2 while the row blocks pass (the order of `plgpu.planar_snake`, whose
    remainder band divides by zero when `band` divides the strips: a trap on the CPU)."""
    w = max(d for d in range(1, min(band, n_iters) + 1) if n_iters % d == 0)
    b, r = lax.div(idx, jnp.int32(w * m_iters)), lax.rem(idx, jnp.int32(w * m_iters))
    m = lax.div(r, jnp.int32(w))
    m = jnp.where(lax.rem(b, jnp.int32(2)) == 0, m, m_iters - 1 - m)
    return m, b * w + lax.rem(r, jnp.int32(w))


def _body(x_gmem, w_gmem, sx_gmem, sw_gmem, o_gmem, *scratch, t: GemmTiling, interpret: bool):
    """x [Mp, K], w [N, K] (e4m3), sx [1, Mp], sw [1, N] (float32) -> o [Mp, N] bf16."""
    Mp, K = x_gmem.shape
    N = w_gmem.shape[0]
    bm, bn, bk = t.block_m, t.block_n, t.block_k
    m_iters, n_iters = Mp // bm, N // bn

    def pipeline(body, ctx, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(K // bk,), memory_registers=40, pipeline_state=state,
            in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (0, k), transforms=mgpu_compat.swizzled(bk, 1)),
                      plgpu.BlockSpec((bn, bk), lambda k: (0, k), transforms=mgpu_compat.swizzled(bk, 1))],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=ctx)

    ignore = lambda *_, **__: None  # noqa: E731 -- allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        out_smem=plgpu.SMEM((2, WG_ROWS, bn), o_gmem.dtype, transforms=mgpu_compat.swizzled(bn, 2)),
        sx_smem=plgpu.SMEM((2, 1, WG_ROWS), jnp.float32),
        sw_smem=plgpu.SMEM((2, 1, bn), jnp.float32),
        scale_bar=plgpu.Barrier(num_arrivals=2, num_barriers=2),  # sx and sw, one per warpgroup
        collective_axes="wg")
    def _scope(allocs, out_smem, sx_smem, sw_smem, scale_bar):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _(info: plgpu.NDLoopInfo):
            mi, nj = _snake(info.index[0], m_iters, n_iters, t.band)
            rows = pl.ds(mi * bm + wg * WG_ROWS, WG_ROWS)
            cols = pl.ds(nj * bn, bn)

            def ctx(eval_pipeline):
                plgpu.copy_gmem_to_smem(sx_gmem.at[:, rows], sx_smem.at[wg], scale_bar.at[wg])
                plgpu.copy_gmem_to_smem(sw_gmem.at[:, cols], sw_smem.at[wg], scale_bar.at[wg])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((WG_ROWS, bn), jnp.float32))
                def _(acc_ref):
                    eval_pipeline(acc_ref)
                    plgpu.barrier_wait(scale_bar.at[wg])
                    sx = sx_smem.at[wg][0, :]
                    sw = sw_smem.at[wg][0, :]
                    acc = (acc_ref[...] * lax.broadcast_in_dim(sx, (WG_ROWS, bn), [0])
                           * lax.broadcast_in_dim(sw, (WG_ROWS, bn), [1]))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's last store
                    out_smem[wg] = acc.astype(o_gmem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], o_gmem.at[rows, cols])

            def mma(_, x_smem, w_smem, acc_ref):
                a = x_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)]
                if not interpret or mgpu_compat.INTERPRETER_TRANSPOSES:
                    plgpu.wgmma(acc_ref, a, w_smem.transpose((1, 0)))
                else:  # jax 0.10's interpreter cannot read a transposed view: a staged copy
                    scratch[0].at[wg][...] = w_smem[...].T
                    plgpu.wgmma(acc_ref, a, scratch[0].at[wg])
                plgpu.wgmma_wait(0)
                return acc_ref

            def run(state=None):
                pipeline(mma, ctx, state)(x_gmem.at[pl.ds(mi * bm, bm)], w_gmem.at[cols], allocations=allocs)
            if t.chained:  # every tile is live: a CTA's last is the one with no next
                last = info.index[0] + lax.axis_size("sm") >= m_iters * n_iters
                mgpu_compat.run_chained(run, info.local_index == 0, last)
            else:
                run()

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def fp8_gemm(xq: jax.Array, sx: jax.Array, w: jax.Array, sw: jax.Array, tiling: GemmTiling = TILINGS[0],
             interpret: bool = False, num_sms: int = 132, out_dtype=jnp.bfloat16) -> jax.Array:
    """xq [M, K] e4m3 with per-row scales sx [M], w [N, K] e4m3 with per-column scales sw [N]
    -> (xq @ w^T) * sx * sw as [M, N] out_dtype (rows padded to whole 128-row blocks inside)."""
    M, K = xq.shape
    N = w.shape[0]
    if w.shape[1] != K or xq.dtype != jnp.float8_e4m3fn or w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_gemm takes e4m3 x [M, K] and w [N, K], got {xq.dtype}{list(xq.shape)}"
                         f" and {w.dtype}{list(w.shape)}")
    why = tiling.unsupported(M, K, N)
    if why is not None:
        raise ValueError(f"fp8_gemm {tiling.name}: {why}")
    Mp = -(-M // tiling.block_m) * tiling.block_m
    sxp = sx.reshape(1, M).astype(jnp.float32)
    if Mp > M:
        xq, sxp = jnp.pad(xq, ((0, Mp - M), (0, 0))), jnp.pad(sxp, ((0, 0), (0, Mp - M)))
    kw, scratch = {}, []
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        kw["interpret"] = InterpretGPUParams(detect_races=True)
        if not mgpu_compat.INTERPRETER_TRANSPOSES:
            scratch = [plgpu.SMEM((2, tiling.block_k, tiling.block_n), w.dtype)]
    out = plgpu.kernel(
        functools.partial(_body, t=tiling, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((Mp, N), out_dtype),
        grid=(min(num_sms, (Mp // tiling.block_m) * (N // tiling.block_n)),),  # no CTA without a tile
        grid_names=("sm",), num_threads=3, thread_name="wg",
        kernel_name=KERNEL_NAME, scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kw,
    )(xq, w, sxp, sw.reshape(1, N).astype(jnp.float32))
    return out[:M] if Mp > M else out


def fp8_w8a8(x: jax.Array, w, tiling: GemmTiling = TILINGS[0], interpret: bool = False,
             num_sms: int | None = None) -> jax.Array:
    """x [..., K] @ an fp8 W8A8 QArray (values [N, K], per-channel scale [N, 1]) -> [..., N] in
    x's dtype: x quantized per token (as `quantization.kernels.fp8_w8a8`), then this kernel."""
    from jaxllm.kernels.qmatmul_mosaic import device_sms
    from jaxllm.quantization.kernels import quantize_rows_fp8

    lead, K = x.shape[:-1], x.shape[-1]
    xq, sx = quantize_rows_fp8(x.reshape(-1, K))
    y = fp8_gemm(xq, sx[:, 0], w.values, w.scale[:, 0], tiling, interpret,
                 num_sms or device_sms(), out_dtype=jnp.bfloat16)
    return y.astype(x.dtype).reshape(*lead, -1)
