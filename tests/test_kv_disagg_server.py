"""P/D disaggregation through HTTP: a producer server (a subprocess), a consumer server and
`jaxllm proxy` give a single server's output, plain, streamed and chat; SIGKILLing the
producer after a prefill makes the consumer recompute, with the same answer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pd_server import Served, build

from jaxllm.server.proxy import build_proxy

pytestmark = pytest.mark.slow
HERE = os.path.dirname(__file__)


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pd():
    pp = port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    prod = subprocess.Popen([sys.executable, os.path.join(HERE, "pd_server.py"), str(pp), "kv_producer"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    engine, app = build("kv_consumer", timeout_s=2)
    cons = Served(app, port())
    cons.url = f"http://127.0.0.1:{cons.server.config.port}"
    prod_url = f"http://127.0.0.1:{pp}"
    deadline = time.time() + 120
    while True:  # the producer compiles as it starts
        try:
            if httpx.get(prod_url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline and prod.poll() is None, "producer did not start"
        time.sleep(0.2)
    proxy = Served(build_proxy([prod_url], [cons.url]), port())
    proxy.url = f"http://127.0.0.1:{proxy.server.config.port}"
    yield prod, prod_url, engine, cons, proxy
    proxy.close()
    cons.close()
    if prod.poll() is None:
        prod.kill()
    prod.wait(10)


def completion(url, prompt, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=60).json()


def streamed(url, path, body) -> str:
    text = ""
    with httpx.stream("POST", url + path, json=dict(body, stream=True), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch:
                    text += ch[0].get("text") or (ch[0].get("delta") or {}).get("content") or ""
    return text


def pulls(engine) -> int:
    return engine.engine.stats()["kv_transfer_pulls"]


def test_proxy_equals_single_server(pd):
    prod, prod_url, engine, cons, proxy = pd
    prompt = "The history of the transfer of keys and values between two servers " * 6
    via = completion(proxy.url, prompt)
    assert pulls(engine) == 1  # the decode server pulled the prefill's pages
    direct = completion(cons.url, prompt)  # the single-server answer
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    other = "Streaming through a proxy keeps every chunk in order " * 6
    s = streamed(proxy.url, "/v1/completions", {"model": "tiny", "prompt": other, "max_tokens": 8,
                                                  "temperature": 0})
    assert pulls(engine) == 2
    assert s == completion(cons.url, other)["choices"][0]["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about disaggregated serving " * 5}],
            "max_tokens": 8, "temperature": 0}
    a = httpx.post(proxy.url + "/v1/chat/completions", json=chat, timeout=60).json()
    b = httpx.post(cons.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert pulls(engine) == 3


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
