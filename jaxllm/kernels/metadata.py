"""Attention metadata: the per-step description of a ragged, paged batch.

Registered as a pytree dataclass so the jitted step takes it as one argument;
every field is a fixed-shape int32 array (shapes are set by the runner's
buckets), so a new batch composition never triggers a recompile.

Shapes use: T = padded token count, R = padded request count,
B = max blocks per request (ceil(max_model_len / block_size)).
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # [T] position of each token in its request; -1 for padding
    token_req: jax.Array  # [T] request row of each token; padding -> 0 (masked by position -1)
    slot_mapping: jax.Array  # [T] page * block_size + offset to write K/V; padding -> -1 (dropped)
    block_tables: jax.Array  # [R, B] page ids per request; unused entries 0
    seq_lens: jax.Array  # [R] context length after this step (cached + new); padding rows 0
    query_start_loc: jax.Array  # [R + 1] cumulative new-token counts; padding rows repeat the total
    num_seqs: jax.Array  # [1] number of real request rows
