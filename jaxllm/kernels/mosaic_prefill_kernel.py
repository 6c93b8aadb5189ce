"""The body of the Mosaic GPU ragged paged prefill kernel (one CTA: a block of 128 query rows of
one kv head; a producer and two ping-pong consumer warpgroups).

The design, the page formats and the epilogue are described in mosaic_prefill.py, whose
`ragged_prefill_attention` plans the scratch buffers and the grid and launches this body.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import mosaic_kv_quant
from jaxllm.kernels import prefill_schedule as ps

WG_ROWS = 64  # rows per consumer warpgroup (wgmma M)
ROWS = 2 * WG_ROWS  # rows per CTA
LOG2E = math.log2(math.e)


def prefill_kernel(sched_ref, bt_ref, layer_ref, q_ref, kv_ref, o_ref, side_ref, q_smem, k_smem,
            v_smem, q_bar, k_bar, v_bar, k_free, v_free, turn, *rest, sm_scale: float,
            bq: int, bk: int, page_size: int, num_kv_heads: int, num_pages: int, nst: int,
            fp8: bool, interpret: bool, ints: mosaic_kv_quant.IntPages | None):
    # fp8 (here: any 8/4-bit pages, converted into f16 tiles): k16 / v16 [2, BK, D] f16;
    # int pages: then their scale (and minimum) bytes, k_meta / v_meta [nst, ppb * window]
    k16, v16, *rest = rest if fp8 else (None, None, *rest)
    k_meta, v_meta, *stage = rest if ints is not None else (None, None, *rest)
    b, kvh, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
    req, t0, lo = sched_ref[ps.REQ, b], sched_ref[ps.T0, b], sched_ref[ps.LO, b]
    count, pos0, key_end = sched_ref[ps.COUNT, b], sched_ref[ps.POS0, b], sched_ref[ps.KEY_END, b]
    seg = sched_ref[ps.SEG, b]
    head_dim = q_smem.shape[-1]
    steps = (key_end + bk - 1) // bk
    n_full = jnp.minimum(steps, jnp.maximum(pos0 + lo + 1, 0) // bk)
    hb = min(bq, WG_ROWS)  # rows of one head inside one warpgroup's 64
    chunks = WG_ROWS // hb
    cast = (lambda x, _: x) if interpret else plgpu.layout_cast

    def chunk(c):
        """(head in group, first token offset) of chunk c of this warpgroup's rows."""
        r0 = wg * WG_ROWS + c * hb
        return r0 // bq, r0 % bq

    def turn_sync():  # FA3 ping-pong between the two consumer warpgroups
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when((wg < 2) & (count > 0))
    def _consumer():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        q_wg = q_smem.at[wg]
        k16w, v16w = (k16.at[wg], v16.at[wg]) if fp8 else (None, None)

        def page_tile(which: int, slot, deq):
            """The slot's [BK, D] K (which 0) or V (1) tile converted in registers into the f16
            `deq`: fp8 pages (scale 1.0) as they are, int8 / int4 pages with each key's scale
            (and minimum) bytes (`mosaic_kv_quant.dequant_tile`)."""
            src = (k_smem, v_smem)[which].at[slot]
            if ints is not None:
                meta = (k_meta, v_meta)[which].at[slot]
                mosaic_kv_quant.dequant_tile(ints, src, meta, deq, interpret)
            else:
                deq[...] = src[...].astype(deq.dtype)
            plgpu.commit_smem()  # the generic-proxy stores, before the async wgmma reads them

        @pl.when(key_end > 0)
        def _():
            for c in range(chunks):
                g, i0 = chunk(c)
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(t0 + i0, hb), kvh, g],
                                        q_wg.at[pl.ds(c * hb, hb)], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m = cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), row_layout)
        l = cast(jnp.full((WG_ROWS,), 0.0, jnp.float32), row_layout)
        acc = cast(jnp.full((WG_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def causal(s, step):
            """Key step * bk + col is visible to row token i iff col - i <= pos0 - step * bk.
            The iotas are rebuilt per step (cheap) rather than held in 64 more registers."""
            shape = (WG_ROWS, bk)
            if interpret:
                row, col = (lax.broadcasted_iota(jnp.int32, shape, d) for d in (0, 1))
            else:
                row, col = (plgpu.broadcasted_iota(jnp.int32, shape, d, layout=plgpu.Layout.WGMMA)
                            for d in (0, 1))
            tok = row if bq >= WG_ROWS else row & (bq - 1)  # token of the row in its head
            shift = wg * WG_ROWS if bq > WG_ROWS else 0  # G == 1: wg 1 holds tokens 64..127
            return jnp.where(col - tok <= pos0 + shift - step * bk, s, -jnp.inf)

        scale = 1.0 if fp8 else sm_scale * LOG2E  # fp8: q comes scaled (the wrapper)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_bar.at[0])
            if fp8:
                page_tile(0, 0, k16w)

        pl.when(wg == 1)(turn_sync)

        def kv_step(step, carry, masked: bool):
            acc, m, l = carry
            slot = lax.rem(step, jnp.int32(nst))

            def qk(acc_ref):
                if interpret:
                    stage[0][...] = (k16w[...] if fp8 else k_smem[slot]).T
                    plgpu.wgmma(acc_ref, q_wg, stage[0])
                else:
                    plgpu.wgmma(acc_ref, q_wg,
                                (k16w if fp8 else k_smem.at[slot]).transpose((1, 0)))
                if fp8:  # convert V(s) while QK(s) runs and the other warpgroup's softmax
                    plgpu.barrier_arrive(turn)
                    plgpu.barrier_wait(v_bar.at[slot])
                    page_tile(1, slot, v16w)
                    plgpu.barrier_wait(turn)
                else:
                    turn_sync()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                s = causal(s, step)
            m_new = jnp.maximum(m, s.max(axis=1) * scale)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(q_smem.dtype)
            if not interpret and head_dim <= 128:
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            plgpu.barrier_arrive(turn)  # softmax done
            if not fp8:
                plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are ours
            v_tile = v16w if fp8 else v_smem.at[slot]

            def wait_next():
                @pl.when(step + 1 < steps)
                def _():
                    nxt = lax.rem(step + 1, jnp.int32(nst))
                    plgpu.barrier_wait(k_bar.at[nxt])
                    if fp8:  # K(s + 1), while PV(s) runs (K(s)'s tile is free: QK(s) is done)
                        page_tile(0, nxt, k16w)

            if interpret:  # the interpreter takes wgmma's A operand from SMEM only
                stage[1][...] = p16

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, stage[1], v_tile)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv, plgpu.ACC((WG_ROWS, head_dim), jnp.float32))
                wait_next()
            else:
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)
                    wait_next()
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = lax.fori_loop(0, n_full, functools.partial(kv_step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(n_full, steps, functools.partial(kv_step, masked=True), carry)
        pl.when(wg == 0)(turn_sync)

        l_safe = jnp.where(l == 0.0, 1.0, l)  # padding tail: no keys -> 0
        out = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(q_smem.dtype)

        q_wg[...] = out
        plgpu.commit_smem()

        @pl.when(count == bq)
        def _full():
            for c in range(chunks):
                g, i0 = chunk(c)
                plgpu.copy_smem_to_gmem(q_wg.at[pl.ds(c * hb, hb)],
                                        o_ref.at[pl.ds(t0 + i0, hb), kvh, g])

        @pl.when(count < bq)
        def _partial():  # the whole tile, at its segment; the wrapper picks the rows
            plgpu.copy_smem_to_gmem(q_wg, side_ref.at[seg, kvh, pl.ds(wg * WG_ROWS, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when((wg == 2) & (count > 0))
    def _producer():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")
        base = (layer_ref[0] * 2 * num_kv_heads + kvh) * num_pages  # K pages of this head
        v_off = num_kv_heads * num_pages
        max_col = bt_ref.shape[1] - 1

        def copies(step, slot, which, dst, bar):
            if ints is not None:  # values and scale bytes: two copies a page
                meta = (k_meta, v_meta)[which]
                for j in range(ints.ppb):
                    col = jnp.minimum(step * ints.ppb + j, max_col)
                    page = base + bt_ref[req, col] + which * v_off
                    mosaic_kv_quant.copy_page(ints, kv_ref, page, dst.at[slot], meta.at[slot], j,
                                              bar.at[slot], interpret)
            elif page_size <= bk:
                for j in range(bk // page_size):
                    col = jnp.minimum(step * (bk // page_size) + j, max_col)
                    page = base + bt_ref[req, col] + which * v_off
                    plgpu.copy_gmem_to_smem(kv_ref.at[page],
                                            dst.at[slot, pl.ds(j * page_size, page_size)],
                                            bar.at[slot])
            else:
                key0 = step * bk
                page = base + bt_ref[req, jnp.minimum(key0 // page_size, max_col)] + which * v_off
                plgpu.copy_gmem_to_smem(kv_ref.at[page, pl.ds(key0 % page_size, bk)],
                                        dst.at[slot], bar.at[slot])

        @pl.loop(0, steps)
        def _(step):
            slot = lax.rem(step, jnp.int32(nst))

            @pl.when(step >= nst)
            def _():
                plgpu.barrier_wait(k_free.at[slot])
            copies(step, slot, 0, k_smem, k_bar)

            @pl.when(step >= nst)
            def _():
                plgpu.barrier_wait(v_free.at[slot])
            copies(step, slot, 1, v_smem, v_bar)

        @pl.loop(jnp.maximum(steps - nst, 0), steps)  # observe the last releases too
        def _(step):
            slot = lax.rem(step, jnp.int32(nst))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
