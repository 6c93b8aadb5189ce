"""Warp-specialized Hopper grouped matmul for MoE prefill (Mosaic GPU): many rows an expert.

At 8,192 tokens x top-8 (Qwen3-30B-A3B: 128 experts, ~512 rows each) the best JAX path was
JAX's bundled `ragged_dot_mgpu` at 264 TFLOP/s, 0.61x torch `_grouped_mm` (docs/moe.md). That
kernel runs one warpgroup a CTA: it issues its TMA copies, waits, multiplies and stores in turn,
and finds each tile's group by an unrolled pass over all G group sizes.

Here the schedule of `moe_gmm_mosaic.py` (a list, built in XLA, of the (expert, bm-row block)
slots that hold rows; a slot-major `[S, bm, N]` output that one gather puts back in row order)
meets the structure of JAX's `hopper_matmul_mgpu.py`: a persistent CTA per SM walks the
(slot, column strip) tiles; a memory warpgroup streams the slot's x rows `[bm, bk]` and the
expert's weight strip `[bk, bn]` through a `stages`-deep ring
(`plgpu.emit_pipeline_warp_specialized`), and two compute warpgroups multiply (wgmma,
accumulators in registers) and store their part through shared memory with TMA while the next
tile's copies are in flight. bm = 64: each warpgroup takes half the strip's columns; bm = 128:
each takes 64 of the rows and the whole strip, so a weight byte brought in serves twice the
rows (the tile CUTLASS's Hopper GEMMs use), for up to 127 rows of padding an expert instead of
63. Tiles of dead slots (past the live ones) return at once. Gate and up run in one launch
(`pair`): strips over both weights.

`chained` tilings ("...c") run a CTA's consecutive live tiles as one pipeline of pipelines
(`pipeline_state` START / STEADY / STOP): the memory warpgroup streams the next tile's first
blocks while the compute warpgroups finish the current one, instead of each tile draining its
ring and refilling it (a ~1-2 us bubble a tile: a tenth of a 128 x 256 tile at K = 2,048, a
quarter at the down projection's K = 768). JAX requires the K steps to be a multiple of the
ring's depth for it. A CTA whose only live tile it is runs the whole (unchained) pipeline. The
chained tilings are the benchmark's (the chained glu one with a 256-column down strip was the
fastest on an H100 in session 34, before the lone-tile path).

`glu` tilings ("wsglu...") compute the SwiGLU of gate and up in one tile: the ring streams the x
rows with the gate's and the up's [bk, bn] strips of the same columns, each compute warpgroup
keeps both accumulators, and the epilogue stores silu(gate) * up [bm, bn] (float32 to bf16 once):
x is read once for both projections, and neither the [M, 2F] gate/up output nor XLA's
silu-multiply over it (a write and a read of 2 x 65,536 x 768 bf16 a layer at 8,192 tokens)
exists. Same schedule otherwise; the down projection runs the one-weight kernel of the same rows a
slot (`WsTiling.down`: that tiling, or a wider strip, `down_n`).

`mlp` runs the whole expert MLP in slot space: the glu kernel writes silu(gate) * up slot-major
[S, bm, F], and the down kernel reads each slot's x rows from there (`x_slotted`: the slot's own
[bm, F] block, whatever experts its other rows belong to: their results are never gathered),
so the only row-order pass is the final gather, which also takes the caller's unsort (`rows`).
Against gate/up then down, each through `launch`, that drops the gather of the [M, 2F] gate/up
output, XLA's silu-multiply and one of two [M, H] gathers (8,192 tokens on an H100, session 34:
`wsglu128_128x64s4` 1.83 ms a layer in the bench's loop against 1.96 for `ws128_256x64s3` on the
fused gate/up weight, though the glu tile's kernels alone took 1.27 ms against 1.19).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.mgpu_compat import run_chained, swizzled
from jaxllm.kernels.moe_gmm_mosaic import gather_rows, launch, pad_rows, slot_kernel, slots

WG_ROWS = 64  # wgmma M
SMEM = 227 * 1024  # shared memory a CTA may take on Hopper


@dataclasses.dataclass(frozen=True)
class WsTiling:
    block_m: int = 64  # rows a slot (64: the warpgroups split the strip; 128: they split the rows)
    block_n: int = 256  # the CTA's column strip
    block_k: int = 64
    stages: int = 4
    chained: bool = False  # a CTA's tiles as one pipeline of pipelines (module docstring)
    glu: bool = False  # gate and up strips in one tile, silu(gate) * up stored (module docstring)
    down_n: int = 0  # glu: the down projection's strip (0: block_n), a ring as deep as fits

    @property
    def name(self) -> str:
        return (f"ws{'glu' if self.glu else ''}{self.block_m}_{self.block_n}x{self.block_k}s{self.stages}"
                + (f"d{self.down_n}" if self.down_n else "") + ("c" if self.chained else ""))

    @property
    def down(self) -> WsTiling:
        """The one-weight tiling of the down projection after this one's gate/up: the same rows
        a slot (`mlp` reads the glu kernel's slots as they are), its own strip. A 256-column strip
        at K = F carries half the tiles of a 128-column one (each refilling its ring: 12 K steps
        for Qwen3-30B-A3B's F = 768) and reads a weight byte for twice the rows."""
        if not self.down_n or self.down_n == self.block_n:
            return dataclasses.replace(self, glu=False, down_n=0)
        stages = self.stages
        while stages > 2 and dataclasses.replace(self, block_n=self.down_n, stages=stages).smem_bytes() > SMEM:
            stages -= 1
        return WsTiling(self.block_m, self.down_n, self.block_k, stages, self.chained)

    @property
    def wg_cols(self) -> int:  # columns a compute warpgroup multiplies and stores
        return self.block_n if self.block_m == 2 * WG_ROWS else self.block_n // 2

    def fits(self, K: int, N: int) -> bool:
        return N % self.block_n == 0 and K % self.block_k == 0 and (
            not self.chained or (K // self.block_k) % self.stages == 0)

    def smem_bytes(self, itemsize: int = 2, weights: int = 1) -> int:
        """The ring (x and `weights` strips a stage) + the two warpgroups' output tiles."""
        ring = self.stages * (self.block_m * self.block_k + weights * self.block_k * self.block_n)
        return (ring + 2 * WG_ROWS * self.wg_cols) * itemsize


TILINGS = (WsTiling(64, 256, 64, 4), WsTiling(64, 128, 64, 6), WsTiling(128, 256, 64, 3),
           WsTiling(128, 128, 64, 5))
CHAINED = (WsTiling(64, 256, 64, 4, True), WsTiling(128, 256, 64, 2, True),
           WsTiling(128, 128, 64, 4, True),  # K steps of gate/up (32) and down (12): multiples of 2 and 4
           WsTiling(128, 128, 64, 4, True, glu=True),
           # the best at 8,192 tokens on an H100 (session 34: 1.28x torch); an engine candidate
           # since its lone-tile path ran correct on an H100 (session 35)
           WsTiling(128, 128, 64, 4, True, glu=True, down_n=256))
GLU = (WsTiling(128, 128, 64, 3, glu=True), WsTiling(128, 128, 64, 4, glu=True),
       WsTiling(128, 128, 64, 4, glu=True, down_n=256),  # down as ws128_256x64s3
       WsTiling(64, 128, 64, 4, glu=True))  # ring of x + two strips: 144-192 KiB at 128 rows


def _body(sched_gmem, x_gmem, *refs, t: WsTiling, num_slots_: int, K: int, N: int, glu: bool,
          x_slotted: bool = False):
    """refs = the weights (one, or gate and up), then the slot-major output [S, bm, n_w * N]
    (`glu`: gate and up read together, the output silu(gate) * up [S, bm, N]); x [M, K] rows in
    order, or (`x_slotted`) slot-major [S, bm, K]."""
    w_refs, o_gmem = refs[:-1], refs[-1]
    bm, strip, wn = t.block_m, t.block_n, t.wg_cols
    split_rows = bm == 2 * WG_ROWS
    strips = N // strip
    groups = (w_refs,) if glu else tuple((w,) for w in w_refs)  # the weights a tile reads
    cols = len(groups) * strips
    w_spec = plgpu.BlockSpec((t.block_k, strip), lambda k: (k, 0), transforms=swizzled(strip))

    def pipeline(body, ctx, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(K // t.block_k,), memory_registers=40, pipeline_state=state,
            in_specs=[plgpu.BlockSpec((bm, t.block_k), lambda k: (0, k),
                                      transforms=swizzled(t.block_k)),
                      *[w_spec] * len(groups[0])],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=ctx)

    ignore = lambda *_, **__: None  # noqa: E731 -- allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem.at[0] if x_slotted else x_gmem,
                                                        *(w.at[0] for w in groups[0])),
        out_smem=plgpu.SMEM((2, WG_ROWS, wn), o_gmem.dtype, transforms=swizzled(wn)),
        collective_axes="wg")
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_slots_ * cols,), collective_axes="sm")
        def _(info: plgpu.NDLoopInfo):
            idx = info.index[0]
            s, c = lax.div(idx, cols), lax.rem(idx, cols)
            expert, block, live = sched_gmem[0, s], sched_gmem[1, s], sched_gmem[2, s]
            if t.chained:  # live slots come first: this CTA's last live tile is followed by a dead one
                nxt = idx + lax.axis_size("sm")
                last = (nxt >= num_slots_ * cols) | (
                    sched_gmem[2, lax.min(lax.div(nxt, cols), num_slots_ - 1)] == 0)
            for i, ws_gmem in enumerate(groups):
                @pl.when((live > 0) & (lax.div(c, strips) == i))
                def _(ws_gmem=ws_gmem, i=i):
                    j = c - i * strips

                    def ctx(eval_pipeline):
                        @functools.partial(pl.run_scoped, acc_refs=[
                            plgpu.ACC((WG_ROWS, wn), jnp.float32) for _ in ws_gmem])
                        def _(acc_refs):
                            eval_pipeline(tuple(acc_refs))
                            if glu:  # silu(gate) * up, in float32
                                g, u = acc_refs[0][...], acc_refs[1][...]
                                acc = (g * u / (1.0 + jnp.exp(-g))).astype(o_gmem.dtype)
                            else:
                                acc = acc_refs[0][...].astype(o_gmem.dtype)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store
                            out_smem[wg] = acc
                            plgpu.commit_smem()
                            col = i * N + j * strip + (0 if split_rows else wg * wn)
                            rows = pl.ds(wg * WG_ROWS if split_rows else 0, WG_ROWS)
                            plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                                    o_gmem.at[s, rows, pl.ds(col, wn)])

                    def mma(_, x_smem, *rest):
                        *w_smems, accs = rest
                        for w_smem, acc_ref in zip(w_smems, accs):
                            if split_rows:
                                plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)], w_smem)
                            else:
                                plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, pl.ds(wg * wn, wn)])
                        plgpu.wgmma_wait(0)
                        return accs

                    x_rows = x_gmem.at[s] if x_slotted else x_gmem.at[pl.ds(block * bm, bm)]
                    operands = (x_rows, *(w.at[expert, :, pl.ds(j * strip, strip)] for w in ws_gmem))

                    def run(state=None):
                        pipeline(mma, ctx, state)(*operands, allocations=allocs)
                    if t.chained:
                        run_chained(run, info.local_index == 0, last)
                    else:
                        run()

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _call(x: jax.Array, ws: tuple[jax.Array, ...], group_sizes: jax.Array, t: WsTiling,
          interpret: bool, num_sms: int, glu: bool = False) -> jax.Array:
    K, N = ws[0].shape[1:]
    if not t.fits(K, N) or any(w.shape != ws[0].shape for w in ws):
        raise ValueError(f"tiling {t.name} does not fit K={K}, N={N} (weights {[w.shape for w in ws]})")
    if t.block_m not in (WG_ROWS, 2 * WG_ROWS):
        raise ValueError(f"block_m must be {WG_ROWS} or {2 * WG_ROWS}, got {t.block_m}")
    return launch(functools.partial(_body, t=t, K=K, N=N, glu=glu), x, ws, group_sizes, t.block_m,
                  interpret, num_sms, out_cols=N if glu else None, num_threads=3, thread_name="wg")


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


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array,
           tiling: WsTiling = GLU[0], interpret: bool = False, num_sms: int = 132) -> jax.Array:
    """silu(x @ w_gate) * (x @ w_up) per group, [M, K] -> [M, N], in one launch (a `glu` tiling's
    schedule; the products kept in float32 until the one cast)."""
    return _call(x, (w_gate, w_up), group_sizes, tiling, interpret, num_sms, glu=True)


def mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array,
        tiling: WsTiling = GLU[0], rows: jax.Array | None = None, interpret: bool = False,
        num_sms: int = 132) -> jax.Array:
    """The SwiGLU expert MLP of rows sorted by group, in slot space (module docstring):
    x [M, H], w_gate / w_up [G, H, F], w_down [G, F, H] -> [M, H], or its rows `rows` [R]
    (`y[rows]`, one gather). Rows no group covers: undefined."""
    M, H = x.shape
    F = w_gate.shape[2]
    for t, K, N, ws_ in ((tiling, H, F, (w_gate, w_up)), (tiling.down, F, H, (w_down,))):
        if not t.fits(K, N) or any(w.shape[1:] != (K, N) for w in ws_):
            raise ValueError(f"tiling {tiling.name} does not fit the expert weights "
                             f"{[w.shape for w in (w_gate, w_up, w_down)]}")
    bm = tiling.block_m
    sched, row_slot = slots(group_sizes, M, bm)
    kw = dict(num_threads=3, thread_name="wg")
    h = slot_kernel(functools.partial(_body, t=tiling, K=H, N=F, glu=True), sched, pad_rows(x, bm),
                    (w_gate, w_up), bm, F, interpret, num_sms, **kw)  # [S, bm, F]
    y = slot_kernel(functools.partial(_body, t=tiling.down, K=F, N=H, glu=False, x_slotted=True), sched, h,
                    (w_down,), bm, H, interpret, num_sms, **kw)  # [S, bm, H]
    return gather_rows(y, row_slot, jnp.arange(M, dtype=jnp.int32) if rows is None else rows)
