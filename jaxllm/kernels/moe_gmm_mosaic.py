"""Hopper (Mosaic GPU) twin of the decode grouped matmul (`moe_gmm.py`): only routed experts.

The schedule of JAX's bundled `ragged_dot_mgpu` (a persistent grid over (row block, column
strip) tiles, TMA-pipelined K loop into wgmma, one warpgroup), with its tile list compacted:
the bundled kernel visits cdiv(M, bm) + G - 1 row tiles, so at decode nearly all of its tiles
stream the weights of experts that received no rows. Here `slots` lists only the (expert,
aligned 64-row block) pairs that hold rows (at most cdiv(M, bm) + min(G, M) of them, a static
bound, so routing never changes the grid); tiles past the live ones return at once.

Each tile computes its whole 64-row block against one expert's [K, bn] strip (wgmma's M is
64; the rows of other experts in the block are computed and discarded) and TMA-stores it to
a slot-major buffer `[S, 64, N]`; one XLA gather puts every row back from its own slot.
`grouped_matmul_pair` runs gate and up in one launch (tiles over both weights' strips), so a
token's 8 experts make 8 x 2N / bn tiles, enough to occupy every SM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_M = 64  # wgmma M


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4

    @property
    def name(self) -> str:
        return f"mosaic_{self.block_n}x{self.block_k}s{self.max_concurrent_steps}"

    def fits(self, K: int, N: int) -> bool:
        return N % self.block_n == 0 and K % self.block_k == 0


TILINGS = (MosaicTiling(128, 64, 4), MosaicTiling(64, 128, 4), MosaicTiling(64, 64, 6))


def num_slots(M: int, G: int, block_m: int = BLOCK_M) -> int:
    return -(-M // block_m) + min(G, M)


def slots(group_sizes: jax.Array, M: int, block_m: int = BLOCK_M) -> tuple[jax.Array, jax.Array]:
    """([3, S] per slot (expert, row block of block_m, live), [M] each sorted row's slot)."""
    G = group_sizes.shape[0]
    S = num_slots(M, G, block_m)
    sizes = group_sizes.astype(jnp.int32)
    start = jnp.cumsum(sizes) - sizes
    b0 = start // block_m
    nblk = jnp.where(sizes > 0, (start + sizes - 1) // block_m - b0 + 1, 0)
    ends = jnp.cumsum(nblk)
    s = jnp.arange(S, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(ends, s, side="right", method="compare_all").astype(jnp.int32),
                    G - 1)
    block = b0[g] + s - (ends - nblk)[g]
    live = (s < ends[-1]).astype(jnp.int32)
    rows = jnp.arange(M, dtype=jnp.int32)
    rg = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), rows, side="right",
                                      method="compare_all").astype(jnp.int32), G - 1)
    row_slot = (ends - nblk)[rg] + rows // block_m - b0[rg]  # uncovered rows: any slot (undefined)
    return jnp.stack([g, block, live]), jnp.clip(row_slot, 0, S - 1)


