"""POST /v1/completions: text or token prompts, batches, n, echo, logprobs, streaming.

`echo` with `logprobs` returns the prompt's own token logprobs (first token:
null), which is how lm-evaluation-harness scores log-likelihood tasks; with
`max_tokens=0` nothing is generated and only the prompt is scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxllm.outputs import CompletionOutput, Logprob
from jaxllm.server.fields import log_ignored
from jaxllm.server.protocol import APIError, CompletionRequest
from jaxllm.server.serving import ServingBase, bad_request, merge_streams, new_id, now, sse, until_disconnect, usage


@dataclass
class _Prompt:
    text: str | None  # for echo (decoded when the prompt came as token ids)
    ids: list[int]
    first_token: str | None = None  # text of ids[0]: its logprob entry is null, so it carries none


class _Choice:
    """One choice's running state: whether the prompt was echoed yet, and its text offset."""

    def __init__(self, req: CompletionRequest, prompt: _Prompt) -> None:
        self.req, self.prompt = req, prompt
        self.started = False
        self.offset = 0

    def _block(self, token_ids: list[int], entries: list[dict[int, Logprob] | None]) -> dict:
        k = self.req.logprobs or 0
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, entries):
            if entry is None:  # the prompt's first token
                text, lp, top = self.prompt.first_token or "", None, None
            else:
                chosen = entry[tid]
                text, lp, top = chosen.decoded_token or "", chosen.logprob, {}
                for t, e in sorted(entry.items(), key=lambda kv: -kv[1].logprob):
                    if t == tid or (e.rank or 0) <= k:
                        top.setdefault(e.decoded_token or "", e.logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def render(self, index: int, c: CompletionOutput, prompt_logprobs: list | None) -> dict:
        """The OpenAI choice for this (delta or final) output; the first call carries the echo."""
        text, blocks = c.text, []
        want_lp = self.req.logprobs is not None
        if self.req.echo and not self.started:
            text = (self.prompt.text or "") + text
            if want_lp:
                ids = self.prompt.ids
                blocks.append(self._block(ids, prompt_logprobs or [None] * len(ids)))
        self.started = True
        if want_lp and c.logprobs is not None:
            blocks.append(self._block(c.token_ids, c.logprobs))
        block = None
        if blocks:
            block = {key: sum((b[key] for b in blocks), []) for key in blocks[0]}
        return {"index": index, "text": text, "logprobs": block, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


class CompletionServing(ServingBase):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        log_ignored(req)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
        p = req.prompt
        batch: list = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not batch:
            raise APIError(400, "prompt must not be empty", param="prompt")
        echo_lp = req.echo and req.logprobs is not None
        prompts = []
        for item in batch:
            ids = await self.tokens(item)
            text = item if isinstance(item, str) else (await self.decode(ids) if req.echo else None)
            first = await self.decode(ids[:1]) if echo_lp and ids else None
            prompts.append(_Prompt(text, ids, first))
            self.max_tokens(len(ids), req.max_tokens)  # 400 when the prompt leaves too little room
        score_only = req.max_tokens == 0
        structured = None if score_only else await self.constraint(req)
        try:  # max_tokens=None: each prompt may use all of its own room (the engine's default)
            params = req.sampling_params(1 if score_only else req.max_tokens, req.logprobs,
                                         req.logprobs if req.echo else None, structured=structured)
        except ValueError as exc:
            raise bad_request(exc) from None
        rid = new_id("cmpl")
        if score_only:
            return await self._score(rid, req, prompts)
        streams = self.admit(rid, [(q.text, q.ids) for q in prompts], params, req.priority,
                             req.kv_transfer_params)
        if req.stream:
            return sse(self._stream(rid, req, prompts, streams))
        return await until_disconnect(raw, self._full(rid, req, prompts, streams))

    def _body(self, rid: str, created: int, choices: list, use: dict | None, with_usage: bool) -> dict:
        body = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices}
        if with_usage:
            body["usage"] = use
        return body

    async def _full(self, rid: str, req: CompletionRequest, prompts: list[_Prompt], streams: list) -> Response:
        finals = {}
        async for i, out in merge_streams(streams, delta=False):
            finals[i] = out
        choices, generated = [], 0
        for i, prompt in enumerate(prompts):
            out = finals[i]
            for c in out.outputs:
                choices.append(_Choice(req, prompt).render(i * req.n + c.index, c, out.prompt_logprobs))
                generated += len(c.token_ids)
        prompt_tokens = sum(len(q.ids) for q in prompts)
        body = self._body(rid, now(), choices, usage(prompt_tokens, generated), True)
        if req.kv_transfer_params is not None:
            body["kv_transfer_params"] = finals[0].kv_transfer_params or None
        return JSONResponse(body)

    async def _stream(self, rid: str, req: CompletionRequest, prompts: list[_Prompt],
                      streams: list) -> AsyncIterator[dict]:
        created, generated = now(), 0
        prompt_tokens = sum(len(q.ids) for q in prompts)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        states: dict[int, _Choice] = {}
        async for i, out in merge_streams(streams, delta=True):
            choices = []
            for c in out.outputs:
                index = i * req.n + c.index
                state = states.setdefault(index, _Choice(req, prompts[i]))
                choices.append(state.render(index, c, out.prompt_logprobs))
                generated += len(c.token_ids)
            if choices:
                use = usage(prompt_tokens, generated) if continuous else None
                yield self._body(rid, created, choices, use, req.include_usage)
        if req.include_usage:
            yield self._body(rid, created, [], usage(prompt_tokens, generated), True)

    async def _score(self, rid: str, req: CompletionRequest, prompts: list[_Prompt]) -> Response:
        """max_tokens=0 with echo: return the prompts (and their logprobs) without generating."""
        choices = []
        for i, prompt in enumerate(prompts):
            plp = None if req.logprobs is None else await self.engine.prompt_logprobs(prompt.ids, req.logprobs)
            for j in range(req.n):
                c = CompletionOutput(index=j, text="", token_ids=[], finish_reason="length")
                choices.append(_Choice(req, prompt).render(i * req.n + j, c, plp))
        use = usage(sum(len(q.ids) for q in prompts), 0)
        if not req.stream:
            return JSONResponse(self._body(rid, now(), choices, use, True))

        async def once() -> AsyncIterator[dict]:
            yield self._body(rid, now(), choices, None, req.include_usage)
            if req.include_usage:
                yield self._body(rid, now(), [], use, True)
        return sse(once())
