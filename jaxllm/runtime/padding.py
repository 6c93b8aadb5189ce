"""Chunks sized to the step's padded token count (the device compiles a few token buckets).

A step of `used` tokens plus a prompt chunk of n is padded up to the next bucket; when the
chunk just crosses a bucket boundary, most of the padded bucket is padding, and on a
compute-bound step (large buckets: 8B on an H200 from ~200 tokens) padding costs as much as
real tokens. Cutting the chunk back to the boundary and carrying the rest into the next
step (which runs anyway, for the running requests' next tokens) turns that padding into
nothing: e.g. 63 decode rows + a 600-token prompt (663 -> bucket 1,024) become 512 now and
63 + 151 (-> 256) next. Pure Python.
"""

from __future__ import annotations

import bisect


def fit_chunk(used: int, n: int, buckets: tuple[int, ...], min_bucket: int) -> int:
    """The chunk to schedule instead of n, with `used` tokens already in the step.

    Cut to the bucket boundary below used + n when that boundary is at least `min_bucket`,
    the step would sit in the lower half between the two buckets (padding more than it
    fills) and the cut keeps at least half of the chunk (so a prompt never crawls)."""
    total = used + n
    i = bisect.bisect_left(buckets, total)
    if i == 0 or i == len(buckets):
        return n
    lo, hi = buckets[i - 1], buckets[i]
    cut = lo - used
    if lo < min_bucket or total - lo >= hi - total or 2 * cut < n:
        return n
    return cut
