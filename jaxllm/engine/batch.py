"""Scheduler output -> fixed-shape padded numpy arrays for the jitted step.

The step is compiled for a few (token count, request count) buckets only; this
module picks the smallest bucket that fits and pads. Numpy only: building the
batch is host work and must stay cheap and jax-free until the one transfer.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np

from jaxllm.runtime.scheduler import PLACEHOLDER, SchedulerOutput


@dataclass
class HostBatch:
    tokens: np.ndarray  # [T] int32 token ids; padding 0
    positions: np.ndarray  # [T] int32; padding -1
    token_req: np.ndarray  # [T] int32 row of each token; padding 0
    slot_mapping: np.ndarray  # [T] int32 page*block_size+offset; padding -1
    block_tables: np.ndarray  # [R, B] int32
    seq_lens: np.ndarray  # [R] int32; padding 0
    query_start_loc: np.ndarray  # [R+1] int32
    num_seqs: np.ndarray  # [1] int32
    logits_indices: np.ndarray  # [R] int32 last token of each row; padding 0
    num_rows: int  # real rows
    prev_index: np.ndarray | None = None  # [T] int32 row of the previous step's ids; -1: known
    # [R, 2K + 1] int32: per row, the previous step's rows and drafts of its request when that
    # step verified drafts (overlapped speculative steps, jaxllm/spec/shift.py); -1: none
    spec_prev: np.ndarray | None = None


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


# A token bucket of at least this many tokens per row of the largest request bucket compiles that
# request bucket alone: padding its rows costs their LM-head rows, under 2% of such a step on an
# 8B model (lm_head is 1/16 of the weights; 1/4 row per token), and it saves a compile per bucket.
ROWS_PADDED_ABOVE = 4


def row_buckets_for(T: int, seq_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The request buckets compiled with token bucket T (the runner's warm-up compiles these)."""
    top = pick_bucket(seq_buckets, min(T, seq_buckets[-1]))
    if T >= ROWS_PADDED_ABOVE * seq_buckets[-1]:
        return (top,)
    return tuple(r for r in seq_buckets if r <= top)


def compiled_pairs(token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """Every (tokens, rows) shape the step is compiled for."""
    return [(T, R) for T in token_buckets for R in row_buckets_for(T, seq_buckets)]


def build_batch(out: SchedulerOutput, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...],
                block_size: int, max_blocks: int, prev_rows: dict[str, int] | None = None) -> HostBatch:
    """`prev_rows` maps a request to its row in the previous step's sampled ids: the
    device substitutes them for the PLACEHOLDER tokens (steps overlapped)."""
    rows = out.scheduled
    T = pick_bucket(token_buckets, out.num_batched_tokens)
    R = pick_bucket(row_buckets_for(T, seq_buckets), len(rows))
    lens = np.array([len(s.token_ids) for s in rows], np.int32)
    starts = np.array([s.start_pos for s in rows], np.int32)
    n = int(lens.sum())
    qsl = np.zeros(R + 1, np.int32)
    np.cumsum(lens, out=qsl[1:len(rows) + 1])
    qsl[len(rows) + 1:] = n

    # One conversion of all ids, then a scatter: per-row list -> array copies cost ~10 us each.
    block_tables = np.zeros((R, max_blocks), np.int32)
    nb = np.fromiter(map(len, (s.block_ids for s in rows)), np.int64, len(rows))
    if nb.sum():
        flat = np.fromiter(itertools.chain.from_iterable(s.block_ids for s in rows), np.int32, int(nb.sum()))
        row = np.repeat(np.arange(len(rows)), nb)
        col = np.arange(len(flat)) - np.repeat(np.cumsum(nb) - nb, nb)
        block_tables[row, col] = flat

    tokens = np.zeros(T, np.int32)
    positions = np.full(T, -1, np.int32)
    token_req = np.zeros(T, np.int32)
    slot_mapping = np.full(T, -1, np.int32)
    prev_index = np.full(T, -1, np.int32)
    if n:
        tokens[:n] = np.concatenate([np.asarray(s.token_ids, np.int32) for s in rows])
        holes = np.flatnonzero(tokens[:n] == PLACEHOLDER)
        if len(holes):  # one per request at most: its last token, sampled by the step in flight
            owner = np.searchsorted(qsl[1:len(rows) + 1], holes, side="right")
            prev_index[holes] = [prev_rows[rows[i].request_id] for i in owner]
            tokens[holes] = 0
        req_of = np.repeat(np.arange(len(rows), dtype=np.int32), lens)
        pos = np.arange(n, dtype=np.int32) - qsl[req_of] + starts[req_of]
        positions[:n] = pos
        token_req[:n] = req_of
        slot_mapping[:n] = block_tables[req_of, pos // block_size] * block_size + pos % block_size

    seq_lens = np.zeros(R, np.int32)
    seq_lens[:len(rows)] = starts + lens
    logits_indices = np.zeros(R, np.int32)
    logits_indices[:len(rows)] = qsl[1:len(rows) + 1] - 1
    return HostBatch(tokens, positions, token_req, slot_mapping, block_tables, seq_lens, qsl,
                     np.array([len(rows)], np.int32), logits_indices, len(rows), prev_index)


def with_logit_rows(hb: HostBatch, token_indices: list[int], token_buckets: tuple[int, ...],
                    seq_buckets: tuple[int, ...]) -> HostBatch:
    """Append logits rows at `token_indices`: the last token of an n > 1 leader's row
    (its siblings), or a draft position (speculative decoding).

    The new rows carry no tokens (attention treats them as padding), so only
    `logits_indices` changes; the batch is re-padded when the rows outgrow its
    request bucket, to a (tokens, rows) pair the runner compiled at start-up.
    """
    n = hb.num_rows + len(token_indices)
    R0, T0 = hb.block_tables.shape[0], len(hb.tokens)
    R, T = max(R0, pick_bucket(seq_buckets, n)), T0
    while R > row_buckets_for(T, seq_buckets)[-1]:
        T = token_buckets[token_buckets.index(T) + 1]
    R = pick_bucket(row_buckets_for(T, seq_buckets), R)

    def grow(a: np.ndarray, size: int, fill) -> np.ndarray:
        out = np.full((size, *a.shape[1:]), fill, a.dtype)
        out[:len(a)] = a
        return out

    li = grow(hb.logits_indices, R, 0)
    li[hb.num_rows:n] = token_indices
    return HostBatch(
        tokens=grow(hb.tokens, T, 0), positions=grow(hb.positions, T, -1),
        token_req=grow(hb.token_req, T, 0), slot_mapping=grow(hb.slot_mapping, T, -1),
        block_tables=grow(hb.block_tables, R, 0), seq_lens=grow(hb.seq_lens, R, 0),
        query_start_loc=grow(hb.query_start_loc, R + 1, hb.query_start_loc[-1]),
        num_seqs=hb.num_seqs, logits_indices=li, num_rows=hb.num_rows,
        prev_index=None if hb.prev_index is None else grow(hb.prev_index, T, -1),
        spec_prev=None if hb.spec_prev is None else grow(hb.spec_prev, R, -1))


def with_fork_rows(hb: HostBatch, src_rows: list[int], token_buckets: tuple[int, ...],
                   seq_buckets: tuple[int, ...]) -> HostBatch:
    """Append logits rows repeating the last token of `src_rows` (n > 1 siblings)."""
    return with_logit_rows(hb, [int(hb.logits_indices[i]) for i in src_rows], token_buckets, seq_buckets)
