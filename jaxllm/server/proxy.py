"""`jaxllm proxy`: the front of prefill/decode disaggregation (as vLLM's P/D proxy).

Each OpenAI request goes first to a prefill server (round-robin over `--prefill`) with
`max_tokens` 1, no streaming and `kv_transfer_params = {"do_remote_decode": true}`; the
parameters it returns (where its KV pages wait) are put on the original request, which
goes to a decode server (round-robin over `--decode`) and is answered from there,
streamed or not, byte for byte. Both servers run with `--kv-transfer-config` naming a
`JaxTransferConnector` (producer and consumer). If the prefill server fails, the request
still goes to a decode server, without parameters: it computes the prompt itself. A
decode server that cannot pull the pages in time (the prefill server died since) also
recomputes, so a request is answered as long as one decode server lives.
"""

from __future__ import annotations

import argparse
import itertools
import logging

import httpx
from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("jaxllm")


def build_proxy(prefill: list[str], decode: list[str], timeout: float = 600.0) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one --prefill and one --decode URL")
    app = FastAPI(title="jaxllm P/D proxy")
    client = httpx.AsyncClient(timeout=timeout)
    next_p = itertools.cycle([u.rstrip("/") for u in prefill]).__next__
    next_d = itertools.cycle([u.rstrip("/") for u in decode]).__next__

    async def prefill_params(path: str, body: dict) -> dict | None:
        pre = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        url = next_p() + path
        try:
            r = await client.post(url, json=pre)
        except httpx.HTTPError as e:
            log.warning("prefill server %s failed (%s); the decode server computes the prompt", url, e)
            return None
        if r.status_code != 200:
            if 400 <= r.status_code < 500:  # the request itself is bad: answer with the error
                raise _Reply(r)
            log.warning("prefill server %s answered %d; the decode server computes the prompt", url,
                        r.status_code)
            return None
        return r.json().get("kv_transfer_params")

    async def forward(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON", "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=400)
        try:
            params = await prefill_params(path, body)
        except _Reply as e:
            return Response(e.r.content, status_code=e.r.status_code,
                            media_type=e.r.headers.get("content-type"))
        dec = dict(body)
        if params:
            dec["kv_transfer_params"] = params
        url = next_d() + path
        if body.get("stream"):
            resp = await client.send(client.build_request("POST", url, json=dec), stream=True)
            return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"),
                                     background=BackgroundTask(resp.aclose))
        r = await client.post(url, json=dec)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(next_d() + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


class _Reply(Exception):
    def __init__(self, r: httpx.Response):
        self.r = r


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn
    uvicorn.run(build_proxy(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")
    return 0
