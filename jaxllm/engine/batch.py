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

from jaxllm.runtime.scheduler import SchedulerOutput


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


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def build_batch(out: SchedulerOutput, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...],
                block_size: int, max_blocks: int) -> HostBatch:
    rows = out.scheduled
    T = pick_bucket(token_buckets, out.num_batched_tokens)
    R = pick_bucket(seq_buckets, len(rows))
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
    if n:
        tokens[:n] = np.concatenate([np.asarray(s.token_ids, np.int32) for s in rows])
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
                     np.array([len(rows)], np.int32), logits_indices, len(rows))
