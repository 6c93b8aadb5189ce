"""Live OpenAI-compatible server on 127.0.0.1, driven by the official `openai` client and httpx.

One tiny random-weight Llama (hidden 64, 2 layers) with the real SmolLM2
tokenizer, so text, chat templates and stop strings are real while start-up
compiles only two token buckets. The server runs in a background thread with
its own event loop; engine state is read through the same AsyncLLM.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from jaxllm.engine.async_engine import AsyncLLM
from jaxllm.server.app import build_app

MODEL = "tiny-llama"
MAX_LEN = 256
TINY = dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=MAX_LEN, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)


class LiveServer:
    def __init__(self) -> None:
        import uvicorn
        from jaxllm.models.loader import embedded_model_path
        from jaxllm.models.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(embedded_model_path())  # the embedded SmolLM2 tokenizer, no weights
        self.engine = AsyncLLM.from_config(hf_config=TINY, tokenizer=tok, max_model_len=MAX_LEN, max_num_seqs=8,
                                           token_buckets=(16, 64), seq_buckets=(8,), dtype="float32",
                                           max_waiting_requests=128)
        self.app = build_app(self.engine, [MODEL, "alias"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def run(self, coro, timeout: float = 60):
        """Run a coroutine on the server's event loop (where the AsyncLLM lives)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_idle(self, timeout: float = 20) -> dict:
        deadline = time.time() + timeout
        while True:
            st = self.engine.stats()
            if st["num_running"] == 0 and st["num_waiting"] == 0 and st["num_free_blocks"] == st["num_total_blocks"]:
                return st
            assert time.time() < deadline, f"engine not idle: {st}"
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def srv(live_server):
    return live_server  # conftest.py: one server for all server test files


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_health_version(srv, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert httpx.get(f"{srv.url}/version").json()["version"]


def test_completion_stream_equals_greedy_text(srv, client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_greedy_text(srv, client):
    msgs = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="alias", messages=msgs, max_completion_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n2_and_seed(client):
    a = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, n=2, seed=7, temperature=1.0)
    b = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, n=2, seed=7, temperature=1.0)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok, top in zip(lp.tokens, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and max(top.values()) <= 0.0
        assert top[tok] == pytest.approx(max(top.values()))  # greedy: the chosen token is the top one
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, temperature=0)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_echo_prompt_logprobs_match_generation(client):
    """lm-eval-harness style: echo=True, logprobs=1 scores the prompt; positions agree with generation."""
    gen = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                    logprobs=1)
    prompt = "The quick brown fox" + gen.choices[0].text
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 1 and "".join(lp.tokens) == r.choices[0].text
    scored = lp.token_logprobs[n_prompt - 6:n_prompt]
    assert scored == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=2e-3)
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert only.usage.completion_tokens == 0 and only.choices[0].text == prompt
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt], abs=2e-3)


def test_lm_eval_loglikelihood_request_shape(srv):
    """The exact request lm-eval's local-completions sends (remote tokenizer, token-id batch), parsed its way."""
    info = httpx.get(f"{srv.url}/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"]
    tok = lambda text: httpx.post(f"{srv.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    pairs = [("Question: 2+2? Answer:", " 4"), ("The sky is", " blue")]
    batch, ctxlens = [], []
    for ctx, cont in pairs:
        c, w = tok(ctx)["tokens"], tok(ctx + cont)["tokens"]
        batch.append(w)
        ctxlens.append(len(c))
    body = {"model": MODEL, "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
    for choice, ctxlen, ids in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, batch):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert len(lps) == len(ids) - ctxlen and all(lp <= 0 for lp in lps)
        assert all(max(top.values()) >= lp for lp, top in zip(lps, tops))


def test_stop_string_streamed_and_not(client):
    base = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=16, temperature=0).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    expect = base[:base.index(stop)]
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Tell me", max_tokens=16, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expect


