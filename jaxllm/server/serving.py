"""What /v1/completions and /v1/chat/completions share: admission, merging, SSE, disconnects.

Every request is checked completely (model, tokens, lengths, sampling
parameters, capacity) before any sequence is admitted, so a bad or refused
request never leaves half a batch in the engine. Once admitted, sequences are
always aborted when their consumer goes away -- a finished response, a client
that disconnects mid-stream, or one that disconnects while waiting for a
non-streamed answer -- so their KV blocks return to the pool at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxllm.engine.async_engine import AsyncLLM, EngineDeadError, EngineOverloadedError
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.server.protocol import APIError
from jaxllm.engine.request_stream import RequestStream


TOOL_WHITESPACE = r"[ ]?"  # the JSON whitespace tool_choice "required" / a named function allows


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def bad_request(exc: Exception) -> APIError:
    return APIError(400, str(exc) or type(exc).__name__)


async def merge_streams(streams: list[RequestStream], delta: bool) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output); aborts all on early exit."""
    if len(streams) == 1:
        try:
            async for out in streams[0].outputs(delta=delta):
                yield 0, out
        finally:
            streams[0].abort()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s.outputs(delta=delta):
                q.put_nowait((i, out, None))
        except Exception as exc:  # delivered to the consumer, re-raised there
            q.put_nowait((i, None, exc))
        finally:
            q.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(streams)
    try:
        while live:
            i, out, exc = await q.get()
            if exc is not None:
                raise exc
            if out is None:
                live -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run work, cancelling it (and so aborting its sequences) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return Response(status_code=499)  # nobody is listening; nginx's "client closed request"


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """OpenAI server-sent events: one `data: {json}` per chunk, an error event if it fails, `[DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:  # the response has started: report in-band, keep the server up
            yield f"data: {json.dumps(APIError(500, repr(exc), 'server_error').body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class ServingBase:
    """Model-name check, tokenization, length limits and admission for the OpenAI endpoints."""

    def __init__(self, engine: AsyncLLM, model_names: list[str], metrics: Any = None) -> None:
        self.engine = engine
        self.model_names = model_names
        self.metrics = metrics

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "not_found_error", "model",
                           "model_not_found")

    async def tokens(self, prompt: str | list[int]) -> list[int]:
        try:
            return await self.engine.tokenize(prompt)
        except ValueError as exc:
            raise bad_request(exc) from None

    async def constraint(self, req: Any, think_end: str | None = None, tool_schema: dict | None = None,
                         tool_choice: str | None = None) -> Any:
        """The request's StructuredOutputsParams (None when unconstrained), compiled once up front so a
        bad schema, regex or grammar is a 400 with the compiler's reason; the grammar stays cached.

        `think_end`: the reasoning parser's end marker; the constraint applies after it.
        `tool_schema`: the JSON schema tool_choice "required" / a named function imposes.
        """
        try:
            found = req.constraint_kwargs()
        except ValueError as exc:
            raise bad_request(exc) from None
        if tool_schema is not None:
            if found is not None:
                raise APIError(400, f"{found[0]} cannot be combined with tool_choice {tool_choice!r}",
                               param=found[0])
            # Arguments are re-serialized, so their layout is free: at most one space between tokens
            # (runaway whitespace cannot eat the token budget), unless the request says otherwise.
            found = ("tools", {"json": tool_schema, "whitespace_pattern": TOOL_WHITESPACE, **req.whitespace()})
        if found is None:
            if req.whitespace():
                raise APIError(400, "whitespace options need a JSON constraint (response_format, "
                                    "structured_outputs.json or guided_json)", param="structured_outputs")
            return None
        from jaxllm.sampling_params import StructuredOutputsParams
        from jaxllm.structured import built_compiler, compiler_for, validate

        source, kw = found
        if think_end is not None:
            kw["reasoning_end_ids"] = await self.engine.call(
                lambda e: list(e.tokenizer.encode(think_end, add_special_tokens=False)))
        try:
            params = StructuredOutputsParams(**kw)
            tok = self.engine.tokenizer
            compiler = built_compiler(tok)  # the server builds it at start-up
            if compiler is None:  # built once, on the tokenizer's thread
                compiler = await self.engine.call(lambda e: compiler_for(e.tokenizer))
            if compiler.submit(params).done():  # cached: no hop to the engine's loop or a thread, which
                validate(params, tok)  # under a burst of requests delayed each by a step (~50 ms)
            else:
                await asyncio.to_thread(validate, params, tok)
        except ValueError as exc:
            raise APIError(400, f"{source}: {exc}", param=source) from None
        return params

    async def decode(self, ids: list[int]) -> str:
        return await self.engine.call(lambda e: e.tokenizer.decode(ids, skip_special_tokens=False))

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """Tokens to generate; 400 (vLLM's wording) when prompt + completion exceed the context."""
        limit = self.engine.max_model_len
        if prompt_len > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                f"prompt has {prompt_len} tokens.", param="prompt")
        if requested is None:
            if prompt_len >= limit:
                raise APIError(400, f"The prompt ({prompt_len} tokens) leaves no room to generate in the "
                                    f"model's maximum context length of {limit} tokens.")
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
                                f"{requested} in the completion). Please reduce the length of the "
                                f"messages or completion.", param="max_tokens")
        return requested

    def admit(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
              params: SamplingParams, priority: int = 0,
              kv_transfer_params: dict | None = None) -> list[RequestStream]:
        """Admit one sequence group per prompt, all or none; 400 / 503 on failure."""
        if params.n > self.engine.max_num_seqs:
            raise APIError(400, f"n={params.n} exceeds max_num_seqs={self.engine.max_num_seqs}", param="n")
        try:
            self.engine.check_capacity(params.n * len(prompts))
        except EngineOverloadedError as exc:
            if self.metrics is not None:
                self.metrics.rejected.inc()
            raise APIError(503, str(exc), "server_overloaded") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error") from None
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.add_request(rid, ids, params, prompt=text, priority=priority,
                                                       check_capacity=False,
                                                       kv_transfer_params=kv_transfer_params))
        except ValueError as exc:
            for s in streams:
                s.abort()
            raise bad_request(exc) from None
        return streams


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())
