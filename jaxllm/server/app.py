"""The FastAPI app: routes, API-key check, and error handlers that keep the server up.

Every failure becomes an OpenAI-shaped JSON error ({"error": {message, type,
param, code}}): validation and malformed JSON are 400 (FastAPI's default would
be 422, which OpenAI clients do not expect), unknown routes 404, a body over the
limit 413, an overloaded engine 503, and anything unexpected a logged 500 -- never a
dead process. `/openapi.json` documents exactly these (see `openapi.py`).
"""

from __future__ import annotations

import logging
import secrets
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

import jaxllm
from jaxllm.engine.async_engine import AsyncLLM, EngineDeadError
from jaxllm.server.chat_protocol import ChatCompletionRequest, TokenizeChatRequest
from jaxllm.server.fields import reason_for
from jaxllm.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxllm.server.openapi import STREAMED, BodyLimit, build_openapi, responses
from jaxllm.server.protocol import (APIError, CompletionRequest, DetokenizeRequest, TokenizeCompletionRequest,
                                    error_body)
from jaxllm.server.serving_chat import ChatServing
from jaxllm.server.serving_completion import CompletionServing

log = logging.getLogger("jaxllm")


MAX_REQUEST_BYTES = 32 * 2 ** 20


def _validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param): each error with the dotted field it is about; refused fields say why."""
    parts, param = [], None
    for err in exc.errors()[:5]:
        loc = tuple(x for x in err.get("loc", ()) if x != "body")
        where = ".".join(str(x) for x in loc)
        reason = reason_for(loc)
        param = param or (str(loc[0]) if reason and loc else where) or None
        parts.append(reason or (f"{where}: {err.get('msg')}" if where else str(err.get("msg"))))
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


def build_app(engine: AsyncLLM, model_names: list[str], api_key: str | None = None, *,
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
              reasoning_parser: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """An OpenAI-compatible app over a (not yet started) AsyncLLM.

    `app.state.api_key` may be changed at run time; None disables the check. Tool calling with
    tool_choice "auto" needs `enable_auto_tool_choice` and a `tool_call_parser` (vLLM's flags);
    `reasoning_parser` splits `<think>` sections into `reasoning_content`.
    """
    from jaxllm.server.reasoning import get_reasoning_parser
    from jaxllm.server.tool_parsers import get_tool_parser

    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser NAME)")
    metrics = ServerMetrics(model_names[0])
    engine.observer = metrics
    completions = CompletionServing(engine, model_names, metrics)
    chat = ChatServing(engine, model_names, metrics,
                       tool_parser=get_tool_parser(tool_call_parser) if tool_call_parser else None,
                       auto_tools=enable_auto_tool_choice,
                       reasoning_parser=get_reasoning_parser(reasoning_parser) if reasoning_parser else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        await engine.prompt_logprobs([0, 0], 1)  # compile the scorer now, not on the first echo request
        yield
        await engine.shutdown()

    app = FastAPI(title="jaxllm OpenAI-compatible server", version=jaxllm.__version__, lifespan=lifespan)
    app.state.api_key = api_key
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.chat = chat
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    auth_paths = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
                  "/tokenizer_info"}

    def limits() -> dict:
        eng, template = engine.engine, getattr(engine.tokenizer, "chat_template", None) or ""
        return {"vocab_size": eng.model_cfg.vocab_size, "max_num_seqs": engine.max_num_seqs,
                "max_model_len": engine.max_model_len,
                "priority": eng.cfg.scheduling_policy == "priority", "reasoning_effort": "reasoning_effort" in template}
    app.openapi = lambda: build_openapi(app, auth_paths, limits())

    async def check_key(request: Request) -> None:
        key = request.app.state.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect or missing API key.", "authentication_error", None, "invalid_api_key")

    auth = [Depends(check_key)]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status,
                            headers={"Retry-After": "1"} if exc.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_error(exc)
        body = error_body(400, message)
        body["error"]["param"] = param
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ValidationError)
    async def _invalid_inner(_: Request, exc: ValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(503, str(exc)), status_code=503)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request")
        return JSONResponse(error_body(500, f"internal error: {exc!r}"), status_code=500)

    gen = responses(400, 401, 404, 413, 500, 503, ok={"description": "the completion", "content": STREAMED})
    plain = responses(400, 401, 404, 413, 500)

    @app.post("/v1/completions", dependencies=auth, responses=gen)
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions", dependencies=auth, responses=gen)
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)

    @app.get("/v1/models", dependencies=auth, responses=responses(401))
    async def list_models() -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "jaxllm", "root": model_names[0],
             "parent": None, "max_model_len": engine.max_model_len} for name in model_names]}

    @app.get("/health", response_class=Response, responses=responses(503, ok={
        "description": "the engine is running (empty body)", "content": {}}))
    async def health() -> Response:
        if engine.dead is not None:
            return JSONResponse(error_body(503, f"engine stopped: {engine.dead!r}"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": jaxllm.__version__}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(engine.stats()), media_type=CONTENT_TYPE)

    @app.post("/tokenize", dependencies=auth, responses=plain)
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        completions.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            _, ids = await chat.render(ChatCompletionRequest(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs))
        else:
            text, special = req.prompt, req.add_special_tokens
            ids = await engine.call(lambda e: list(e.tokenizer.encode(text, add_special_tokens=special)))
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if req.return_token_strs:
            out["token_strs"] = await engine.call(lambda e: list(e.tokenizer.convert_ids_to_tokens(ids)))
        return out

    @app.get("/tokenizer_info", dependencies=auth, responses=responses(401))
    async def tokenizer_info() -> dict:
        """vLLM's endpoint: lets lm-eval's `tokenizer_backend=remote` use this server's tokenizer."""
        tok = engine.tokenizer
        info = {name: getattr(tok, name, None) for name in
                ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template")}
        return dict(info, tokenizer_class="PreTrainedTokenizerFast", model_max_length=engine.max_model_len,
                    vocab_size=getattr(tok, "vocab_size", None))

    @app.post("/detokenize", dependencies=auth, responses=plain)
    async def detokenize(req: DetokenizeRequest) -> dict:
        completions.check_model(req.model)
        try:
            engine.engine.tokenize(req.tokens)  # range check
        except ValueError as exc:
            raise APIError(400, str(exc), param="tokens") from None
        return {"prompt": await completions.decode(req.tokens)}

    return app
