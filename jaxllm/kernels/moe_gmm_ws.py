"""Warp-specialized Hopper grouped matmul for MoE prefill (Mosaic GPU): many rows an expert.

At 8,192 tokens x top-8 (Qwen3-30B-A3B: 128 experts, ~512 rows each) the best JAX path was
JAX's bundled `ragged_dot_mgpu` at 264 TFLOP/s, 0.61x torch `_grouped_mm` (docs/moe.md). That
kernel runs one warpgroup a CTA: it issues its TMA copies, waits, multiplies and stores in turn,
and finds each tile's group by an unrolled pass over all G group sizes.

Here the schedule of `moe_gmm_mosaic.py` (a list, built in XLA, of the (expert, 64-row block)
slots that hold rows; a slot-major `[S, 64, N]` output that one gather puts back in row order)
meets the structure of JAX's `hopper_matmul_mgpu.py`: a persistent CTA per SM walks the
(slot, column strip) tiles; a memory warpgroup streams the slot's x rows `[64, bk]` and the
expert's weight strip `[bk, 2 bn]` through a `stages`-deep ring
(`plgpu.emit_pipeline_warp_specialized`), and two compute warpgroups each take half of the
strip (wgmma 64 x bn, accumulators in registers) and store their `[64, bn]` through shared
memory with TMA while the next tile's copies are in flight. Tiles of dead slots (past the
live ones) return at once. Gate and up run in one launch (`pair`): strips over both weights.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.moe_gmm_mosaic import BLOCK_M, slots


@dataclasses.dataclass(frozen=True)
class WsTiling:
    block_n: int = 128  # columns a compute warpgroup (the CTA's strip: 2 x block_n)
    block_k: int = 64
    stages: int = 4

    @property
    def name(self) -> str:
        return f"ws_{self.block_n}x{self.block_k}s{self.stages}"

    def fits(self, K: int, N: int) -> bool:
        return N % (2 * self.block_n) == 0 and K % self.block_k == 0

    def smem_bytes(self, itemsize: int = 2) -> int:  # ring + the two warpgroups' output tiles
        ring = self.stages * (BLOCK_M * self.block_k + self.block_k * 2 * self.block_n)
        return (ring + 2 * BLOCK_M * self.block_n) * itemsize


TILINGS = (WsTiling(128, 64, 4), WsTiling(64, 64, 6), WsTiling(128, 64, 3))


def _transforms(cols: int, itemsize: int = 2):
    swizzle = min(128, cols * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _body(sched_gmem, x_gmem, *refs, t: WsTiling, num_slots_: int, K: int, N: int):
    """refs = the weights (one, or gate and up), then the slot-major output [S, 64, n_w * N]."""
    w_refs, o_gmem = refs[:-1], refs[-1]
    bn, strip = t.block_n, 2 * t.block_n
    strips = N // strip
    cols = len(w_refs) * strips

    def pipeline(body, ctx):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(K // t.block_k,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((BLOCK_M, t.block_k), lambda k: (0, k),
                                      transforms=_transforms(t.block_k)),
                      plgpu.BlockSpec((t.block_k, strip), lambda k: (k, 0),
                                      transforms=_transforms(strip))],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=ctx)

    ignore = lambda *_, **__: None  # noqa: E731 -- allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_refs[0].at[0]),
        out_smem=plgpu.SMEM((2, BLOCK_M, bn), o_gmem.dtype, transforms=_transforms(bn)),
        collective_axes="wg")
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_slots_ * cols,), collective_axes="sm")
        def _(info: plgpu.NDLoopInfo):
            idx = info.index[0]
            s, c = lax.div(idx, cols), lax.rem(idx, cols)
            expert, block, live = sched_gmem[0, s], sched_gmem[1, s], sched_gmem[2, s]
            for i, w_gmem in enumerate(w_refs):
                @pl.when((live > 0) & (lax.div(c, strips) == i))
                def _(w_gmem=w_gmem, i=i):
                    j = c - i * strips

                    def ctx(eval_pipeline):
                        @functools.partial(pl.run_scoped,
                                           acc_ref=plgpu.ACC((BLOCK_M, bn), jnp.float32))
                        def _(acc_ref):
                            eval_pipeline(acc_ref)
                            acc = acc_ref[...].astype(o_gmem.dtype)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store
                            out_smem[wg] = acc
                            plgpu.commit_smem()
                            col = i * N + j * strip + wg * bn
                            plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                                    o_gmem.at[s, :, pl.ds(col, bn)])

                    def mma(_, x_smem, w_smem, acc_ref):
                        plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, pl.ds(wg * bn, bn)])
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    pipeline(mma, ctx)(x_gmem.at[pl.ds(block * BLOCK_M, BLOCK_M)],
                                       w_gmem.at[expert, :, pl.ds(j * strip, strip)],
                                       allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _call(x: jax.Array, ws: tuple[jax.Array, ...], group_sizes: jax.Array, t: WsTiling,
          interpret: bool, num_sms: int) -> jax.Array:
    M, K = x.shape
    G, _, N = ws[0].shape
    if not t.fits(K, N) or any(w.shape != ws[0].shape for w in ws):
        raise ValueError(f"tiling {t.name} does not fit K={K}, N={N} (weights {[w.shape for w in ws]})")
    sched, row_slot = slots(group_sizes, M)
    S = sched.shape[1]
    pad = -M % BLOCK_M  # whole row blocks for the TMA copies
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    params = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        params["interpret"] = InterpretGPUParams(detect_races=True)
    out = plgpu.kernel(
        functools.partial(_body, t=t, num_slots_=S, K=K, N=N),
        out_type=jax.ShapeDtypeStruct((S, BLOCK_M, len(ws) * N), x.dtype),
        grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **params,
    )(sched, xp, *(w.astype(x.dtype) for w in ws))
    return out[row_slot, jnp.arange(M) % BLOCK_M]


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   tiling: WsTiling = TILINGS[0], interpret: bool = False,
                   num_sms: int = 132) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N] -> [M, N] (rows no group covers: undefined)."""
    return _call(x, (w,), group_sizes, tiling, interpret, num_sms)


def grouped_matmul_pair(x: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array,
                        tiling: WsTiling = TILINGS[0], interpret: bool = False,
                        num_sms: int = 132) -> tuple[jax.Array, jax.Array]:
    """(x @ w1, x @ w2) per group in one launch (gate and up)."""
    out = _call(x, (w1, w2), group_sizes, tiling, interpret, num_sms)
    return out[:, :w1.shape[2]], out[:, w1.shape[2]:]
