"""Block schedule shared by the Hopper prefill kernel and its portable twin.

A program (CTA) owns `rows = bq * G` query rows: bq consecutive tokens of one segment x the
G query heads of one kv head, ordered head-major (row r = g * bq + i), so each head's bq
tokens are one contiguous row block (one TMA copy) and every key tile serves all G heads.

Segments are the R request rows ([query_start_loc[r], query_start_loc[r+1])) plus the
padding tail [query_start_loc[R], T), whose rows see no key and so write zeros: every
output row is written, no pre-fill is needed. A segment of n tokens gets ceil(n / bq)
blocks. When n >= bq every block is full: the last one is shifted back to end at the
segment end, overlapping its predecessor, whose overlapping rows it recomputes bit for bit
(same rows, same keys, same key-step order), so the double write is benign. Only segments
shorter than bq (decode rows, short chunks, a short padding tail) give a partial block,
whose `count < bq` valid rows are stored row-exactly.

No copy ever leaves [0, T): a block's 128-row window starts at t0 = min(first token,
T - bq) (the wrapper pads T up to bq), so a partial block near the end of the batch has its
valid rows at [lo, lo + count) of the window, lo > 0. Row i of the window is token t0 + i.

Tokens of one request have consecutive positions, so a block's row i sits at position
pos0 + i and sees keys [0, pos0 + i] (pos0 < 0 when the window starts before the request);
the block needs `key_end = pos0 + lo + count` keys (0 for the padding tail), and key steps
below its first valid position pos0 + lo need no mask. Blocks are ordered heaviest first (largest key_end), so the
long causal tiles start in the first wave and short ones fill the tail.

`aligned_layout` relabels a batch so every segment starts at a multiple of 8 rows (the Hopper
kernel's TMA copies of q and out address rows through an (8, 64) tiling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Rows of the schedule table.
REQ, T0, LO, COUNT, POS0, KEY_END, SEG = range(7)


def num_blocks(num_tokens: int, num_reqs: int, bq: int) -> int:
    """Static bound on the blocks of R + 1 segments covering T tokens."""
    return num_tokens // bq + num_reqs + 1


def prefill_schedule(query_start_loc: jax.Array, positions: jax.Array, num_tokens: int,
                     bq: int) -> jax.Array:
    """int32 [7, NB]: (request, window start t0, first valid row lo, valid rows, position of
    row 0, key_end, segment). Needs num_tokens >= bq.

    Surplus blocks have count 0 and key_end 0: their program loads and stores nothing.
    """
    qsl = query_start_loc.astype(jnp.int32)
    num_reqs = qsl.shape[0] - 1
    nb = num_blocks(num_tokens, num_reqs, bq)
    seg_start = qsl  # [R + 1]: the requests, then the padding tail
    seg_end = jnp.concatenate([qsl[1:], jnp.array([num_tokens], jnp.int32)])
    seg_len = seg_end - seg_start
    seg_blocks = (seg_len + bq - 1) // bq
    cum = jnp.cumsum(seg_blocks)
    blk = jnp.arange(nb, dtype=jnp.int32)
    seg = jnp.searchsorted(cum, blk, side="right", method="compare_all").astype(jnp.int32)  # no loop
    active = seg <= num_reqs
    s = jnp.minimum(seg, num_reqs)
    j = blk - (cum[s] - seg_blocks[s])  # block index within its segment
    t0 = seg_start[s] + j * bq
    t0 = jnp.where(seg_len[s] >= bq, jnp.minimum(t0, seg_end[s] - bq), t0)  # last block: shift
    count = jnp.minimum(bq, seg_end[s] - t0)
    is_req = active & (s < num_reqs)
    first = jnp.where(is_req, positions[jnp.clip(t0, 0, positions.shape[0] - 1)], -1)
    win = jnp.minimum(t0, num_tokens - bq)  # the window never reaches past T
    lo = t0 - win
    key_end = jnp.where(is_req, first + count, 0)
    req = jnp.minimum(s, num_reqs - 1)
    table = jnp.stack([req, jnp.where(active, win, 0), jnp.where(active, lo, 0),
                       jnp.where(active, count, 0), first - lo, key_end, s]).astype(jnp.int32)
    order = jnp.argsort(-table[KEY_END], stable=True)  # heaviest first
    return table[:, order]


def short_segment_rows(query_start_loc: jax.Array, num_tokens: int, bq: int) -> jax.Array:
    """[R + 1, bq] token of window row i of each segment shorter than bq (its one, partial
    block), or num_tokens (out of range: dropped by a scatter) for rows outside it."""
    qsl = query_start_loc.astype(jnp.int32)
    start = qsl
    end = jnp.concatenate([qsl[1:], jnp.array([num_tokens], jnp.int32)])
    n = end - start
    win = jnp.minimum(start, num_tokens - bq)
    lo = start - win
    i = jnp.arange(bq, dtype=jnp.int32)[None, :]
    valid = (n < bq)[:, None] & (i >= lo[:, None]) & (i < (lo + n)[:, None])
    return jnp.where(valid, win[:, None] + i, num_tokens)


ALIGN = 8  # TMA row granularity of the [T, K, G, D] q/out views (their (8, 64) tiling)


def aligned_layout(query_start_loc: jax.Array, positions: jax.Array, num_tokens: int,
                   align: int = ALIGN) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, int]:
    """Relabel a batch so that every segment (request rows, then the padding tail) starts
    at a multiple of `align` -> (qsl' [R + 1], positions' [Tp], dest [T], src [Tp], Tp).

    The TMA copies of q and out address rows through the views' (8, 64) tiling, so a copy
    whose first row is not a multiple of 8 runs out of its tile: rows come back as zeros
    and stores are dropped (seen on the H200: every ragged batch wrong, every batch of one
    aligned prompt right). Token t goes to row dest[t]; the gap rows after a request
    continue its positions (garbage queries whose rows nobody reads; the real rows' causal
    mask hides the extra keys) and the tail rows have position -1 (zeros).

    `src` is the inverse map, for a gather (`q[src]`) instead of a scatter into zeros: row p
    takes token src[p], its segment's token at the same offset, clipped into the segment (gap
    rows repeat the segment's last token: queries nobody reads). On the H200 the wrapper
    with the gather ran 1.20x faster than with the scatter at 1x8192, 1.05x at 1x32768
    (docs/benchmarks.md, session 9)."""
    qsl = query_start_loc.astype(jnp.int32)
    num_reqs = qsl.shape[0] - 1
    seg_start = qsl
    seg_end = jnp.concatenate([qsl[1:], jnp.array([num_tokens], jnp.int32)])
    seg_n = seg_end - seg_start
    new_n = (seg_n + align - 1) // align * align
    new_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(new_n)[:-1]])
    padded = -(-(num_tokens + align * (num_reqs + 1)) // align) * align
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seg_t = jnp.searchsorted(seg_end, t, side="right").astype(jnp.int32)
    dest = new_start[seg_t] + t - seg_start[seg_t]
    p = jnp.arange(padded, dtype=jnp.int32)
    seg_p = jnp.searchsorted(new_start[1:], p, side="right").astype(jnp.int32)  # 0..R
    first = positions[jnp.clip(seg_start[seg_p], 0, num_tokens - 1)]
    new_pos = jnp.where((seg_p < num_reqs) & (seg_n[seg_p] > 0),
                        first + p - new_start[seg_p], -1)
    offset = jnp.minimum(p - new_start[seg_p], jnp.maximum(seg_n[seg_p] - 1, 0))
    src = jnp.clip(seg_start[seg_p] + offset, 0, num_tokens - 1)
    return new_start, new_pos.astype(jnp.int32), dest, src.astype(jnp.int32), padded
