"""Portable Pallas ragged paged attention (Triton lowering on GPU, interpret mode on CPU).

Same contract as `ref.ragged_paged_attention`: q [T, H, D] ragged over requests,
keys/values in `kv_pages [L, 2, K, P, S, D]`, output [T, H, D], padding tokens 0.

Work split. The T tokens are cut into *query blocks* of `bq` tokens that never
straddle two requests (a request of n new tokens gets ceil(n / bq) blocks), plus
the padding tail [query_start_loc[R], T) as one more segment whose positions are
-1, so every token - padding too - is written by exactly one program and no
output pre-fill is needed. The grid is (query block, kv head); its first extent
is the static bound T // bq + R + 1 and surplus programs store nothing.

Inside a program the rows are the bq tokens x G query heads of one kv head
(GQA heads share every key load), gathered straight out of q [T, H, D] with
integer-array indexing, so the wrapper never transposes q or the output. The
page loop walks `ppb` pages per step (a [ppb * S, D] key tile gathered row-wise
through the block table), with an online softmax in float32. The loop's trip
count is the block's own last position, so decode rows read only their context.

Quantized pages (kv_quant.py: fp8 rows; int8, int4 values with their scales in the
page-major split layout) are read as stored and dequantized in registers per tile
(`_load_rows`); nothing of the cache is converted outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxllm.kernels import kv_quant
from jaxllm.kernels.metadata import AttentionMetadata

_NEG = -1e30


def block_schedule(query_start_loc: jax.Array, num_tokens: int, bq: int) -> jax.Array:
    """Map each query block to (request row, first token, end token): int32 [3, NB].

    Segments are the R request rows plus the padding tail; segment s owns
    ceil(len_s / bq) consecutive blocks. Blocks past the last one get an empty
    token range [0, 0) so their program stores nothing.
    """
    num_reqs = query_start_loc.shape[0] - 1
    num_blocks = num_tokens // bq + num_reqs + 1  # >= sum_s ceil(len_s / bq)
    seg_start = query_start_loc  # [R + 1]: R requests, then the padding tail
    seg_end = jnp.concatenate([query_start_loc[1:], jnp.array([num_tokens], jnp.int32)])
    seg_blocks = (seg_end - seg_start + bq - 1) // bq
    cum = jnp.cumsum(seg_blocks)
    blk = jnp.arange(num_blocks, dtype=jnp.int32)
    seg = jnp.searchsorted(cum, blk, side="right").astype(jnp.int32)
    active = seg <= num_reqs
    seg_c = jnp.minimum(seg, num_reqs)
    t0 = seg_start[seg_c] + (blk - (cum[seg_c] - seg_blocks[seg_c])) * bq
    t1 = jnp.minimum(t0 + bq, seg_end[seg_c])
    req = jnp.minimum(seg_c, num_reqs - 1)  # the tail's rows are masked by position -1
    return jnp.stack([req, jnp.where(active, t0, 0), jnp.where(active, t1, 0)]).astype(jnp.int32)


def _load_rows(kv_ref, layer, which: int, kvh, page, off, page_size: int, fmt: str, dtype):
    """Keys (which=0) or values (1) of slots `off` of pages `page` ([BK] each):
    (chunks [BK, D/n] in `dtype`, scale, min).

    Plain / fp8 pages come as rows, kv_ref [L, 2, K, P * S, W]; int8 / int4 pages as bytes,
    kv_ref [L, 2, K, P, S * W] (kv_quant.py's split layout: a slot's values at off * Dv, its
    scale and minimum bytes in the page's blocks of them). Quantized rows are dequantized
    here, in registers: integer values become `dtype` exactly, and the per-row scale and
    int4 minimum ([BK] float32; None for plain/fp8 pages) are applied to the scores (keys)
    or the probabilities (values): [M, BK] products instead of [BK, D].
    """
    if fmt in ("plain", "fp8"):
        return [kv_ref[layer, which, kvh, page * page_size + off, :].astype(dtype)], None, None
    width = kv_ref.shape[-1] // page_size
    nval = kv_quant.value_bytes(fmt, width)
    c = jnp.arange(nval, dtype=jnp.int32)
    raw = kv_ref[layer, which, kvh, page[:, None], (off * nval)[:, None] + c[None, :]]  # [BK, Dv]

    def meta(field: int):  # [BK] float32 from the field's two bytes of each slot (planar)
        at = kv_quant.meta_offset(fmt, page_size, width, field) + off
        return kv_quant.scale_from_bytes(kv_ref[layer, which, kvh, page, at],
                                         kv_ref[layer, which, kvh, page, at + page_size])

    if fmt == "int8":
        return [jax.lax.bitcast_convert_type(raw, jnp.int8).astype(dtype)], meta(0), None
    lo = (raw & 15).astype(dtype)  # int4: elements d and d + D/2, x = q * s + min
    hi = (raw >> 4).astype(dtype)
    return [lo, hi], meta(0), meta(1)


def _kernel(sched_ref, pos_ref, bt_ref, layer_ref, q_ref, kv_ref, o_ref, *,
            sm_scale: float, group: int, bq: int, ppb: int, page_size: int, fmt: str):
    """One (query block, kv head) program: rows = bq tokens x G heads."""
    blk, kvh = pl.program_id(0), pl.program_id(1)
    num_tokens, head_dim = q_ref.shape[0], q_ref.shape[2]
    rows, keys = bq * group, ppb * page_size
    req, t0, t1 = sched_ref[0, blk], sched_ref[1, blk], sched_ref[2, blk]
    r = jnp.arange(rows, dtype=jnp.int32)
    tok = t0 + r // group
    valid = tok < t1
    # Rows past the end wrap to distinct earlier tokens; they are masked, so the
    # index only has to be in bounds and not collide with a valid row.
    tok = jnp.where(tok < num_tokens, tok, tok - num_tokens)
    head = kvh * group + r % group
    # int4 rows hold D/2 bytes of (d, d + D/2) pairs: q, keys, values and the output
    # then go in two D/2-wide chunks, so no nibbles are ever interleaved.
    n_chunks = 2 if fmt == "int4" else 1
    width = head_dim // n_chunks
    dims = [c * width + jnp.arange(width, dtype=jnp.int32) for c in range(n_chunks)]
    if n_chunks == 1:
        qs = [q_ref[tok, head, :]]  # [M, D]
    else:
        qs = [q_ref[tok[:, None], head[:, None], d[None, :]] for d in dims]
    q_sum = (sum(jnp.sum(qc.astype(jnp.float32), axis=1) for qc in qs)  # [M]: int4's minimum
             if fmt == "int4" else None)
    pos = jnp.where(valid, pos_ref[tok], -1)  # [M]
    num_steps = (jnp.max(pos) + keys) // keys  # keys 0..max(pos) inclusive
    layer = layer_ref[0]
    kk = jnp.arange(keys, dtype=jnp.int32)
    max_col = bt_ref.shape[1] - 1
    cdt = q_ref.dtype if fmt != "plain" else kv_ref.dtype  # dot operand dtype

    def body(j, carry):
        m, l, acc = carry
        col = jnp.minimum(j * ppb + kk // page_size, max_col)
        page, off = bt_ref[req, col], kk % page_size  # [BK] each
        ks, k_scale, k_min = _load_rows(kv_ref, layer, 0, kvh, page, off, page_size, fmt, cdt)
        s = plt.dot(qs[0].astype(cdt), ks[0], trans_b=True)  # [M, BK] float32
        for qc, kc in zip(qs[1:], ks[1:]):
            s = s + plt.dot(qc.astype(cdt), kc, trans_b=True)
        if k_scale is not None:
            s = s * k_scale[None, :]
        if k_min is not None:  # q . (k_q * s + m) = s (q . k_q) + m * sum(q)
            s = s + q_sum[:, None] * k_min[None, :]
        s = s * sm_scale
        visible = (j * keys + kk)[None, :] <= pos[:, None]
        s = jnp.where(visible, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=1)
        vs, v_scale, v_min = _load_rows(kv_ref, layer, 1, kvh, page, off, page_size, fmt, cdt)
        pv = (p if v_scale is None else p * v_scale[None, :]).astype(cdt)
        acc = tuple(a * alpha[:, None] + plt.dot(pv, vc) for a, vc in zip(acc, vs))
        if v_min is not None:  # sum_j p_j (v_q s + m)_j: the minimum adds p . m to every column
            pm = jnp.sum(p * v_min[None, :], axis=1)[:, None]
            acc = tuple(a + pm for a in acc)
        return m_new, l, acc

    init = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(n_chunks)))
    _, l, acc = jax.lax.fori_loop(0, num_steps, body, init)
    inv = 1.0 / jnp.where(l == 0.0, 1.0, l)  # rows that saw no key -> 0
    for a, d in zip(acc, dims):
        plt.store(o_ref.at[tok[:, None], head[:, None], d[None, :]],
                  (a * inv[:, None]).astype(o_ref.dtype), mask=valid[:, None])


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, layer: jax.Array,
                           md: AttentionMetadata, *, sm_scale: float,
                           block_rows: int = 64, block_keys: int = 64,
                           num_warps: int = 4, num_stages: int = 2,
                           interpret: bool | None = None) -> jax.Array:
    """Ragged paged attention as one pallas_call; see the module docstring.

    block_rows: query rows (tokens x GQA heads) per program, a power of two >= 16
    on GPU (Triton's dot minimum); block_keys: keys per page-loop step (whole pages).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_pages, page_size, width = kv_pages.shape
    fmt = kv_quant.page_format(kv_pages.dtype, width, head_dim)
    group = num_heads // num_kv_heads
    bq = max(1, block_rows // group)
    ppb = max(1, block_keys // page_size)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    pad = max(0, bq - num_tokens)  # the row wrap-around needs T >= bq
    positions = md.positions
    if pad:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        positions = jnp.pad(positions, (0, pad), constant_values=-1)
    total = num_tokens + pad
    sched = block_schedule(md.query_start_loc.astype(jnp.int32), total, bq)
    if fmt in ("plain", "fp8"):  # rows of the flat page array
        flat_kv = kv_pages.reshape(num_layers, 2, num_kv_heads, num_pages * page_size, width)
    else:  # int8 / int4: each page's bytes (split layout)
        flat_kv = kv_pages.reshape(num_layers, 2, num_kv_heads, num_pages, page_size * width)
    kernel = functools.partial(_kernel, sm_scale=float(sm_scale), group=group, bq=bq,
                               ppb=ppb, page_size=page_size, fmt=fmt)
    out = pl.pallas_call(
        kernel,
        grid=(sched.shape[1], num_kv_heads),
        out_shape=jax.ShapeDtypeStruct((total, num_heads, head_dim), q.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxllm_ragged_paged_attention",
    )(sched, positions.astype(jnp.int32), md.block_tables.astype(jnp.int32),
      jnp.reshape(layer, (1,)).astype(jnp.int32), q, flat_kv)
    return out[:num_tokens] if pad else out
