"""Mixed steps with their decode rows on the decode kernel (opt-in, JAXLLM_MIXED_DECODE_ROWS).

A mixed step carries prompt chunks and decode rows (one new token each) in one ragged batch,
and by default one prefill/mixed kernel runs all of it. On an H200 (Llama-3-8B shape, the mixed
random workload, docs/benchmarks.md session 8) the portable Pallas kernel took 3.6 ms per mixed
step where the decode kernel reads the same 63 decode rows' contexts in ~2.3 ms, and 6.1 ms per
step at 254 rows. `split_decode_rows` runs the two kernels on disjoint work of the same step:

- decode rows (rows with exactly one new token): their tokens, one per row, gathered into a
  [R, H, D] batch for `decode_fn` (a T <= R call, the shape a decode step of R rows compiles);
  every other row's entry is padding (position -1) there;
- everything else: `prefill_fn` on the whole step with the decode rows' tokens turned into
  padding (position -1), which the kernels skip (their page loop runs to the block's last
  position) and write as 0;
- the result: each decode token from the first, every other token from the second.

Both kernels keep their contract (`ref.ragged_paged_attention`'s), so the composition is exact
for any batch. Shapes are static: the decode call is [R] rows whatever the batch holds.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)
AttentionFn = Callable[..., jax.Array]
MODES = ("prefill", "decode")  # JAXLLM_MIXED_DECODE_ROWS: one mixed kernel (default) / the split
_logged: set = set()


def mode() -> str:
    """JAXLLM_MIXED_DECODE_ROWS: "prefill" (default: the mixed kernel takes the decode rows too)
    or "decode" (`split_decode_rows`; on an H200 +2.3% on the mixed workload, within its run-to-run
    spread, for twice the warm-up compile time: opt-in, docs/kernels.md)."""
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_MIXED_DECODE_ROWS", MODES[0], MODES)


def log_once(key: tuple) -> None:
    if key not in _logged:
        _logged.add(key)
        log.info("mixed steps (T=%d, R=%d): decode rows on the decode kernel, the rest on the "
                 "prefill/mixed kernel (JAXLLM_MIXED_DECODE_ROWS=decode)", *key)


def decode_row_mask(md: AttentionMetadata) -> jax.Array:
    """[R] bool: real rows with exactly one new token."""
    qsl = md.query_start_loc
    return ((qsl[1:] - qsl[:-1]) == 1) & (md.seq_lens > 0)


def split_decode_rows(q: jax.Array, kv_pages: jax.Array, layer: jax.Array, md: AttentionMetadata, *,
                      sm_scale: float, decode_fn: AttentionFn, prefill_fn: AttentionFn) -> jax.Array:
    """q [T, H, D] -> [T, H, D]: decode rows by `decode_fn`, the rest by `prefill_fn`."""
    num_rows = md.block_tables.shape[0]
    is_dec_row = decode_row_mask(md)  # [R]
    last = jnp.clip(md.query_start_loc[1:] - 1, 0, q.shape[0] - 1)  # [R] each row's last token
    md_dec = AttentionMetadata(
        positions=jnp.where(is_dec_row, md.positions[last], -1),
        token_req=jnp.arange(num_rows, dtype=jnp.int32),
        slot_mapping=jnp.full((num_rows,), -1, jnp.int32),  # attention writes nothing
        block_tables=md.block_tables,
        seq_lens=jnp.where(is_dec_row, md.seq_lens, 0),
        query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32),  # one token per row
        num_seqs=md.num_seqs)
    out_dec = decode_fn(q[last], kv_pages, layer, md_dec, sm_scale=sm_scale)  # [R, H, D]
    tok_dec = is_dec_row[md.token_req] & (md.positions >= 0)  # [T]
    md_pre = AttentionMetadata(
        positions=jnp.where(tok_dec, -1, md.positions), token_req=md.token_req,
        slot_mapping=md.slot_mapping, block_tables=md.block_tables, seq_lens=md.seq_lens,
        query_start_loc=md.query_start_loc, num_seqs=md.num_seqs)
    out_pre = prefill_fn(q, kv_pages, layer, md_pre, sm_scale=sm_scale)
    return jnp.where(tok_dec[:, None, None], out_dec[md.token_req], out_pre)
