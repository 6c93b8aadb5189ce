"""A step's device work (page moves, forward pass, draw), inline or on one dispatch thread.

Why a thread: XLA launches every kernel of the jitted step from the calling thread
(4-8 ms for the ~500 kernels of a Llama-3-8B step on an H200). Launched from here,
that runs beside the host reading the step before and scheduling the next (async
scheduling): on the H200 the step time then equals the GPU busy time
(docs/benchmarks.md, third round). One thread keeps the device work in submission
order, which the page moves and the donated KV pages rely on.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from jaxllm.engine.sampler import PendingSample, SampleRow
from jaxllm.runtime.scheduler import SchedulerOutput
from jaxllm.sampling_params import SamplingParams

PAD_ROW = SampleRow(SamplingParams(temperature=0.0), (), (), 0, None)  # a row that samples nothing


@dataclass
class Launched:
    """A step dispatched to the device whose sampled tokens the host has not read yet."""

    out: SchedulerOutput
    rows: list[SampleRow]  # one per logits row; PAD_ROW where the row samples nothing
    row_of: dict[str, int]  # sequence id -> its row in the step's sampled ids
    sample: Future | PendingSample | None  # a Future while the dispatch thread owns it
    mask: Future | None = None  # structured outputs: the draw's bitmask job, set by the host later
    # The mask was handed off (LLMEngine._fill_mask). Not `mask.done()`: on the mask thread the
    # Future resolves only once the mask is computed, and a second hand-off meanwhile would fill
    # the matchers again while the host advances them after the draw.
    mask_handed: bool = False
    num_rows: int = 0  # the draw's padded row count
    spec_rows: dict = field(default_factory=dict)  # request id -> rows verifying its drafts

    @functools.cached_property
    def overlappable(self) -> bool:
        """Can the next step be scheduled before this one's tokens are known?

        Not when it forks n > 1 siblings (they join the running set only on
        update) or a row has penalties (the next draw needs every earlier token).
        (Asked twice a step: once when launched, once before the next; rows are fixed by then.)
        """
        return not any(s.fork_ids for s in self.out.scheduled) and not any(
            r.params.has_penalties for r in self.rows if r is not PAD_ROW)

    def result(self) -> PendingSample:
        return resolved(self.sample)


def resolved(sample: Future | PendingSample) -> PendingSample:
    return sample.result() if isinstance(sample, Future) else sample


class Dispatcher:
    def __init__(self, runner, kv_ops, sampler, threaded: bool, connector=None):
        self.runner, self.kv_ops, self.sampler = runner, kv_ops, sampler
        self.connector = connector  # worker side of the KV connector, or None
        self._pool = None
        self._last: Future | None = None  # the latest work queued on the thread
        self.threaded = threaded
        # A speculative proposer with KV of its own (jaxllm/spec: a draft model): it sees
        # each step's page moves (`on_kv_ops(out)`) and batch (`after_forward(out, hb, prev_ids)`).
        self.spec_hook = None

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    @threaded.setter
    def threaded(self, on: bool) -> None:
        if on and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-step")
        elif not on and self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._last = None, None

    def drain(self) -> None:
        """Wait for the work submitted so far."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def submit(self, out: SchedulerOutput, hb=None, sbatch=None,
               prev: Future | PendingSample | None = None,
               mask: Future | None = None, sampler=None,
               inline: bool = False) -> Future | PendingSample | None:
        """Queue the step's device work; `prev` is the step before's draw (placeholders);
        `mask` a Future of the structured-outputs bitmask job, which the draw waits for and runs;
        `sampler`: draws instead of the engine's sampler (speculative verification).
        `inline`: a step the host reads at once (synchronous) runs on the calling thread when
        the thread has nothing queued, saving the two thread hand-offs."""
        if self._pool is None or (inline and (self._last is None or self._last.done())):
            return self._run(out, hb, sbatch, prev, mask, sampler)
        self._last = self._pool.submit(self._run, out, hb, sbatch, prev, mask, sampler)
        return self._last

    def _run(self, out, hb, sbatch, prev, mask=None, sampler=None) -> PendingSample | None:
        """In order: page moves, forward pass, draw. Nothing here waits for the device; a
        constrained draw waits for its mask, which the host fills while the forward pass runs."""
        self._kv_ops(out)
        if hb is None:
            return None
        prev_ids = None
        if hb.prev_index is not None and (hb.prev_index != -1).any():
            prev_ids = resolved(prev).token_ids  # submitted earlier on this thread: done
        logits, greedy_ids = self.runner.execute(hb, prev_ids)
        if self.spec_hook is not None:
            self.spec_hook.after_forward(out, hb, prev_ids)
        if mask is not None:  # a job that computes the bitmask here (LLMEngine._fill_mask)
            sbatch.bitmask = mask.result()()
        return (sampler or self.sampler).launch(logits, sbatch, greedy_ids)

    def _kv_ops(self, out: SchedulerOutput) -> None:
        """Connector loads found done, connector saves, swap-outs, copy-on-write copies,
        swap-ins, connector loads: before the forward, in this order (the blocks of loads
        that were in flight, which no other move touches; reads of the pages as they were;
        then writes)."""
        if not out.has_kv_ops:
            return
        runner, conn, meta = self.runner, self.connector, out.kv_connector_metadata
        if out.copies and runner.channel is not None:
            runner.channel.send_copies(out.copies)  # followers hold the other KV heads
        pages = runner.kv_pages
        if meta is not None:
            pages = conn.finish_load_kv(pages, meta)
            conn.save_kv_layer(None, pages, meta)
        self.kv_ops.swap_out(pages, out.swap_out)
        pages = self.kv_ops.copy(pages, out.copies)
        pages = self.kv_ops.swap_in(pages, out.swap_in)
        if meta is not None:
            pages = conn.start_load_kv(pages, meta)
            conn.wait_for_layer_load(None)
            conn.wait_for_save()
        runner.kv_pages = pages
        if self.spec_hook is not None:
            self.spec_hook.on_kv_ops(out)
