"""One request's output stream: newest-output mailbox, deltas, abort on early exit.

Lives beside the server because the server is its main consumer, but it is the
`AsyncLLM` API: `add_request` returns one. The engine thread's delivery (run on
the event loop) only ever replaces `_latest`; the consumer turns cumulative
outputs into deltas against what it has already yielded, so a slow consumer
skips states instead of queueing them, and no delta is ever lost or merged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator, Callable

from jaxllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxllm.sampling_params import SamplingParams


@dataclasses.dataclass
class _Progress:
    """What the consumer of a stream has already yielded, per completion index."""

    text: dict[int, int] = dataclasses.field(default_factory=dict)
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    finished: set = dataclasses.field(default_factory=set)


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    """Copy whose logprobs list cannot grow under us (the engine thread appends to the original)."""
    lps = None if c.logprobs is None else c.logprobs[:len(c.token_ids)]
    return dataclasses.replace(c, logprobs=lps)


class RequestStream:
    """The outputs of one admitted request, consumed with `async for` on the event loop."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, on_abort: Callable[[str], None]):
        self._on_abort = on_abort
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.finished = False
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self.arrival_time = time.time()
        self.prompt_logprobs: list | None = None  # set on the engine thread before the request runs
        self._last_token_time = self.arrival_time
        self._num_tokens = 0
        self._last: RequestOutput | None = None  # newest cumulative output seen by the consumer

    # -- called on the event loop by the engine's delivery -------------------
    def _put(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    # -- consumer side ----------------------------------------------------------
    def abort(self) -> None:
        """Stop generating (idempotent); the engine frees the request's KV blocks.

        A consumer still iterating gets one last output whose unfinished
        completions carry finish_reason "abort".
        """
        if self.finished:
            return
        self.finished = True
        self._on_abort(self.request_id)
        last = self._latest or self._last
        outs = [] if last is None else [
            c if c.finish_reason else dataclasses.replace(c, finish_reason="abort") for c in last.outputs]
        self._latest = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, True,
                                     last.metrics if last else RequestMetrics(self.arrival_time))
        self._event.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self.outputs()

    async def outputs(self, delta: bool = False) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes; abort it if the consumer leaves early.

        delta=False: cumulative outputs, as `LLMEngine.step` returns them.
        delta=True: each completion carries only new text/tokens/logprobs and
        appears only when it has something new (or just finished). Text that
        could still turn out to be the start of a stop string is held back.
        """
        progress = _Progress()
        try:
            while True:
                await self._event.wait()
                self._event.clear()
                if self._error is not None:
                    self.finished = True
                    raise self._error
                out, self._latest = self._latest, None
                if out is None:
                    continue
                out = self._prepare(out)
                self._last = out
                if out.finished:
                    self.finished = True
                yield self._delta(out, progress) if delta else out
                if out.finished:
                    return
        finally:
            self.abort()

    def _prepare(self, out: RequestOutput) -> RequestOutput:
        outs = [_snapshot(c) for c in out.outputs]
        return dataclasses.replace(out, prompt=self.prompt, outputs=outs,
                                   prompt_logprobs=out.prompt_logprobs)

    def _delta(self, out: RequestOutput, p: _Progress) -> RequestOutput:
        outs = []
        for c in out.outputs:
            done = c.finish_reason is not None
            keep = len(c.text) if done else max(len(c.text) - self._holdback, 0)
            t0, k0 = p.text.get(c.index, 0), p.tokens.get(c.index, 0)
            keep = max(keep, t0)
            newly_done = done and c.index not in p.finished
            if keep == t0 and len(c.token_ids) == k0 and not newly_done:
                continue
            p.text[c.index], p.tokens[c.index] = keep, len(c.token_ids)
            if done:
                p.finished.add(c.index)
            outs.append(dataclasses.replace(
                c, text=c.text[t0:keep], token_ids=c.token_ids[k0:],
                logprobs=None if c.logprobs is None else c.logprobs[k0:]))
        return dataclasses.replace(out, outputs=outs)
