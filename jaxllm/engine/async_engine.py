"""Asyncio front of the engine core: one background step loop shared by every request.

`LLMEngine.step()` blocks (it runs jitted device code) and the engine is not
thread-safe, so exactly one thread -- the engine thread -- ever touches it (or
its tokenizer). The event loop talks to that thread through a command queue
(`call`), and the thread hands each step's outputs back in one
`loop.call_soon_threadsafe`. Each request's outputs go to a `RequestStream`.

Admission (`add_request`) is synchronous so the server can reject a request
(400 / 503) before it sends any response header.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Protocol, TypeVar

from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.outputs import RequestOutput
from jaxllm.engine.request_stream import RequestStream
from jaxllm.sampling_params import SamplingParams

log = logging.getLogger("jaxllm")
T = TypeVar("T")


class EngineOverloadedError(RuntimeError):
    """Admitting the request would exceed the waiting-request bound (server: 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; nothing more can be served."""


class StatObserver(Protocol):
    """Receives per-request timing as outputs are delivered (the server's Prometheus metrics)."""

    def on_request_added(self, num_prompt_tokens: int) -> None: ...
    def on_tokens(self, new_tokens: int, ttft: float | None, itl: float | None) -> None: ...
    def on_request_finished(self, e2e: float, finish_reason: str | None,
                            queue: float | None = None, prefill: float | None = None) -> None: ...


class AsyncLLM:
    """Serve many concurrent requests from one `LLMEngine` driven by one background thread."""

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 observer: StatObserver | None = None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._num_seqs = 0  # admitted, unfinished sequences (n counts n)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._stats: dict = engine.stats()
        self.dead: BaseException | None = None
        self._scorer = None

    @classmethod
    def from_config(cls, model: str | None = None, *, max_waiting_requests: int | None = None,
                    hf_config: dict | None = None, weights: Any = None, tokenizer: Any = None,
                    **engine_kwargs: Any) -> "AsyncLLM":
        """Build the engine from `EngineConfig` keyword arguments (vLLM names), then wrap it."""
        from jaxllm.config import EngineConfig
        cfg = EngineConfig(model=model, **engine_kwargs)
        eng = LLMEngine(cfg, hf_config=hf_config, weights=weights, tokenizer=tokenizer)
        return cls(eng, max_waiting_requests=max_waiting_requests)

    # -- properties the server reads ------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.cfg.max_num_seqs

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def stats(self) -> dict:
        """Engine stats as of the last step, plus the front's own request counts."""
        return dict(self._stats, num_unfinished_requests=len(self._streams),
                    num_unfinished_seqs=self._num_seqs)

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread, bound to the running event loop (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort everything and stop the engine thread."""
        if self._thread is None:
            return
        for s in list(self._streams.values()):
            s._fail(EngineDeadError("the engine is shutting down"))
        self._stop = True
        self._cmds.put(None)
        await asyncio.to_thread(self._thread.join, 30)
        self._thread = None

    # -- running work on the engine thread ------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between two steps and return its result.

        The one safe way to touch the engine (or its tokenizer) from the event loop.
        """
        self.start()
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        return await asyncio.wrap_future(fut)

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (strings are encoded on the engine thread: tokenizers are not thread-safe)."""
        if isinstance(prompt, str):
            return await self.call(lambda e: e.tokenize(prompt)[1])
        return self.engine.tokenize(prompt)[1]  # range check only: no tokenizer involved

    async def prompt_logprobs(self, token_ids: list[int], k: int) -> list:
        """Per-position prompt logprobs ([None, {id: Logprob}, ...]) by a separate forward."""
        return await self.call(lambda e: self._score(token_ids, k))

    def _score(self, token_ids: list[int], k: int) -> list:
        if self._scorer is None:
            from jaxllm.engine.prompt_logprobs import PromptScorer
            self._scorer = PromptScorer(self.engine)
        return self._scorer.score(token_ids, k)

    # -- admission ------------------------------------------------------------------
    def check_capacity(self, num_seqs: int) -> None:
        """Raise EngineOverloadedError if num_seqs more sequences would wait beyond the bound.

        "Waiting" = admitted sequences beyond the `max_num_seqs` that can run at
        once; counted here, on the event loop, so the answer is immediate and
        deterministic rather than one step stale.
        """
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead!r}")
        if self.max_waiting_requests is None:
            return
        waiting = self._num_seqs + num_seqs - self.max_num_seqs
        if waiting > self.max_waiting_requests:
            raise EngineOverloadedError(
                f"server overloaded: {self._num_seqs} sequences in flight, at most "
                f"{self.max_num_seqs} running + {self.max_waiting_requests} waiting")

    def add_request(self, request_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, *, prompt: str | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    check_capacity: bool = True, kv_transfer_params: dict | None = None) -> RequestStream:
        """Admit a tokenized request; raises ValueError (bad input) or EngineOverloadedError.

        Must be called on the event loop. Iterate the returned stream for outputs.
        """
        self.start()
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        ids = self.engine.tokenize(list(prompt_token_ids))[1]
        self.engine.validate(ids, params)
        if priority != 0 and getattr(self.engine.cfg, "scheduling_policy", "fcfs") != "priority":
            # Checked here, on the event loop, so the client gets a 400 rather than a failed stream.
            raise ValueError(f"got priority {priority} but priority scheduling is not enabled "
                             "(start the server with --scheduling-policy priority)")
        if check_capacity:
            self.check_capacity(params.n)
        stream = RequestStream(request_id, prompt, ids, params, self._abort)
        self._streams[request_id] = stream
        self._num_seqs += params.n
        if self.observer is not None:
            self.observer.on_request_added(len(ids))
        arrival = stream.arrival_time

        def add(e: LLMEngine) -> None:
            try:
                plp = self._score(ids, params.prompt_logprobs) if params.prompt_logprobs is not None else None
                stream.prompt_logprobs = plp
                e.add_request(request_id, ids, params, arrival_time=arrival, priority=priority,
                              cache_salt=cache_salt, kv_transfer_params=kv_transfer_params)
            except Exception as exc:  # bad input that slipped past validation
                self._loop.call_soon_threadsafe(self._finish_failed, request_id, exc)
        self._cmds.put((add, None))
        return stream

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       cache_salt: str | None = None, delta: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas by default, as vLLM's DELTA output kind).

        Leaving the `async for` early (break, cancellation, client gone) aborts
        the request and frees its blocks.
        """
        text = prompt if isinstance(prompt, str) else None
        ids = await self.tokenize(prompt)
        stream = self.add_request(request_id, ids, sampling_params, prompt=text,
                                  priority=priority, cache_salt=cache_salt)
        async for out in stream.outputs(delta=delta):
            yield out

    async def abort(self, request_id: str) -> None:
        """Abort a request by id; its stream ends with finish_reason "abort"."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._num_seqs -= stream.params.n
        self._cmds.put((lambda e: e.abort_request(request_id), None))
        if self.observer is not None:
            self.observer.on_request_finished(time.time() - stream.arrival_time, "abort")

    def _finish_failed(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._num_seqs -= stream.params.n
            stream.finished = True
            stream._fail(exc)

    # -- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as exc:  # the thread is gone: say so (/health -> 503) and fail everyone
            log.exception("engine thread died")
            self.dead = exc
            for rid in list(self._streams):
                self._loop.call_soon_threadsafe(self._finish_failed, rid, EngineDeadError(repr(exc)))

    def _loop_forever(self) -> None:
        eng = self.engine
        while not self._stop:
            try:
                if not eng.has_unfinished_requests():
                    self._exec(self._cmds.get())
                while True:
                    self._exec(self._cmds.get_nowait())
            except queue.Empty:
                pass
            if self._stop:
                break
            if not eng.has_unfinished_requests():
                self._stats = eng.stats()  # an abort freed blocks without a step
                continue
            try:
                outs = eng.step()
            except Exception as exc:  # a bug, not bad input: fail what is in flight, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                ids = list(eng.parents)
                try:
                    eng.abort_request(ids)
                except Exception:
                    log.exception("abort after a failed step failed too")
                for rid in ids:
                    self._loop.call_soon_threadsafe(self._finish_failed, rid, exc)
                outs = []
            self._stats = eng.stats()
            if outs:
                self._loop.call_soon_threadsafe(self._deliver, outs, time.time())
        self._stats = eng.stats()

    def _exec(self, cmd: tuple | None) -> None:
        if cmd is None:
            return
        fn, fut = cmd
        try:
            result = fn(self.engine)
        except BaseException as exc:
            if fut is None:
                log.exception("engine command failed")
            else:
                fut.set_exception(exc)
            return
        if fut is not None:
            fut.set_result(result)

    def _deliver(self, outs: list[RequestOutput], now: float) -> None:
        """On the event loop: hand each output to its stream and record timing."""
        obs = self.observer
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if stream.prompt_logprobs is not None:
                out.prompt_logprobs = stream.prompt_logprobs
            ntok = sum(len(c.token_ids) for c in out.outputs)
            if obs is not None and ntok > stream._num_tokens:
                first = stream._num_tokens == 0
                ttft = now - out.metrics.arrival_time if first else None
                itl = None if first else now - stream._last_token_time
                obs.on_tokens(ntok - stream._num_tokens, ttft, itl)
            if ntok > stream._num_tokens:
                stream._num_tokens, stream._last_token_time = ntok, now
            stream._put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._num_seqs -= stream.params.n
                if obs is not None:
                    m = out.metrics  # vLLM's split of the first token's wait: queued, then prefill
                    queue = m.first_scheduled_time - m.arrival_time if m.first_scheduled_time else None
                    prefill = m.first_token_time - m.first_scheduled_time \
                        if m.first_token_time and m.first_scheduled_time else None
                    obs.on_request_finished(now - m.arrival_time, out.outputs[0].finish_reason if out.outputs else None,
                                            queue, prefill)
