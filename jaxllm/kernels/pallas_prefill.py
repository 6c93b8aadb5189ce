"""Portable twin of the Hopper prefill kernel (`mosaic_prefill.py`): same block schedule.

A `pallas_call` (interpret mode on CPU, Triton on GPU) with the Mosaic kernel's work split,
so the CPU tests check the schedule, the shifted last blocks, the head-major row order and
the split of the key loop into unmasked and causally masked steps:
  grid (block, kv head); block b = `prefill_schedule` column b; rows r = g * bq + i
  (query head kvh * G + g, token t0 + i, position pos0 + i); key steps of `block_keys`
  keys gathered through the block table; steps [0, n_full) need no mask (every row sees
  every key), steps [n_full, steps) are masked causally; online softmax in float32;
  rows i < count stored (a masked scatter here, TMA copies in the Mosaic kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxllm.kernels import prefill_schedule as ps
from jaxllm.kernels.metadata import AttentionMetadata

_NEG = -1e30


def _kernel(sched_ref, bt_ref, layer_ref, q_ref, kv_ref, o_ref, *, sm_scale: float,
            group: int, bq: int, block_keys: int, page_size: int):
    b, kvh = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[2]
    rows = bq * group
    req, t0, lo = sched_ref[ps.REQ, b], sched_ref[ps.T0, b], sched_ref[ps.LO, b]
    count, pos0, key_end = sched_ref[ps.COUNT, b], sched_ref[ps.POS0, b], sched_ref[ps.KEY_END, b]
    r = jnp.arange(rows, dtype=jnp.int32)
    i, head = r % bq, kvh * group + r // bq
    valid = (i >= lo) & (i < lo + count)
    tok = t0 + i  # < T: the window never reaches past the batch
    q = q_ref[tok, head, :]  # [rows, D]
    row_pos = pos0 + i
    steps = (key_end + block_keys - 1) // block_keys
    n_full = jnp.minimum(steps, jnp.maximum(pos0 + lo + 1, 0) // block_keys)
    layer = layer_ref[0]
    kk = jnp.arange(block_keys, dtype=jnp.int32)
    max_col = bt_ref.shape[1] - 1

    def step(j, carry, masked: bool):
        m, l, acc = carry
        key = j * block_keys + kk
        slot = bt_ref[req, jnp.minimum(key // page_size, max_col)] * page_size + key % page_size
        k = kv_ref[layer, 0, kvh, slot, :]  # [BK, D]
        v = kv_ref[layer, 1, kvh, slot, :]
        s = plt.dot(q, k, trans_b=True).astype(jnp.float32) * sm_scale
        if masked:
            s = jnp.where(key[None, :] <= row_pos[:, None], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plt.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return m_new, l, acc

    carry = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))
    carry = jax.lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    _, l, acc = jax.lax.fori_loop(n_full, steps, functools.partial(step, masked=True), carry)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]  # padding tail: no keys -> 0
    d = jnp.arange(head_dim, dtype=jnp.int32)
    plt.store(o_ref.at[tok[:, None], head[:, None], d[None, :]], out.astype(o_ref.dtype),
              mask=valid[:, None])


def ragged_prefill_attention(q: jax.Array, kv_pages: jax.Array, layer: jax.Array,
                             md: AttentionMetadata, *, sm_scale: float, block_rows: int = 128,
                             block_keys: int = 128, num_warps: int = 8, num_stages: int = 2,
                             interpret: bool | None = None) -> jax.Array:
    """q [T, H, D] -> [T, H, D]; same contract as `ref.ragged_paged_attention`."""
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_pages, page_size, _ = kv_pages.shape
    group = num_heads // num_kv_heads
    if block_rows % group or block_keys % page_size and page_size % block_keys:
        raise ValueError(f"block_rows={block_rows} needs G | rows, got G={group}; "
                         f"block_keys={block_keys} vs page {page_size}")
    bq = block_rows // group
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    pad = max(0, bq - num_tokens)  # the block window needs T >= bq
    positions = md.positions
    if pad:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        positions = jnp.pad(positions, (0, pad), constant_values=-1)
    sched = ps.prefill_schedule(md.query_start_loc, positions, num_tokens + pad, bq)
    flat_kv = kv_pages.reshape(num_layers, 2, num_kv_heads, num_pages * page_size, head_dim)
    kernel = functools.partial(_kernel, sm_scale=float(sm_scale), group=group, bq=bq,
                               block_keys=block_keys, page_size=page_size)
    out = pl.pallas_call(
        kernel,
        grid=(sched.shape[1], num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxllm_ragged_prefill_twin",
    )(sched, md.block_tables.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
      q, flat_kv)
    return out[:num_tokens] if pad else out