def _body(sched_gmem, x_gmem, *refs, t: MosaicTiling, num_slots_: int, K: int, N: int):
    """refs = the weights (one, or gate and up side by side along the strip axis), then out."""
    w_refs, o_gmem = refs[:-1], refs[-1]
    strips = N // t.block_n
    cols = len(w_refs) * strips

    @plgpu.nd_loop((num_slots_ * cols,), collective_axes="sm")
    def _(info: plgpu.NDLoopInfo):
        idx = info.index[0]
        s, c = lax.div(idx, cols), lax.rem(idx, cols)
        expert, block, live = sched_gmem[0, s], sched_gmem[1, s], sched_gmem[2, s]

        for i, w_gmem in enumerate(w_refs):
            @pl.when((live > 0) & (lax.div(c, strips) == i))
            def _(w_gmem=w_gmem, i=i):
                j = c - i * strips

                def acc_scope(acc_ref):
                    plgpu.emit_pipeline(
                        lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_smem),
                        grid=(K // t.block_k,),
                        in_specs=[plgpu.BlockSpec((BLOCK_M, t.block_k), lambda k: (block, k),
                                                  delay_release=1),
                                  plgpu.BlockSpec((t.block_k, t.block_n), lambda k: (k, j),
                                                  delay_release=1)],
                        max_concurrent_steps=t.max_concurrent_steps,
                    )(x_gmem, w_gmem.at[expert])
                    return acc_ref[...]

                acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_M, t.block_n)))

                @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((BLOCK_M, t.block_n), o_gmem.dtype))
                def _(o_smem):
                    o_smem[...] = acc.astype(o_smem.dtype)
                    plgpu.commit_smem()
                    col = i * N + j * t.block_n
                    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, :, pl.ds(col, t.block_n)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def slot_kernel(body, sched: jax.Array, x: jax.Array, ws: tuple[jax.Array, ...], block_m: int,
                out_cols: int, interpret: bool, num_sms: int, **kernel_kw) -> jax.Array:
    """A persistent kernel `body(sched, x, *ws, out, num_slots_=S)` over the slot list `sched`
    [3, S], its slot-major output [S, block_m, out_cols]."""
    S = sched.shape[1]
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        kernel_kw["interpret"] = InterpretGPUParams(detect_races=True)
    return plgpu.kernel(
        functools.partial(body, num_slots_=S),
        out_type=jax.ShapeDtypeStruct((S, block_m, out_cols), x.dtype),
        grid=(num_sms,), grid_names=("sm",), kernel_name="jaxllm_moe_gmm",  # profiles: a matmul
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kernel_kw,
    )(sched, x, *(w.astype(x.dtype) for w in ws))


def pad_rows(x: jax.Array, block_m: int) -> jax.Array:
    """x [M, K] padded to whole row blocks (for the TMA copies)."""
    pad = -x.shape[0] % block_m
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def launch(body, x: jax.Array, ws: tuple[jax.Array, ...], group_sizes: jax.Array, block_m: int,
           interpret: bool, num_sms: int, out_cols: int | None = None, **kernel_kw) -> jax.Array:
    """The slot schedule around a persistent kernel `body(sched, x, *ws, out, num_slots_=S)`:
    the slot list, x padded to whole row blocks, the slot-major output [S, block_m, out_cols
    (default len(ws) * N)] and the gather that puts every row back from its own slot."""
    M = x.shape[0]
    sched, row_slot = slots(group_sizes, M, block_m)
    out = slot_kernel(body, sched, pad_rows(x, block_m), ws, block_m,
                      out_cols or len(ws) * ws[0].shape[2], interpret, num_sms, **kernel_kw)
    return gather_rows(out, row_slot, jnp.arange(M, dtype=jnp.int32))


def gather_rows(out: jax.Array, row_slot: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows `rows` [R] (sorted-row indices) of a slot-major output [S, bm, N] -> [R, N]. The flat
    row indices are materialized first (an optimization barrier): fused into a consumer, their
    `searchsorted` over the groups ran once an output element (a 3.1 ms reduction at 65,536 rows
    on an H100 in session 34, where the gather alone takes 0.2 ms)."""
    S, bm, N = out.shape
    idx = jax.lax.optimization_barrier(row_slot[rows] * bm + rows % bm)
    return out.reshape(S * bm, N)[idx]


def _call(x: jax.Array, ws: tuple[jax.Array, ...], group_sizes: jax.Array, t: MosaicTiling,
          interpret: bool, num_sms: int) -> jax.Array:
    K, N = ws[0].shape[1:]
    if not t.fits(K, N) or any(w.shape != ws[0].shape for w in ws):
        raise ValueError(f"tiling {t.name} does not fit K={K}, N={N} (weights {[w.shape for w in ws]})")
    return launch(functools.partial(_body, t=t, K=K, N=N), x, ws, group_sizes, BLOCK_M, interpret,
                  num_sms)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   tiling: MosaicTiling = TILINGS[0], interpret: bool = False,
                   num_sms: int = 132) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N] -> [M, N] (rows no group covers: undefined)."""
    return _call(x, (w,), group_sizes, tiling, interpret, num_sms)


def grouped_matmul_pair(x: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array,
                        tiling: MosaicTiling = TILINGS[0], interpret: bool = False,
                        num_sms: int = 132) -> tuple[jax.Array, jax.Array]:
    """(x @ w1, x @ w2) per group in one launch (gate and up)."""
    out = _call(x, (w1, w2), group_sizes, tiling, interpret, num_sms)
    return out[:, :w1.shape[2]], out[:, w1.shape[2]:]
