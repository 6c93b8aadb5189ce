"""The body of the Mosaic GPU paged decode kernel (one CTA: a token or item, a kv head, a split).

The design, the page formats and the split grid are described in mosaic_decode.py, whose
`paged_decode_attention` plans the scratch buffers and the grid and launches this body.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import mgpu_compat, mosaic_kv_quant

ROWS = 64  # wgmma M: one warpgroup's accumulator rows
LOG2E = math.log2(math.e)


def decode_kernel(pos_ref, req_ref, bt_ref, layer_ref, active_ref, first_ref, tok0_ref, q_ref,
                   kv_ref, *refs, sm_scale: float, num_kv_heads: int, num_pages: int, page_size: int,
                   ppb: int, nst: int, num_splits: int, staged: bool, early_v: bool,
                   interpret: bool, heads: int, qpi: int,
                   ints: mosaic_kv_quant.IntPages | None, dst: int, qk8: bool = False):
    """Body; refs = outputs (o [, lse]) then the scoped SMEM / barriers.

    qpi > 1 (`queries_per_item`): CTA index `tok` is an item of up to qpi consecutive tokens
    of one request from token tok0_ref[tok] on, whose q rows it copies token by token into its
    rows ([qpi * heads, D], token-major); pos_ref holds each item's last position (-1: no item)
    and first_ref its first, so row j sees keys <= first + j // heads. active_ref is then
    (splits, items, real tokens). With one split each token's rows go straight to o_ref
    [T, K, G, D], and the CTAs past the items write the padding tokens' zeros.

    Split grids are flat: CTA w takes (token, kv head, split) = w's digits in base
    (K, active), so the first real * K * active CTAs do all the work and the rest
    return at once; one wave (num_sms CTAs) covers any real count.
    """
    if num_splits > 1:
        o_ref, lse_ref, scratch = refs[0], refs[1], refs[2:]
    else:
        o_ref, lse_ref, scratch = refs[0], None, refs[1:]
    (q_smem, k_smem, v_smem, o_smem, lse_smem,
     q_bar, k_bar, v_bar, free_bar, k_deq, v_deq, q16_smem, k_meta, v_meta,
     kdeq_bar, vdeq_bar, deq_free, *a_bufs) = scratch
    if o_smem is None:  # one split: stage the bf16 output in q's buffer (q is in registers)
        o_smem = q_smem
    active = active_ref[0]  # splits in use
    if num_splits > 1:
        w, per_tok = lax.axis_index("w"), num_kv_heads * active
        run = w < active_ref[1] * per_tok  # real tokens x heads x splits
        tok = jnp.minimum(w // per_tok, pos_ref.shape[0] - 1)
        kvh, split = (w % per_tok) // active, w % active
    else:
        tok, kvh, split = lax.axis_index("t"), lax.axis_index("h"), 0
        run = tok < active_ref[1] if qpi > 1 else True  # items past the real ones: nothing to do
    wg = lax.axis_index("wg")
    # Layout casts only steer the GPU lowering; the CPU interpreter has no rule for them.
    cast = (lambda x, _: x) if interpret else plgpu.layout_cast

    def operand(x, i):
        """wgmma A operand: registers on the GPU; the interpreter only takes SMEM refs."""
        if not interpret:
            return x
        a_bufs[i][...] = x
        return a_bufs[i]

    def keys_t(ref):
        """wgmma B operand K^T: a transposed view on the GPU, a staged copy in the interpreter."""
        if not interpret:
            return ref.transpose((1, 0))
        a_bufs[2][...] = ref[...].T
        return a_bufs[2]
    group, head_dim = heads, q_ref.shape[3]  # G rows a token (qk8: q_ref holds all ROWS rows)
    num_tokens = q_ref.shape[0]
    keys = ppb * page_size

    def convert(slot, which: int, deq) -> None:
        """fp8 pages (scale 1.0) and int8 / int4 pages (with the slot's scale bytes): the slot's
        [BK, D] K (which 0) or V (1) tile dequantized in registers into the f16 tile `deq`."""
        ref, meta = ((k_smem, k_meta), (v_smem, v_meta))[which]
        if ints is not None:
            mosaic_kv_quant.dequant_tile(ints, ref.at[slot], meta.at[slot], deq, interpret)
        else:
            deq[...] = ref.at[slot][...].astype(deq.dtype)
        plgpu.commit_smem()  # the generic-proxy stores, before the async wgmma reads them

    def page_tile(slot, which: int):
        """The slot's K (which 0) or V (1) tile as the consumer's wgmma reads it: quantized pages
        converted here into the one f16 staging tile (dst == 0), model-dtype pages as they are."""
        ref, deq = ((k_smem, k_deq), (v_smem, v_deq))[which]
        if deq is None:
            return ref.at[slot]
        convert(slot, which, deq)
        return deq

    kv_len = pos_ref[tok] + 1  # keys 0..position; padding tokens (-1) see none
    n_pages = (kv_len + page_size - 1) // page_size
    pps = ((n_pages + active - 1) // active + ppb - 1) // ppb * ppb
    p0 = split * pps
    p1 = jnp.minimum(p0 + pps, n_pages)
    steps = jnp.maximum(p1 - p0 + ppb - 1, 0) // ppb
    key_end = jnp.minimum(p1 * page_size, kv_len)

    @pl.when((wg == 1) & run)
    def _producer():
        req = req_ref[tok]
        base = (layer_ref[0] * 2 * num_kv_heads + kvh) * num_pages  # K pages of this head
        v_off = num_kv_heads * num_pages

        def issue(step):
            slot = lax.rem(step, jnp.int32(nst))

            @pl.when(step >= nst)
            def _():
                plgpu.barrier_wait(free_bar.at[slot])

            for j in range(ppb):
                col = jnp.minimum(p0 + step * ppb + j, p1 - 1)  # tail pages repeat, masked
                page = base + bt_ref[req, col]
                if ints is not None:  # values and scale bytes: two copies a page
                    mosaic_kv_quant.copy_page(ints, kv_ref, page, k_smem.at[slot],
                                              k_meta.at[slot], j, k_bar.at[slot], interpret)
                    mosaic_kv_quant.copy_page(ints, kv_ref, page + v_off, v_smem.at[slot],
                                              v_meta.at[slot], j, v_bar.at[slot], interpret)
                    continue
                at = pl.ds(j * page_size, page_size)
                plgpu.copy_gmem_to_smem(kv_ref.at[page], k_smem.at[slot, at], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(kv_ref.at[page + v_off], v_smem.at[slot, at],
                                        v_bar.at[slot])

        def convert_step(step):  # dst > 0: the producer converts too, `lag` steps behind
            slot, d = lax.rem(step, jnp.int32(nst)), lax.rem(step, jnp.int32(dst))

            @pl.when(step >= dst)
            def _():
                plgpu.barrier_wait(deq_free.at[d])  # the consumer is done with staging slot d

            plgpu.barrier_wait(k_bar.at[slot])
            convert(slot, 0, k_deq.at[d])
            plgpu.barrier_arrive(kdeq_bar.at[d])
            plgpu.barrier_wait(v_bar.at[slot])
            convert(slot, 1, v_deq.at[d])
            plgpu.barrier_arrive(vdeq_bar.at[d])
            plgpu.barrier_arrive(free_bar.at[slot])  # the quantized slot is read: refill it

        if dst == 0:
            pl.loop(0, steps)(issue)
        else:  # issuing step i waits for step i - nst's conversion, made at i - nst + lag < i
            lag = nst - 1

            @pl.loop(0, steps + lag)
            def _(i):
                pl.when(i < steps)(lambda: issue(i))
                pl.when(i >= lag)(lambda: convert_step(i - lag))

            @pl.loop(jnp.maximum(steps - dst, 0), steps)
            def _(step):
                plgpu.barrier_wait(deq_free.at[lax.rem(step, jnp.int32(dst))])

        # Observe the last releases too: free on hardware, and it keeps every
        # barrier phase accounted for (the CPU interpreter checks that).
        @pl.loop(jnp.maximum(steps - nst, 0), steps)
        def _(step):
            plgpu.barrier_wait(free_bar.at[lax.rem(step, jnp.int32(nst))])

    @pl.when((wg == 0) & run)
    def _consumer():
        if qk8:  # the scaled e4m3 q, padded to ROWS rows by the wrapper: the QK wgmma's A in SMEM
            plgpu.copy_gmem_to_smem(q_ref.at[tok, kvh], q_smem, q_bar.at[0])
        else:
            q_smem[...] = cast(jnp.zeros((ROWS, head_dim), q_smem.dtype), plgpu.Layout.WGMMA)
            plgpu.commit_smem()
            if qpi > 1:  # the item's tokens' rows, token-major (rows past the item: masked garbage)
                for i in range(qpi):
                    src = jnp.minimum(tok0_ref[tok] + i, num_tokens - 1)
                    plgpu.copy_gmem_to_smem(q_ref.at[src, kvh],
                                            q_smem.at[pl.ds(i * heads, heads)], q_bar.at[0])
            else:
                plgpu.copy_gmem_to_smem(q_ref.at[tok, kvh], q_smem.at[pl.ds(0, group)],
                                        q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[0])
        if qk8:
            q = q_smem  # read by the wgmma from SMEM
        elif interpret:  # the CPU interpreter has no rule for plgpu.load; a plain read there
            q = q_smem[...]
        else:
            q = mgpu_compat.load(q_smem, layout=plgpu.Layout.WGMMA, optimized=False)
        if staged and not qk8:  # f16 operands (module docstring); the score scale moves into q
            q = (q.astype(jnp.float32) * (sm_scale * LOG2E)).astype(jnp.float16)
        q_src = q_smem  # where `reload_q` reads q from
        if q16_smem is not None:  # (never with qk8)
            q16_smem[...] = q
            plgpu.commit_smem()
            q_src = q16_smem
        row = plgpu.Layout.WGMMA.reduce(1)
        # Causal rows (qpi > 1) may see no key of a split: start from a finite floor, so such a
        # row's exp2(s - m) is exp2(-inf) = 0, not exp2(-inf + inf) = NaN (l stays 0, lse -inf).
        m = cast(jnp.full((ROWS,), -1e30 if qpi > 1 else -jnp.inf, jnp.float32), row)
        l = cast(jnp.full((ROWS,), 0.0, jnp.float32), row)
        acc = cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        col = cast(lax.broadcasted_iota(jnp.int32, (ROWS, keys), 1), plgpu.Layout.WGMMA)
        if qpi > 1:  # the last key each row may see: its token's position
            lim = cast(lax.broadcasted_iota(jnp.int32, (ROWS, keys), 0), plgpu.Layout.WGMMA)
            lim = lim // heads + first_ref[tok]

        # At D == BK (64) q and p are both [64, 64] register operands, and on an H200 (jax
        # 0.11.2) every QK wgmma after a CTA's first then read p's registers, not q's (rel err
        # 0.6-0.8 once a CTA walks two blocks; q = 0 still gave wrong scores:
        # scripts/diag_decode_d64.py). Read from SMEM again each step, q is right there.
        reload_q = head_dim == keys and not qk8

        def body(step, carry):
            acc, m, l = carry
            slot = lax.rem(step, jnp.int32(nst))
            d = lax.rem(step, jnp.int32(dst)) if dst else None
            if dst:  # converted by the producer into staging slot d
                plgpu.barrier_wait(kdeq_bar.at[d])
                k_tile = k_deq.at[d]
            else:
                plgpu.barrier_wait(k_bar.at[slot])
                k_tile = k_smem.at[slot] if qk8 else page_tile(slot, 0)  # qk8: e4m3 as copied
            v_tiles = []

            def qk(acc_ref):
                a = q
                if reload_q:
                    a = q_src[...] if interpret else mgpu_compat.load(
                        q_src, layout=plgpu.Layout.WGMMA, optimized=False)
                plgpu.wgmma(acc_ref, a if qk8 else operand(a, 0), keys_t(k_tile))
                if early_v and not dst:  # convert the V tile while the async QK wgmma runs
                    plgpu.barrier_wait(v_bar.at[slot])
                    v_tiles.append(page_tile(slot, 1))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, keys), jnp.float32))
            if not staged:
                s = s * (sm_scale * LOG2E)  # log2 domain: exp2 below
            key = col + ((p0 + step * ppb) * page_size)
            ok = (key < key_end) & (key <= lim) if qpi > 1 else key < key_end
            s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if dst:
                plgpu.barrier_wait(vdeq_bar.at[d])
                v_tiles.append(v_deq.at[d])
            elif not early_v:
                plgpu.barrier_wait(v_bar.at[slot])
                v_tiles.append(page_tile(slot, 1))
            v_tile = v_tiles[0]

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, operand(p.astype(v_tile.dtype), 1), v_tile)
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
            plgpu.barrier_arrive(deq_free.at[d] if dst else free_bar.at[slot])
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, steps, body, (acc, m, l))
        l_safe = jnp.where(l == 0.0, 1.0, l)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        o_smem[...] = out.astype(o_smem.dtype)
        if lse_ref is not None:
            lse_smem[...] = m + jnp.log(l) * (1.0 / math.log(2.0))  # log2; -inf if empty
        plgpu.commit_smem()
        if lse_ref is not None:  # partials in item layout ([qpi * heads] rows; combine merges)
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, qpi * heads)], o_ref.at[split, tok, kvh])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, tok, kvh])
        elif qpi > 1:  # each of the item's tokens its own G rows
            n_tok = pos_ref[tok] - first_ref[tok] + 1
            for i in range(qpi):
                @pl.when(i < n_tok)
                def _():
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(i * heads, heads)],
                                            o_ref.at[tok0_ref[tok] + i, kvh])
        else:
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[tok, kvh])
        plgpu.wait_smem_to_gmem(0)

    if qpi > 1 and num_splits == 1:  # spare CTA j past the items: padding token real + j gets 0
        pad_tok = active_ref[2] + tok - active_ref[1]

        @pl.when((wg == 0) & (tok >= active_ref[1]) & (pad_tok < num_tokens))
        def _padding():
            o_smem[...] = cast(jnp.zeros((ROWS, head_dim), o_smem.dtype), plgpu.Layout.WGMMA)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, heads)], o_ref.at[pad_tok, kvh])
            plgpu.wait_smem_to_gmem(0)
