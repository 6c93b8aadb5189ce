"""Overlapped speculative steps: the next step's tokens moved back over rejected drafts.

With async scheduling, step N+1 is scheduled while step N verifies k drafts of a request.
The scheduler counts step N's tokens as if every draft were accepted (vLLM V1's optimistic
`num_computed_tokens`), so step N+1 feeds that request one placeholder token (the token
sampled after the drafts) and its new drafts at positions k - a too far on, where a is the
number step N accepts. Only the device knows a when step N+1 runs: the host sends, per
request row, step N's rows of that request and its drafts ([R, 2K + 1], `host_rows`); inside
the jitted step `correct` recomputes a exactly as `SpecDecoder.accepted` does on the host
(drafts accepted up to the first row whose sampled token differs), takes the token sampled
at row a as the placeholder, and moves the request's positions, context length and KV slots
back by k - a. Every other row has no entry (-1) and stays as it is.

On the host the scheduler rolls the request back by the same k - a when it reads step N
(`Scheduler._roll_back`), so both sides agree from step N + 2 on. Only host-side proposers
(ngram) overlap their steps: their drafts for step N+1 are made from step N-1's tokens plus
step N's drafts (`SpecDecoder.propose`, `inflight`), and a guess that step N proves wrong
costs acceptance, never exactness (verification is exact for any draft).
"""

from __future__ import annotations

import dataclasses

import numpy as np

BONUS = -2  # prev_index of a placeholder taken from the row step N's acceptance picks


def width(k: int) -> int:
    """Columns of the per-row entry: K + 1 rows of step N (drafts' rows, bonus row), K drafts."""
    return 2 * k + 1


def host_rows(hb, out, prev, columns: int):
    """`hb` with the entry ([R, columns = width(K)]) of every row whose request verified drafts
    in `prev` (the step in flight); its placeholder token marked BONUS. `out`: the step `hb`
    was built from."""
    R, k = hb.block_tables.shape[0], (columns - 1) // 2
    entry = np.full((R, columns), -1, np.int32)
    if prev is not None and prev.spec_rows:
        drafts = {s.request_id: s.spec_token_ids for s in prev.out.scheduled if s.spec_token_ids}
        prev_index = hb.prev_index.copy()
        for i, s in enumerate(out.scheduled):
            rows = prev.spec_rows.get(s.request_id)
            if rows is None:
                continue
            first = int(hb.query_start_loc[i])
            if prev_index[first] < 0:
                raise AssertionError(f"{s.request_id}: a request verifying drafts in flight must "
                                     "start its next step with the placeholder of its next token")
            d = drafts[s.request_id]
            entry[i, :len(rows)] = rows
            entry[i, k + 1:k + 1 + len(d)] = d
            prev_index[first] = BONUS
        hb = dataclasses.replace(hb, prev_index=prev_index)
    return dataclasses.replace(hb, spec_prev=entry)


def correct(tokens, md, entry, prev_index, prev_ids, block_size: int):
    """Inside the jitted step: tokens [T], md (AttentionMetadata), entry [R, 2K + 1],
    prev_index [T], prev_ids [P] (step N's sampled ids) -> (tokens, md) moved back over the
    drafts step N rejected."""
    import jax.numpy as jnp
    k = (entry.shape[1] - 1) // 2
    rows, drafts = entry[:, :k + 1], entry[:, k + 1:]
    got = prev_ids[jnp.maximum(rows[:, :k], 0)]  # [R, K] what step N sampled at each draft's row
    ok = ((got == drafts) & (drafts >= 0)).astype(jnp.int32)
    accepted = jnp.cumprod(ok, axis=1).sum(1)  # [R]
    shift = (drafts >= 0).sum(1) - accepted  # [R] rejected drafts
    bonus = prev_ids[jnp.maximum(jnp.take_along_axis(rows, accepted[:, None], 1)[:, 0], 0)]  # [R]
    real = md.positions >= 0
    moved = jnp.where(real, shift[md.token_req], 0)  # [T]
    pos = md.positions - moved
    p = jnp.maximum(pos, 0)
    slots = md.block_tables[md.token_req, p // block_size] * block_size + p % block_size
    md = dataclasses.replace(
        md, positions=pos, slot_mapping=jnp.where(moved > 0, slots, md.slot_mapping),
        seq_lens=md.seq_lens - jnp.where(md.seq_lens > 0, shift, 0))
    return jnp.where(prev_index == BONUS, bonus[md.token_req], tokens), md