def test_tokenize_detokenize(srv):
    t = httpx.post(f"{srv.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == MAX_LEN
    d = httpx.post(f"{srv.url}/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    chat = httpx.post(f"{srv.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > t["count"]


def test_64_concurrent_streams(srv):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
        body = {"model": MODEL, "prompt": f"Request number {i}:", "max_tokens": 8, "stream": True,
                "temperature": 0.5, "seed": i}
        text, finish, done = "", None, False
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        assert done
        return text, finish

    async def main() -> list:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64 and all(f == "length" for _, f in results)
    st = srv.wait_idle()
    assert st["num_unfinished_requests"] == 0 and st["compiles_after_warmup"] == 0


def test_prometheus_metrics(srv):
    text = httpx.get(f"{srv.url}/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds"):
        assert srv.metric(f"jaxllm:{name}_count") > 0, name
    # the first token's wait splits into queued and prefill time (vLLM's two histograms)
    ttft, queue, prefill = (srv.metric(f"jaxllm:{n}_sum") for n in (
        "time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds"))
    assert 0 < queue + prefill <= ttft + 1.0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"jaxllm:{name}{{" in text, name
    assert srv.metric("jaxllm:prompt_tokens_total") > 0 and srv.metric("jaxllm:generation_tokens_total") > 64 * 8


def test_client_disconnect_aborts_and_frees_blocks(srv):
    aborted = srv.metric('jaxllm:request_success_total{finished_reason="abort"')
    body = {"model": MODEL, "prompt": "Go on and on", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert srv.engine.stats()["num_unfinished_requests"] == 1
    # leaving the block closed the connection mid-stream
    srv.wait_idle()
    with pytest.raises(httpx.TimeoutException):  # a non-streamed request whose client gives up
        httpx.post(f"{srv.url}/v1/completions", json=dict(body, stream=False, n=4), timeout=0.3)
    srv.wait_idle()
    assert srv.metric('jaxllm:request_success_total{finished_reason="abort"') == aborted + 2


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", "{not json", 400),
    ("/v1/completions", {"model": MODEL}, 400),  # no prompt
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400),
    ("/v1/completions", {"prompt": "x", "n": 9}, 400),  # more than max_num_seqs
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ""}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),  # 0 only with echo
    ("/v1/completions", {"prompt": [5] * (MAX_LEN + 1), "max_tokens": 1}, 400),  # over-long prompt
    ("/v1/completions", {"prompt": [5] * 200, "max_tokens": 100}, 400),  # prompt + completion too long
    ("/v1/completions", {"prompt": [49152]}, 400),  # token id out of range
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("/v1/nothing", {}, 404),
])
def test_bad_inputs_get_openai_errors(srv, path, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{srv.url}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"]["message"], str)
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_openai_client_error_classes(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x" * 2000, max_tokens=1)


def test_api_key(srv):
    srv.app.state.api_key = "sk-test"
    try:
        body = {"prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 401
        bad = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        keyed = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-test", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        srv.app.state.api_key = None


def test_overload_refused_at_once_while_in_flight_continues(srv):
    srv.engine.max_waiting_requests = 0
    try:
        body = {"model": MODEL, "prompt": "busy", "max_tokens": 60, "ignore_eos": True, "n": 8, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as busy:
            lines = busy.iter_lines()
            next(lines)
            t0 = time.time()
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 503 and time.time() - t0 < 5 and r.headers["retry-after"]
            rest = list(lines)
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert sum(line.count('"finish_reason": "length"') for line in rest) == 8
    finally:
        srv.engine.max_waiting_requests = 128
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_async_engine_generate_and_abort(srv):
    from jaxllm.sampling_params import SamplingParams

    async def run() -> tuple:
        eng = srv.engine
        deltas = [o async for o in eng.generate("Hello there", SamplingParams(max_tokens=8, temperature=0))]
        text = "".join(c.text for o in deltas for c in o.outputs)
        cum = [o async for o in eng.generate("Hello there", SamplingParams(max_tokens=8, temperature=0), delta=False)]
        outs = []
        async for o in eng.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "to-abort"):
            outs.append(o)
            if len(outs) == 2:
                await eng.abort("to-abort")
        return text, cum[-1], outs

    text, final, outs = srv.run(run())
    assert final.finished and final.outputs[0].text == text and len(final.outputs[0].token_ids) == 8
    assert final.prompt == "Hello there"
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort" and len(outs) == 3
    srv.wait_idle()


def test_failed_step_fails_requests_not_the_server(srv):
    real = srv.engine.engine.step

    def broken():
        srv.engine.engine.step = real  # fail once
        raise RuntimeError("injected step failure")

    srv.engine.engine.step = broken
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    srv.wait_idle()
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}).status_code == 200


def test_serve_cli_flags():
    import argparse

    from jaxllm.engine.arg_utils import add_engine_args, engine_kwargs
    from jaxllm.server.args import add_serve_args, served_names

    p = argparse.ArgumentParser()
    add_serve_args(p)
    add_engine_args(p)
    a = p.parse_args(["some/model", "--host", "127.0.0.1", "--port", "9000", "--api-key", "k", "--max-model-len",
                      "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--dtype", "float32",
                      "--block-size", "32", "--served-model-name", "a", "b", "--max-waiting-requests", "3"])
    assert served_names(a) == ["a", "b"] and a.model_tag == "some/model" and a.api_key == "k"
    kw = engine_kwargs(a)
    assert (kw["max_model_len"], kw["max_num_seqs"], kw["block_size"]) == (512, 4, 32)
    assert served_names(p.parse_args([])) == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
