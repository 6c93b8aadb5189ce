"""Plain-jnp ragged paged attention: the CPU path and the reference for the kernels.

KV page layout (one array for the whole model, carried through the layer scan):
    kv_pages: [L, 2, K, P, S, D]  layer, (key|value), kv head, page, slot in page, head dim
(D becomes the stored row width W for quantized caches, see kv_quant.py.)
Keeping the KV head ahead of the page makes one page of one head a contiguous
S*D tile (what a GPU kernel loads in one copy) and lets tensor parallelism shard
the array along K.

Queries are ragged: the T tokens of a step are the new tokens of R requests laid
end to end (a decode row contributes 1 token, a prefill chunk many). Token t sees
the keys of its own request at positions <= positions[t]; those keys were written
into the pages by `write_kv` before attention runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels import kv_quant
from jaxllm.kernels.metadata import AttentionMetadata

_NEG = -1e30
COLS = 8  # page columns a pass of the reference attention takes at once


def write_kv(kv_pages: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
    """Scatter new keys/values [T, K, D] into their slots of layer `layer`.

    Padding tokens carry slot -1, mapped out of range and dropped, so the write
    touches only T slots and (with the pages donated) never copies the cache.
    """
    num_layers, _, num_kv_heads, num_pages, page_size, width = kv_pages.shape
    slot = jnp.where(slot_mapping < 0, num_pages * page_size, slot_mapping)
    page, off = slot // page_size, slot % page_size
    # Quantized caches store encoded rows (kv_quant.py): [2, T, K, W].
    kv = kv_quant.encode_rows(jnp.stack([k, v]), kv_pages.dtype, width)
    fmt = kv_quant.page_format(kv_pages.dtype, width, k.shape[-1])
    if fmt in ("plain", "fp8"):
        kv = jnp.swapaxes(kv, 1, 2)  # [2, K, T, D]
        return kv_pages.at[layer, :, :, page, off].set(
            jnp.moveaxis(kv, 2, 0), mode="drop")  # update shape [T, 2, K, D]
    # int8 / int4 pages are split (kv_quant.py): each record's W bytes go to their places in
    # the page's S * W bytes (values at off * Dv, scale bytes in the page's scale block).
    where = jnp.asarray(kv_quant.record_index(fmt, page_size, width))[off]  # [T, W]
    flat = kv_pages.reshape(num_layers, 2, num_kv_heads, num_pages, page_size * width)
    flat = flat.at[layer, :, :, page[:, None], where].set(
        jnp.transpose(kv, (1, 3, 0, 2)), mode="drop")  # update shape [T, W, 2, K]
    return flat.reshape(kv_pages.shape)


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, layer: jax.Array,
                           md: AttentionMetadata, *, sm_scale: float) -> jax.Array:
    """Attention of ragged queries q [T, H, D] over paged keys; returns [T, H, D].

    One online-softmax pass over the page columns, COLS of them (COLS * S keys) at a time, up
    to the step's real longest context (not max_model_len). With at most as many tokens as
    requests (decode) each token gathers its request's pages; with more (prefill chunks) each
    request's pages are gathered once and each token's scores picked out by a one-hot sum
    over requests (exact: the other terms are zeros), instead of a copy of the pages per token
    (a 784-token SmolLM2 forward on the CPU moved 28 GB that way, and took 3x as long).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, _, page_size, _ = kv_pages.shape
    group = num_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    num_reqs, width = md.block_tables.shape
    per_req = num_tokens > num_reqs
    tables = md.block_tables if per_req else md.block_tables[md.token_req]  # [R or T, B]
    tables = jnp.pad(tables, ((0, 0), (0, -width % COLS)))  # whole chunks; padding keys masked
    pick = jax.nn.one_hot(md.token_req, num_reqs, dtype=jnp.float32) if per_req else None  # [T, R]
    chunk = COLS * page_size
    num_chunks = (jnp.max(md.seq_lens) + chunk - 1) // chunk

    def gather(kv: int, pages: jax.Array) -> jax.Array:
        # Straight from the whole cache (slicing out the layer first would copy that layer's
        # pages on every call); quantized pages dequantized here, one chunk at a time.
        x = kv_quant.decode(kv_pages[layer, kv, :, pages], head_dim)  # [N, C, K, S, D] float32
        return jnp.swapaxes(x, 1, 2).reshape(x.shape[0], num_kv_heads, chunk, head_dim)

    def body(j, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, j * COLS, COLS, axis=1)  # [R or T, C]
        k, v = gather(0, pages), gather(1, pages)  # [R or T, K, C*S, D]
        if per_req:
            s = jnp.einsum("tkgrs,tr->tkgs", jnp.einsum("tkgd,rksd->tkgrs", qg, k), pick)
        else:
            s = jnp.einsum("tkgd,tksd->tkgs", qg, k)
        key_pos = j * chunk + jnp.arange(chunk)
        visible = key_pos[None, :] <= md.positions[:, None]  # [T, C*S]
        s = jnp.where(visible[:, None, None, :], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        p = jnp.where(visible[:, None, None, :], p, 0.0)
        scale = jnp.exp(m - m_new)
        l = l * scale + p.sum(-1)
        if per_req:
            pv = jnp.einsum("tkgrs,rksd->tkgd", p[:, :, :, None, :] * pick[:, None, None, :, None], v)
        else:
            pv = jnp.einsum("tkgs,tksd->tkgd", p, v)
        acc = acc * scale[..., None] + pv
        return m_new, l, acc

    init = (jnp.full((num_tokens, num_kv_heads, group), _NEG, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # padding tokens -> 0
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def dense_reference(q, k_ctx, v_ctx, q_pos, sm_scale):
    """Textbook attention for one request: q [N, H, D] at positions q_pos over k/v [C, K, D].

    Used by tests to check the paged functions against the definition.
    """
    num_heads, num_kv_heads = q.shape[1], k_ctx.shape[1]
    k = jnp.repeat(k_ctx, num_heads // num_kv_heads, axis=1).astype(jnp.float32)
    v = jnp.repeat(v_ctx, num_heads // num_kv_heads, axis=1).astype(jnp.float32)
    s = jnp.einsum("nhd,chd->nhc", q.astype(jnp.float32), k) * sm_scale
    mask = jnp.arange(k.shape[0])[None, :] <= q_pos[:, None]
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    return jnp.einsum("nhc,chd->nhd", jax.nn.softmax(s, axis=-1), v)
