"""P/D disaggregation through HTTP: a producer server (a subprocess), a consumer server and
`jaxllm proxy` give a single server's output (a server without a connector), plain, streamed
and chat; SIGKILLing the producer after a prefill makes the consumer recompute, with the same
answer. `jaxllm proxy`'s flags, and its round robin over two prefill and two decode servers
(fake backends recording what each got)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse

from pd_server import Served, build

from jaxllm.server.proxy import build_proxy

pytestmark = pytest.mark.slow
HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    err = open(tmp_path_factory.mktemp("producer") / "stderr", "w+")
    prod = subprocess.Popen([sys.executable, os.path.join(HERE, "pd_server.py"), "kv_producer"],
                            env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    engine, app = build("kv_consumer", timeout_s=2)
    cons = Served(app)
    line = prod.stdout.readline()  # `PORT n` once its socket is bound, after it compiles
    if not line.startswith("PORT "):
        err.seek(0)
        pytest.fail(f"producer did not start (exit {prod.poll()}): {err.read()[-2000:]}")
    prod_url = f"http://127.0.0.1:{int(line.split()[1])}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(prod_url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline and prod.poll() is None, "producer did not start"
        time.sleep(0.2)
    proxy = Served(build_proxy([prod_url], [cons.url]))
    yield prod, prod_url, engine, cons, proxy
    proxy.close()
    cons.close()
    if prod.poll() is None:
        prod.kill()
    prod.wait(10)
    err.close()


def completion(url, prompt, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=60).json()


def pulls(engine) -> int:
    return engine.engine.stats()["kv_transfer_pulls"]


@pytest.fixture(scope="module")
def single():
    """The single-server reference: the same tiny model (same seed, so the same weights) with
    no KV connector and no prefix caching, so nothing it answers comes from a transfer."""
    from jaxllm.engine.async_engine import AsyncLLM
    from jaxllm.models.loader import embedded_model_path
    from jaxllm.models.tokenizer import Tokenizer
    from jaxllm.server.app import build_app

    from pd_server import TINY
    tok = Tokenizer.from_gguf(embedded_model_path())
    engine = AsyncLLM.from_config(hf_config=TINY, tokenizer=tok, max_model_len=256, max_num_seqs=4,
                                  token_buckets=(64,), seq_buckets=(4,), dtype="float32", seed=3,
                                  enable_prefix_caching=False, skip_warmup=True)
    assert engine.engine.connector is None
    s = Served(build_app(engine, ["tiny"]))
    yield s
    s.close()


def picked(choice: dict) -> tuple[list, list]:
    """A choice's (or a stream chunk's) tokens and their logprobs, completions or chat layout."""
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return [t["token"] for t in lp["content"] or []], [t["logprob"] for t in lp["content"] or []]
    return list(lp.get("tokens") or []), list(lp.get("token_logprobs") or [])


def answer(url: str, path: str, body: dict, stream: bool = False) -> tuple[str, list, list]:
    """(text, tokens, logprobs) of one request, plain or streamed. The tiny random model's
    distribution is nearly flat and its greedy text repeats one token whatever the prompt, so
    the logprobs are what tells two answers apart (they move with every prompt and KV value)."""
    body = dict(body, **({"logprobs": True, "top_logprobs": 1} if "messages" in body else {"logprobs": 1}))
    if not stream:
        ch = httpx.post(url + path, json=body, timeout=60).json()["choices"][0]
        return (ch.get("text") or ch["message"]["content"], *picked(ch))
    text, toks, lps = "", [], []
    with httpx.stream("POST", url + path, json=dict(body, stream=True), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                    t, lp = picked(ch)
                    toks += t
                    lps += lp
    return text, toks, lps


def same(a, b) -> bool:
    return a[:2] == b[:2] and len(a[2]) == len(b[2]) == 8 and all(abs(x - y) < 1e-4 for x, y in zip(a[2], b[2]))


def test_proxy_equals_single_server(pd, single):
    """The proxied answer (prefill on the producer, pages pulled by the consumer) is the answer
    of a server without a connector, computed first: text, tokens and logprobs."""
    prod, prod_url, engine, cons, proxy = pd
    C, CHAT = "/v1/completions", "/v1/chat/completions"
    base = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    reqs = [(C, dict(base, prompt="The history of the transfer of keys and values between two servers " * 6), False),
            (C, dict(base, prompt="Streaming through a proxy keeps every chunk in order " * 6), True),
            (CHAT, dict(base, messages=[{"role": "user", "content": "Tell me about disaggregated serving " * 5}]),
             True),
            (CHAT, dict(base, messages=[{"role": "user", "content": "Prefill here, decode there, same words " * 5}]),
             False)]
    # Every reference first, from the server without a connector, before any transfer.
    want = [answer(single.url, path, body, stream) for path, body, stream in reqs]
    assert all(len(w[2]) == 8 for w in want) and len({tuple(w[2]) for w in want}) == 4
    assert pulls(engine) == 0
    for i, (path, body, stream) in enumerate(reqs):
        got = answer(proxy.url, path, body, stream)
        assert pulls(engine) == i + 1  # the decode server pulled the prefill's pages
        assert same(got, want[i]), (i, got, want[i])


def test_producer_killed_after_prefill_consumer_recomputes(pd):
    prod, prod_url, engine, cons, proxy = pd
    prompt = "A prefill server that dies before its pages are fetched " * 6
    pre = completion(prod_url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_blocks"] > 0
    prod.send_signal(signal.SIGKILL)
    prod.wait(10)
    t0 = time.time()
    out = completion(cons.url, prompt, kv_transfer_params=params)
    assert time.time() - t0 < 30
    fails = engine.engine.stats()["kv_transfer_failures"]
    assert fails == 1
    assert out["choices"][0]["text"] == completion(cons.url, prompt)["choices"][0]["text"]
    # The proxy still answers with its prefill server gone: the decode server computes the prompt.
    assert completion(proxy.url, prompt)["choices"][0]["text"] == out["choices"][0]["text"]
    st = engine.engine.stats()
    deadline = time.time() + 10
    while st["num_free_blocks"] != st["num_total_blocks"] and time.time() < deadline:
        time.sleep(0.1)
        st = engine.engine.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]  # no leaked blocks


def test_proxy_cli_args(monkeypatch, capsys):
    """`jaxllm proxy --prefill URL URL --decode URL URL --host H --port P` through the real
    `jaxllm` parser: every URL kept, host and port handed to uvicorn; a missing role is an error."""
    import uvicorn

    from jaxllm import cli
    from jaxllm.server import proxy as proxy_mod

    seen = {}
    monkeypatch.setattr(proxy_mod, "build_proxy", lambda p, d: seen.update(prefill=p, decode=d) or "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    assert cli.main(["proxy", "--prefill", "http://p0:1", "http://p1:2/", "--decode", "http://d0:3",
                     "http://d1:4", "--host", "0.0.0.0", "--port", "9123"]) == 0
    assert seen == {"prefill": ["http://p0:1", "http://p1:2/"], "decode": ["http://d0:3", "http://d1:4"],
                    "app": "app", "host": "0.0.0.0", "port": 9123, "log_level": "warning"}
    seen.clear()
    assert cli.main(["proxy", "--decode", "http://d0:3", "--prefill", "http://p0:1"]) == 0
    assert seen["prefill"] == ["http://p0:1"] and seen["decode"] == ["http://d0:3"]
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8000)  # the defaults
    for argv, flag in ((["--prefill", "http://p0:1"], "--decode"), (["--decode", "http://d0:3"], "--prefill"),
                       (["--prefill", "--decode", "http://d0:3"], "--prefill"),
                       (["--prefill", "http://p0:1", "--decode", "http://d0:3", "--port", "x"], "--port")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            cli.main(["proxy", *argv])
        assert e.value.code == 2 and flag in capsys.readouterr().err, argv


def fake_backend(name: str, log: list):
    """A prefill or decode server that records each request's body and answers with its name:
    a prefill returns kv_transfer_params naming it, a decode echoes the params it got and
    streams three chunks naming it."""
    app = FastAPI()
    count = [0]

    async def handle(path: str, request: Request):
        body = await request.json()
        log.append((name, path, body))
        count[0] += 1
        if name.startswith("prefill"):
            return JSONResponse({"choices": [{"text": "?"}],
                                 "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": name,
                                                        "remote_request_id": f"{name}-{count[0]}"}})
        text = f"{name}#{count[0]}"
        if not body.get("stream"):
            return JSONResponse({"backend": name, "choices": [{"text": text}],
                                 "kv_transfer_params_seen": body.get("kv_transfer_params")})
        return StreamingResponse(iter(sse(path, name, count[0])), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("/v1/chat/completions", request)

    return app


def sse(path: str, name: str, n: int) -> list[bytes]:
    chunks = []
    for i in range(3):
        piece = f"{name}#{n}." if i == 0 else f"{i}."
        choice = {"text": piece} if path == "/v1/completions" else {"delta": {"content": piece}}
        chunks.append(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
    return chunks + [b"data: [DONE]\n\n"]


def test_proxy_round_robin_two_prefill_two_decode(monkeypatch):
    """A proxy started by `jaxllm proxy` with two prefill and two decode URLs sends successive
    requests to p0, p1, p0, p1 and to d0, d1, d0, d1; each decode request carries the
    kv_transfer_params its own prefill returned; streamed answers come back byte for byte."""
    import uvicorn

    from jaxllm import cli

    log: list = []
    names = ["prefill0", "prefill1", "decode0", "decode1"]
    backends = {n: Served(fake_backend(n, log)) for n in names}
    url = {n: b.url for n, b in backends.items()}
    built = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: built.update(app=app, **kw))
    assert cli.main(["proxy", "--prefill", url["prefill0"], url["prefill1"] + "/", "--decode", url["decode0"],
                     url["decode1"], "--port", "18123"]) == 0
    assert built["port"] == 18123
    proxy = Served(built["app"])  # served on a port bound now, not the parsed one (no race)
    purl = proxy.url
    try:
        comp = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8}
        requests = [("/v1/completions", comp), ("/v1/completions", dict(comp, stream=True)),
                    ("/v1/chat/completions", dict(chat, stream=True, stream_options={"include_usage": True})),
                    ("/v1/chat/completions", chat), ("/v1/completions", dict(comp, stream=True))]
        got = []
        for path, body in requests:
            if body.get("stream"):
                with httpx.stream("POST", purl + path, json=body, timeout=30) as r:
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                    got.append(b"".join(r.iter_raw()))
            else:
                r = httpx.post(purl + path, json=body, timeout=30)
                assert r.status_code == 200
                got.append(r.json())
        assert [n for n, _, _ in log] == ["prefill0", "decode0", "prefill1", "decode1"] * 2 + ["prefill0", "decode0"]
        for i, (path, body) in enumerate(requests):
            (pn, ppath, pre), (dn, dpath, dec) = log[2 * i], log[2 * i + 1]
            assert ppath == dpath == path
            # The prefill: one token, not streamed, asked to keep its KV for a remote decode.
            assert pre["stream"] is False and pre["kv_transfer_params"] == {"do_remote_decode": True}
            assert "stream_options" not in pre
            assert pre["max_tokens"] == 1 and pre.get("max_completion_tokens", 1) == 1
            # The decode: the original request, plus the params of this request's own prefill.
            k = i // 2 + 1  # this backend's k-th request
            params = {"do_remote_prefill": True, "remote_engine_id": pn, "remote_request_id": f"{pn}-{k}"}
            assert dec == dict(body, kv_transfer_params=params), i
            if body.get("stream"):
                assert got[i] == b"".join(sse(path, dn, k)), i
            else:
                assert got[i]["backend"] == dn and got[i]["choices"][0]["text"] == f"{dn}#{k}"
                assert got[i]["kv_transfer_params_seen"] == params
    finally:
        proxy.close()
        for b in backends.values():
            b.close()
