"""POST /v1/chat/completions: the model's chat template, n, logprobs, streaming.

The template is rendered and tokenized on the engine thread (the tokenizer is
shared with the step loop's detokenizer and is not thread-safe); a template
that rejects the conversation (e.g. raise_exception on bad role order) is a 400.
"""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxllm.outputs import CompletionOutput, Logprob
from jaxllm.server.protocol import APIError, ChatCompletionRequest
from jaxllm.server.serving import ServingBase, bad_request, merge_streams, new_id, now, sse, until_disconnect, usage


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(c: CompletionOutput, k: int) -> dict | None:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        chosen: Logprob = entry[tid]
        top = sorted((e for e in entry.values() if (e.rank or 0) <= k), key=lambda e: -e.logprob)[:k]
        item = _entry(chosen.decoded_token or "", chosen.logprob)
        item["top_logprobs"] = [_entry(e.decoded_token or "", e.logprob) for e in top]
        content.append(item)
    return {"content": content}


class ChatServing(ServingBase):
    async def render(self, req: ChatCompletionRequest) -> list[int]:
        """Token ids of the conversation under the model's chat template."""
        try:
            conv = req.conversation()
        except ValueError as exc:
            raise bad_request(exc) from None

        def work(engine) -> list[int]:
            tok = engine.tokenizer
            if tok is None or getattr(tok, "chat_template", True) is None:
                raise ValueError("this model has no chat template")
            return list(tok.apply_chat_template(conv, add_generation_prompt=req.add_generation_prompt,
                                                tokenize=True))
        try:
            return await self.engine.call(work)
        except Exception as exc:  # jinja errors, raise_exception(...) in the template
            raise APIError(400, f"chat template failed: {exc}", param="messages") from None

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        ids = await self.render(req)
        max_tokens = self.max_tokens(len(ids), req.max_completion_tokens or req.max_tokens)
        k = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = req.sampling_params(max_tokens, k)
        except ValueError as exc:
            raise bad_request(exc) from None
        rid = new_id("chatcmpl")
        streams = self.admit(rid, [(None, ids)], params, req.priority)
        if req.stream:
            return sse(self._stream(rid, req, len(ids), streams))
        return await until_disconnect(raw, self._full(rid, req, len(ids), streams))

    async def _full(self, rid: str, req: ChatCompletionRequest, prompt_tokens: int, streams: list) -> Response:
        final = None
        async for _, out in merge_streams(streams, delta=False):
            final = out
        k = req.top_logprobs or 0
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c, k), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in final.outputs]
        generated = sum(len(c.token_ids) for c in final.outputs)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now(), "model": self.model_name,
                             "choices": choices, "usage": usage(prompt_tokens, generated)})

    async def _stream(self, rid: str, req: ChatCompletionRequest, prompt_tokens: int,
                      streams: list) -> AsyncIterator[dict]:
        created, generated, k = now(), 0, req.top_logprobs or 0
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def chunk(choices: list, use: dict | None) -> dict:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": choices}
            if req.include_usage:
                body["usage"] = use
            return body

        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(req.n)], usage(prompt_tokens, 0) if continuous else None)
        async for _, out in merge_streams(streams, delta=True):
            choices = []
            for c in out.outputs:
                delta = {"content": c.text} if c.text or not c.finish_reason else {}
                choices.append({"index": c.index, "delta": delta, "logprobs": chat_logprobs(c, k),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                generated += len(c.token_ids)
            if choices:
                yield chunk(choices, usage(prompt_tokens, generated) if continuous else None)
        if req.include_usage:
            yield chunk([], usage(prompt_tokens, generated))
