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
from numpy.lib.stride_tricks import sliding_window_view


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
    """tokens [R, L] (-1 padded), lens [R], k: drafts wanted per row -> (drafts [R, kmax], counts [R])."""
    R, L = tokens.shape
    k = np.broadcast_to(np.asarray(k, np.int64), (R,))
    kmax = int(k.max()) if R else 0
    start = np.full(R, -1, np.int64)  # index of the first proposed token
    for n in range(n_max, n_min - 1, -1):
        todo = np.flatnonzero((start < 0) & (lens > n) & (k > 0))
        if not len(todo) or L <= n:
            continue
        t, ln = tokens[todo], lens[todo]
        suffix = np.take_along_axis(t, ln[:, None] - n + np.arange(n), axis=1)  # [r, n]
        win = sliding_window_view(t, n, axis=1)  # [r, L-n+1, n], a view
        match = (win == suffix[:, None, :]).all(-1)
        match &= np.arange(L - n + 1)[None, :] + n < ln[:, None]  # followed by a token, not the suffix
        found = match.any(1)
        latest = (L - n) - np.argmax(match[:, ::-1], axis=1)
        start[todo[found]] = latest[found] + n
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
