"""A published schema that tells the truth: every status the server answers, every media type.

Routes declare their answers with `responses(...)`; `build_openapi` then removes what
FastAPI adds on its own but the server never answers (422: validation errors are 400
here), declares the bearer scheme only while an API key is set, and writes the running
server's limits into the fields tagged `x-bound` (token ids below the vocabulary size,
`n` up to --max-num-seqs, max_tokens up to the context length, `priority` only with priority scheduling, `reasoning_effort`
only for a chat template that takes it).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from jaxllm.server.protocol import ErrorResponse

_WHY = {
    400: "Invalid request: malformed JSON, a field out of range, or a request the engine cannot run "
         "(the message names the field)",
    401: "Missing or wrong API key (only while the server has one)",
    404: "Unknown model",
    413: "Request body over the server's limit",
    500: "Unexpected server error (the server keeps running)",
    503: "Overloaded (Retry-After: 1) or the engine stopped",
}

# 200 of the generating routes: JSON, or with stream=true server-sent events (`data: {chunk}`
# events, then `data: [DONE]`), whose chunks a JSON schema of the body cannot describe.
STREAMED = {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}}


def responses(*statuses: int, ok: dict | None = None) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for a route: its error statuses with the OpenAI error body."""
    out: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}
    if ok is not None:
        out[200] = ok
    return out


def _ints(node: dict) -> list[dict]:
    """The integer schemas of a field: itself, or its anyOf members."""
    return [node] if node.get("type") == "integer" else [n for n in node.get("anyOf", []) if n.get("type") == "integer"]


def _bound(node: Any, limits: dict[str, Any]) -> None:
    """Write the server's limits into every `x-bound` field below `node`."""
    if isinstance(node, list):
        for n in node:
            _bound(n, limits)
        return
    if not isinstance(node, dict):
        return
    tag = node.get("x-bound")
    if tag == "vocab":
        for n in _ints(node):
            n["maximum"] = limits["vocab_size"] - 1
    elif tag in ("max_num_seqs", "max_model_len"):
        for n in _ints(node):
            n["maximum"] = min(n.get("maximum", limits[tag]), limits[tag])
    elif tag == "priority" and not limits["priority"]:
        for n in _ints(node):
            n["minimum"] = n["maximum"] = 0
    elif tag == "reasoning_effort" and not limits["reasoning_effort"]:
        node.pop("anyOf", None)
        node.update(type="null", description="this model's chat template does not take reasoning_effort")
    for value in node.values():
        _bound(value, limits)


def build_openapi(app: FastAPI, auth_paths: set[str], limits: dict[str, Any]) -> dict:
    """The schema as the server behaves now (called per request: the API key can change).

    `limits`: vocab_size, max_num_seqs, max_model_len, priority (bool), reasoning_effort (bool).
    """
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _bound(schema.get("components", {}), limits)
    keyed = bool(app.state.api_key)
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
            if keyed and path in auth_paths:
                op["security"] = [{"bearer": []}]
            elif path in auth_paths:
                op.get("responses", {}).pop("401", None)
    comps = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.get("schemas", {}).pop(name, None)
    if keyed:
        comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return schema


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413 before any of it is parsed."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.limit <= 0:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        seen, over, refused = 0, False, False

        async def counted() -> dict:
            nonlocal seen, over
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:  # a chunked body without Content-Length: stop reading it
                    over = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg

        async def guarded(msg: dict) -> None:
            nonlocal refused
            if not over:
                return await send(msg)
            if not refused:  # whatever the app answered to the cut body, the answer is a 413
                refused = True
                await self._refuse(send)
        await self.app(scope, counted, guarded)

    async def _refuse(self, send: Any) -> None:
        import json

        from jaxllm.server.protocol import error_body
        body = json.dumps(error_body(413, f"request body over {self.limit} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

