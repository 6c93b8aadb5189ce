"""The engine's view of constrained decoding: one matcher per sequence and the step's bitmask.

The engine tells the manager when a sequence is added (its grammar starts compiling on the
compiler's threads), when tokens were appended to it (``advance``: the matcher follows the
request's output tokens, so a recompute preemption, which keeps them, needs nothing, and a
shrunk output rolls the matcher back), and asks it to ``fill`` the bitmask of a step's rows.

Timing (async scheduling stays on): the engine schedules and dispatches step k+1 while step k
runs. The forward pass of k+1 needs no mask; its draw does. So the dispatch thread launches the
forward pass of k+1, then waits for the mask; the host meanwhile reads step k's tokens, advances
the matchers with them and hands the step's rows to a mask thread (``hand_off``), which computes
step k+1's mask while the host detokenizes and streams step k and the dispatch thread launches
kernels. Every mask is thus computed from every earlier token, exactly as in a synchronous
engine, and the mask work overlaps both the device's forward pass and the host's other work. No JAX here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jaxllm.envs import env_choice
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured import compiler_for
from jaxllm.structured.backend import Matcher

log = logging.getLogger("jaxllm")
# Where a step's constrained rows are computed (``hand_off``); JAXLLM_MASK_ON picks one.
MASK_ON = ("thread", "dispatch", "engine")


class _SeqState:
    __slots__ = ("future", "matcher", "end_ids", "start", "consumed", "done")

    def __init__(self, future: Future, end_ids: list[int] | None):
        self.future = future
        self.matcher: Matcher | None = None
        self.end_ids = end_ids
        self.start: int | None = None if end_ids else 0  # output index where the grammar begins
        self.consumed = 0  # output tokens seen so far
        self.done = False  # grammar complete or broken: no more masking


class StructuredManager:
    def __init__(self, tokenizer, vocab_size: int):
        self.compiler = compiler_for(tokenizer)
        self.backend = self.compiler.backend
        self.words = (vocab_size + 31) // 32  # the model's vocab; padding ids stay 0 (forbidden)
        self.states: dict[str, _SeqState] = {}
        self.mask_seconds = 0.0
        self.mask_steps = 0
        self.mask_rows = 0
        self.mask_on = env_choice("JAXLLM_MASK_ON", MASK_ON[0], MASK_ON)
        self._mask_pool: ThreadPoolExecutor | None = None

    # -- sequences ---------------------------------------------------------------
    def submit(self, params: StructuredOutputsParams) -> Future:
        """Start (or find) the compile; raise at once if it is already known to fail."""
        fut = self.compiler.submit(params)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()
        return fut

    def add(self, seq_id: str, params: StructuredOutputsParams, future: Future) -> None:
        self.states[seq_id] = _SeqState(future, params.reasoning_end_ids)

    def remove(self, seq_id: str) -> None:
        self.states.pop(seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.states

    @staticmethod
    def ready(future: Future):
        """The scheduler's admission check: the grammar compiled (failures are aborted instead)."""
        return lambda: future.done() and future.exception() is None

    def failed(self) -> list[tuple[str, str]]:
        """(sequence id, reason) of sequences whose grammar failed to compile."""
        return [(sid, str(st.future.exception())) for sid, st in self.states.items()
                if st.matcher is None and st.future.done() and st.future.exception() is not None]

    def _matcher(self, st: _SeqState) -> Matcher:
        if st.matcher is None:
            st.matcher = st.future.result().matcher()
        return st.matcher

    def advance(self, seq_id: str, output_ids: list[int]) -> bool:
        """Feed the sequence's new output tokens; True when the grammar is complete (finish "stop")."""
        st = self.states.get(seq_id)
        if st is None or st.done:
            return False
        n = len(output_ids)
        if st.start is None:  # still reasoning: look for the end-of-reasoning sequence
            k = len(st.end_ids)
            for i in range(max(st.consumed, k - 1), n):
                if output_ids[i - k + 1:i + 1] == st.end_ids:
                    st.start = i + 1
                    break
        if n < st.consumed:  # tokens were taken back (rejected drafts): follow them
            if st.start is not None and st.consumed > st.start:
                self._matcher(st).rollback(st.consumed - max(n, st.start))
            if st.start is not None and n < st.start and st.end_ids:
                st.start = None
            st.consumed = n
        if st.start is not None:
            m = self._matcher(st)
            for t in output_ids[max(st.consumed, st.start):n]:
                if not m.accept(t):
                    log.warning("structured output of %s: the grammar rejected token %d (%s); "
                                "ending the sequence", seq_id, t, m.error())
                    st.done = True
                    return True
            if m.is_terminated():
                st.done = True
        st.consumed = n
        return st.done

    # -- the step's mask ---------------------------------------------------------
    def fill(self, rows: list[tuple[str, int]], num_rows: int) -> np.ndarray:
        """The packed [num_rows, words] int32 mask: all ones except the constrained rows."""
        return self.fill_job(rows, num_rows)()

    def fill_job(self, rows: list[tuple[str, int]], num_rows: int) -> Callable[[], np.ndarray]:
        """``fill`` in two parts: the all-ones mask and the live matchers now (the caller's
        thread), and a thunk that computes the constrained rows and returns the mask, for the
        thread that waits for it (the dispatch thread: there it is one GIL-free call)."""
        t0 = time.perf_counter()
        mask = np.full((num_rows, self.words), -1, np.int32)
        live = []
        for sid, row in rows:
            st = self.states.get(sid)
            if st is not None and not st.done and st.start is not None:
                live.append((self._matcher(st), row))
        compute = None
        if live:
            idx = np.fromiter((r for _, r in live), np.int64, len(live))
            mask[idx, self.backend.words:] = 0
            compute = self.backend.bitmask_job(live, mask)
        prepared = time.perf_counter() - t0

        def run() -> np.ndarray:
            t1 = time.perf_counter()
            if compute is not None:
                compute()
            self.mask_seconds += prepared + time.perf_counter() - t1
            self.mask_steps += 1
            self.mask_rows += len(live)
            return mask

        return run

    def hand_off(self, rows: list[tuple[str, int]], num_rows: int, future: Future) -> None:
        """Resolve ``future``, which the step's draw waits for, with a thunk returning its mask.

        The matchers are read now (they have seen every earlier token); the rows are computed
        by one GIL-free call where ``mask_on`` says: "thread" (a mask thread of the manager's, at
        once, beside the host's detokenizing and the dispatch thread's kernel launches),
        "dispatch" (by the thunk, on the dispatch thread, after it launched the forward pass)
        or "engine" (here, before the host goes on)."""
        job = self.fill_job(rows, num_rows)
        if self.mask_on == "dispatch":
            future.set_result(job)
        elif self.mask_on == "engine":
            mask = job()
            future.set_result(lambda: mask)
        else:
            if self._mask_pool is None:
                self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-mask")
            self._mask_pool.submit(_resolve, job, future)

    def stats(self) -> dict:
        steps = max(self.mask_steps, 1)
        return {"structured_mask_steps": self.mask_steps, "structured_mask_seconds": self.mask_seconds,
                "structured_mask_ms_per_step": 1e3 * self.mask_seconds / steps,
                "structured_rows_per_step": self.mask_rows / steps,
                "structured_compiles": self.compiler.num_compiles,
                "structured_compile_seconds": self.compiler.compile_seconds}


def _resolve(job: Callable[[], np.ndarray], future: Future) -> None:
    try:
        mask = job()
    except BaseException as exc:  # the draw waiting for it must not wait forever
        future.set_exception(exc)
        return
    future.set_result(lambda: mask)
