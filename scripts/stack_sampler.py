"""Where each thread of this process spends a time window: Python stacks sampled in-process.

    with StackSampler(interval_s=0.005) as s:
        ...  # the window to look at
    print(s.summary(top=8))

A daemon thread reads `sys._current_frames()` every `interval_s` and counts, per thread name,
the innermost `depth` frames (file:line function) of each stack. A thread blocked in C code
(a device wait, a lock, a socket) shows the Python line that called it, which is what a
benchmark needs to find what a thread waits for. Sampling needs the interpreter lock, so a
thread holding it for long stretches lowers the sample count rather than hiding itself.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time


def _frames(frame, depth: int) -> tuple[str, ...]:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(out)


class StackSampler:
    def __init__(self, interval_s: float = 0.005, depth: int = 4):
        self.interval_s, self.depth = interval_s, depth
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds = 0.0

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[names.get(ident, str(ident))][_frames(frame, self.depth)] += 1
            self.samples += 1

    def __enter__(self) -> "StackSampler":
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._t0

    def summary(self, top: int = 6) -> dict:
        """Per thread: its samples and its `top` most frequent stacks (innermost first), with
        the fraction of the thread's samples each took."""
        out = {"samples": self.samples, "seconds": round(self.seconds, 3), "threads": {}}
        for name, c in sorted(self.counts.items()):
            n = sum(c.values())
            out["threads"][name] = {"samples": n, "top": [
                {"share": round(k / n, 3), "stack": list(stack)} for stack, k in c.most_common(top)]}
        return out
