"""No silent drops: every field of OpenAI's chat and completions request schemas (as the installed
`openai` package declares them) is either honoured (200) or refused with a 400 naming it.

A field OpenAI adds later fails `test_*_field_walk` until it is given a sample here and the
server either implements it or declares it refused (jaxllm/server/fields.py).
"""

from __future__ import annotations

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from jaxllm.server.chat_protocol import ChatCompletionRequest
from jaxllm.server.protocol import CompletionRequest
from test_server import MODEL

OK, REFUSED = "ok", "refused"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# field -> (a value a client would send, other fields it needs, what the server does)
CHAT = {
    "messages": ([{"role": "user", "content": "hi"}], {}, OK),
    "model": (MODEL, {}, OK),
    "frequency_penalty": (0.5, {}, OK),
    "presence_penalty": (0.5, {}, OK),
    "logprobs": (True, {}, OK),
    "top_logprobs": (2, {"logprobs": True}, OK),
    "max_tokens": (2, {}, OK),
    "max_completion_tokens": (2, {}, OK),
    "n": (2, {}, OK),
    "seed": (3, {}, OK),
    "stop": (["\n"], {}, OK),
    "stream_options": ({"include_usage": True}, {"stream": True}, OK),
    "temperature": (0.5, {}, OK),
    "top_p": (0.9, {}, OK),
    "tools": ([TOOL], {"tool_choice": "none"}, OK),
    "tool_choice": ("none", {}, OK),
    "parallel_tool_calls": (False, {}, OK),
    "response_format": ({"type": "json_object"}, {}, OK),
    "user": ("user-1", {}, OK),
    "safety_identifier": ("user-1", {}, OK),
    "metadata": ({"k": "v"}, {}, OK),
    "prompt_cache_key": ("k", {}, OK),
    "prompt_cache_retention": ("24h", {}, OK),
    "prompt_cache_options": ({"ttl": "1h"}, {}, OK),
    "store": (True, {}, REFUSED),
    "service_tier": ("flex", {}, REFUSED),
    "modalities": (["text", "audio"], {}, REFUSED),
    "reasoning_effort": ("low", {}, REFUSED),  # SmolLM2's chat template does not take it
    "audio": ({"voice": "alloy", "format": "wav"}, {}, REFUSED),
    "functions": ([{"name": "f"}], {}, REFUSED),
    "function_call": ("auto", {}, REFUSED),
    "logit_bias": ({"50256": -100}, {}, REFUSED),
    "prediction": ({"type": "content", "content": "x"}, {}, REFUSED),
    "web_search_options": ({}, {}, REFUSED),
    "moderation": ({"model": "omni-moderation-latest"}, {}, REFUSED),
    "verbosity": ("low", {}, REFUSED),
}
COMPLETION = {
    "prompt": ("hi", {}, OK),
    "model": (MODEL, {}, OK),
    "best_of": (2, {"n": 2}, OK),
    "echo": (True, {}, OK),
    "frequency_penalty": (0.5, {}, OK),
    "presence_penalty": (0.5, {}, OK),
    "logprobs": (2, {}, OK),
    "max_tokens": (2, {}, OK),
    "n": (2, {}, OK),
    "seed": (3, {}, OK),
    "stop": (["\n"], {}, OK),
    "stream_options": ({"include_usage": True}, {"stream": True}, OK),
    "temperature": (0.5, {}, OK),
    "top_p": (0.9, {}, OK),
    "user": ("user-1", {}, OK),
    "logit_bias": ({"50256": -100}, {}, REFUSED),
    "suffix": ("tail", {}, REFUSED),
}


def _walk(url: str, path: str, samples: dict, openai_fields: set, model: type, base: dict) -> None:
    assert set(samples) == openai_fields, f"OpenAI fields without a sample here: {openai_fields - set(samples)}"
    assert openai_fields <= set(model.model_fields), f"not declared: {openai_fields - set(model.model_fields)}"
    for name, (value, extra, expect) in samples.items():
        body = {**base, "max_tokens": 2, **extra, name: value}
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        if expect == OK:
            assert r.status_code == 200, (name, r.text)
        else:
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert name in err["message"] and err["param"] == name, (name, err)


def test_chat_field_walk(live_server):
    fields = set(chat_params.CompletionCreateParamsBase.__annotations__)
    _walk(live_server.url, "/v1/chat/completions", CHAT, fields, ChatCompletionRequest,
          {"messages": [{"role": "user", "content": "hi"}]})


def test_completion_field_walk(live_server):
    fields = set(completion_params.CompletionCreateParamsBase.__annotations__)
    _walk(live_server.url, "/v1/completions", COMPLETION, fields, CompletionRequest, {"prompt": "hi"})


@pytest.mark.parametrize("field,value", [("best_of", 3), ("store", False), ("service_tier", "auto"),
                                         ("modalities", ["text"]), ("logit_bias", {})])
def test_restricted_fields_accept_their_honest_values(live_server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    r = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=60)
    if field == "best_of":  # best_of different from n is refused, naming it
        assert r.status_code == 400 and "best_of" in r.json()["error"]["message"]
    else:
        assert r.status_code == 200, r.text


def test_serve_sets_the_gil_switch_interval(monkeypatch):
    """`jaxllm serve` shortens Python's GIL switch interval (its threads hand work to each other
    every step); JAXLLM_SWITCH_INTERVAL overrides it, 0 keeps Python's, bad values are refused."""
    import sys as _sys
    from jaxllm.server import args as server_args
    before = _sys.getswitchinterval()
    try:
        monkeypatch.delenv("JAXLLM_SWITCH_INTERVAL", raising=False)
        server_args.set_switch_interval()
        assert abs(_sys.getswitchinterval() - server_args.SWITCH_INTERVAL) < 1e-9
        monkeypatch.setenv("JAXLLM_SWITCH_INTERVAL", "0.002")
        server_args.set_switch_interval()
        assert abs(_sys.getswitchinterval() - 0.002) < 1e-9
        monkeypatch.setenv("JAXLLM_SWITCH_INTERVAL", "0")
        server_args.set_switch_interval()
        assert abs(_sys.getswitchinterval() - 0.002) < 1e-9
        for bad in ("fast", "-1"):
            monkeypatch.setenv("JAXLLM_SWITCH_INTERVAL", bad)
            with pytest.raises(SystemExit, match="JAXLLM_SWITCH_INTERVAL"):
                server_args.set_switch_interval()
    finally:
        _sys.setswitchinterval(before)
