"""POST /v1/chat/completions: chat template (with tools), n, logprobs, tool calls, reasoning, streaming.

The template is rendered and tokenized on the engine thread (the tokenizer is
shared with the step loop's detokenizer and is not thread-safe); a template
that rejects the conversation (e.g. raise_exception on bad role order) is a 400.
Each choice's text goes through `chat_output.ChoiceText` (reasoning split, tool
calls), whole or as deltas.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxllm.outputs import CompletionOutput, Logprob
from jaxllm.server import tool_calls
from jaxllm.server.chat_output import ChoiceText
from jaxllm.server.chat_protocol import ChatCompletionRequest
from jaxllm.server.fields import log_ignored
from jaxllm.server.protocol import APIError
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


def _cut_after_final(text: str, final: str) -> str:
    """continue_final_message: the rendered prompt ends where the last message's text ends."""
    for needle in (final, final.strip()):
        if needle and needle in text:
            return text[:text.rindex(needle) + len(needle)]
    raise ValueError("continue_final_message: the final message's text does not appear in the rendered chat")


class ChatServing(ServingBase):
    """`tool_parser` / `reasoning_parser`: the server's `--tool-call-parser` / `--reasoning-parser`
    objects (None when not set); "auto" tool choice needs `auto_tools` and a tool parser."""

    def __init__(self, *args: Any, tool_parser: Any = None, auto_tools: bool = False,
                 reasoning_parser: Any = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tool_parser, self.auto_tools, self.reasoning_parser = tool_parser, auto_tools, reasoning_parser

    async def render(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The conversation under the model's chat template: (text, token ids)."""
        conv = req.conversation()
        extra = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            extra["reasoning_effort"] = req.reasoning_effort
        cont = req.continue_final_message
        if cont and not conv[-1]["content"].strip():
            raise APIError(400, "continue_final_message needs a final message with text", param="messages")

        def work(engine) -> tuple[str, list[int]]:
            tok = engine.tokenizer
            if tok is None or getattr(tok, "chat_template", True) is None:
                raise ValueError("this model has no chat template")
            if req.reasoning_effort is not None and "reasoning_effort" not in tok.chat_template:
                raise LookupError("reasoning_effort: this model's chat template does not take it")
            text = tok.apply_chat_template(conv, add_generation_prompt=req.add_generation_prompt and not cont,
                                           tokenize=False, tools=req.tool_dicts(), **extra)
            if cont:
                text = _cut_after_final(text, conv[-1]["content"])
            return text, list(tok.encode(text, add_special_tokens=False))
        try:
            return await self.engine.call(work)
        except LookupError as exc:
            raise APIError(400, str(exc).strip("'\""), param="reasoning_effort") from None
        except Exception as exc:  # jinja errors, raise_exception(...) in the template
            raise APIError(400, f"chat template failed: {exc}", param="messages") from None

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        log_ignored(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        mode = tool_calls.resolve(req, self.auto_tools and self.tool_parser is not None)
        tool_schema = tool_calls.json_schema(req, mode)
        text, ids = await self.render(req)
        max_tokens = self.max_tokens(len(ids), req.max_completion_tokens or req.max_tokens)
        rp = self.reasoning_parser
        think_end = rp.end if rp is not None and rp.expects_reasoning(text) else None
        structured = await self.constraint(req, think_end, tool_schema, mode.kind)
        k = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = req.sampling_params(max_tokens, k, structured=structured)
        except ValueError as exc:
            raise bad_request(exc) from None
        eos_text = None
        if mode.kind == "auto" and not self.tool_parser.skip_special_tokens:
            params.skip_special_tokens = False  # the parser's markers are special tokens
            eos_text = getattr(self.engine.tokenizer, "eos_token", None)
        rid = new_id("chatcmpl")
        streams = self.admit(rid, [(None, ids)], params, req.priority, req.kv_transfer_params)
        starts_open = rp.starts_open(text) if rp is not None else False

        def reader() -> ChoiceText:
            return ChoiceText(mode, self.tool_parser, rp, starts_open, eos_text)
        if req.stream:
            return sse(self._stream(rid, req, len(ids), streams, reader))
        return await until_disconnect(raw, self._full(rid, req, len(ids), streams, reader))

    async def _full(self, rid: str, req: ChatCompletionRequest, prompt_tokens: int, streams: list,
                    reader) -> Response:
        final = None
        async for _, out in merge_streams(streams, delta=False):
            final = out
        k = req.top_logprobs or 0
        choices = []
        for c in final.outputs:
            r = reader()
            message = r.message(c.text)
            finish = c.finish_reason
            if "tool_calls" in message and finish == "stop" and r.tools_called(r.view(c.text, True)):
                finish = "tool_calls"
            choices.append({"index": c.index, "message": message, "logprobs": chat_logprobs(c, k),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        generated = sum(len(c.token_ids) for c in final.outputs)
        body = {"id": rid, "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": usage(prompt_tokens, generated)}
        if req.kv_transfer_params is not None:
            body["kv_transfer_params"] = final.kv_transfer_params or None
        return JSONResponse(body)

    async def _stream(self, rid: str, req: ChatCompletionRequest, prompt_tokens: int,
                      streams: list, reader) -> AsyncIterator[dict]:
        created, generated, k = now(), 0, req.top_logprobs or 0
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        readers = [reader() for _ in range(req.n)]
        texts = [""] * req.n

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
                texts[c.index] += c.text
                done = c.finish_reason is not None
                r = readers[c.index]
                delta, view = r.delta(texts[c.index], final=done)
                finish = c.finish_reason
                if finish == "stop" and r.tools_called(view):
                    finish = "tool_calls"
                if delta or done or c.logprobs:
                    choices.append({"index": c.index, "delta": delta, "logprobs": chat_logprobs(c, k),
                                    "finish_reason": finish, "stop_reason": c.stop_reason})
                generated += len(c.token_ids)
            if choices:
                yield chunk(choices, usage(prompt_tokens, generated) if continuous else None)
        if req.include_usage:
            yield chunk([], usage(prompt_tokens, generated))
