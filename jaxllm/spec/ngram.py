"""Prompt-lookup (n-gram) proposals, vectorised with numpy over all rows at once.

For each row, the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min
tokens) that also occurs earlier in the row's prompt + output is looked up, and the
tokens that followed its latest earlier occurrence are proposed (at most k, fewer
where the row's history ends). Host work only: no JAX here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def pack_rows(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> ([R, L] int32 padded with -1, [R] lengths), in one conversion."""
    lens = np.fromiter(map(len, rows), np.int64, len(rows))
    L = int(lens.max()) if len(rows) else 0
    tokens = np.full((len(rows), max(L, 1)), -1, np.int32)
    if lens.sum():
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(lens.sum()))
        row = np.repeat(np.arange(len(rows)), lens)
        col = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        tokens[row, col] = flat
    return tokens, lens


def propose(tokens: np.ndarray, lens: np.ndarray, n_min: int, n_max: int,
            k: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [R, L] (-1 padded), lens [R], k: drafts wanted per row -> (drafts [R, kmax], counts [R]).

    Candidate windows are named by their last index e (window [e - n + 1, e], followed by a
    token: e < len - 1). Growing n by one ANDs one shifted comparison into the [R, L] match of
    n - 1, so every n costs two array ops (a step of a batch of one spends ~10x less than
    with a window view per n).
    """
    R, L = tokens.shape
    k = np.broadcast_to(np.asarray(k, np.int64), (R,))
    kmax = int(k.max()) if R else 0
    start = np.full(R, -1, np.int64)  # index of the first proposed token
    if R and L > 1 and kmax > 0:
        e = np.arange(L)
        last = lens.astype(np.int64) - 1  # each row's last token: the suffix ends there
        match = (e[None, :] < last[:, None]) & (k > 0)[:, None]
        rows = np.arange(R)
        found_at = {}
        for n in range(1, n_max + 1):
            off = n - 1  # compare the window's token at e - off with the suffix's at last - off
            if off >= L:
                break
            tail = tokens[rows, np.maximum(last - off, 0)]  # [R]
            col = np.empty_like(tokens)
            col[:, off:] = tokens[:, :L - off]  # col[:, e] = tokens[:, e - off]
            col[:, :off] = -2  # no window starts before the row
            match &= col == tail[:, None]
            if n >= n_min:
                ok = match.any(1) & (lens > n)
                found_at[n] = np.where(ok, (L - 1) - np.argmax(match[:, ::-1], axis=1) + 1, -1)
            if not match.any():
                break
        for n in range(n_max, n_min - 1, -1):  # the longest n that matched wins
            if n in found_at:
                start = np.where(start < 0, found_at[n], start)
    idx = start[:, None] + np.arange(kmax)[None, :]
    valid = (start[:, None] >= 0) & (idx < lens[:, None]) & (np.arange(kmax)[None, :] < k[:, None])
    drafts = np.where(valid, np.take_along_axis(tokens, np.clip(idx, 0, L - 1), axis=1), -1)
    return drafts.astype(np.int32), valid.sum(1)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, histories: Sequence[Sequence[int]], k: np.ndarray | int | None = None
                ) -> list[list[int]]:
        """Drafts for each history (prompt + output ids); `k` caps each row's count."""
        if not histories:
            return []
        tokens, lens = pack_rows(histories)
        drafts, counts = propose(tokens, lens, self.n_min, self.n_max, self.k if k is None else k)
        return [d[:c].tolist() for d, c in zip(drafts, counts)]
