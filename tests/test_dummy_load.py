"""`load_format="dummy"` / `random_shape`: a config-only folder or a named shape, weights drawn on the device."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.models.dummy import byte_tokenizer
from jaxllm.models.shapes import TINY

SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("config_only")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def test_llm_generates_from_config_only_folder(cfg_dir):
    llm = LLM(cfg_dir, load_format="dummy", **SMALL)
    assert llm.engine.model_cfg.hidden_size == TINY["hidden_size"]
    out = llm.generate(["Hello world", [5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    assert out[0].prompt_token_ids == list(b"Hello world")  # the byte-level fallback tokenizer
    assert out[0].outputs[0].text == llm.get_tokenizer().decode(out[0].outputs[0].token_ids)
    assert llm.stats()["compiles_after_warmup"] == 0


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_dummy_weights_with_online_quantization(cfg_dir, method):
    """load_format="dummy" + an online method: the linears are drawn and quantized a layer at a
    time (`draw_quantized`; a 70B shape's float weights exceed one H200): the same QArray layouts
    as quantizing the float draw, the other weights drawn as before, the engine generates; one
    linear's program never holds its whole float stack."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.models.params import value
    from jaxllm.quantization.qarray import QArray
    from jaxllm.quantization.quantize import LINEAR_PARAMS, draw_linear, draw_quantized, quantize_state

    llm = LLM(cfg_dir, load_format="dummy", quantization=method, **SMALL)
    r = llm.engine.runner
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and llm.stats()["compiles_after_warmup"] == 0

    make = lambda: r.model_entry.model_cls(r.model_cfg, jnp.float32, rngs=nnx.Rngs(0))  # noqa: E731
    got = draw_quantized(make, method)
    want = quantize_state(jax.jit(lambda: nnx.state(make()))(), method)
    spec = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)  # noqa: E731
    assert spec(got) == spec(want)
    layers = got["layers"]
    linears = [n for n in LINEAR_PARAMS if n in layers]
    assert linears and all(isinstance(value(layers[n]), QArray) for n in linears)
    for n in ("ln_attn", "ln_mlp"):
        assert jnp.array_equal(value(layers[n]), value(want["layers"][n]))  # drawn as before
    assert jnp.array_equal(value(got["embed"]), value(want["embed"]))
    temp = {L: jax.jit(draw_linear, static_argnums=(1, 2, 3)).lower(  # one linear's program
        jax.random.key(0), (L, 1024, 2048), jnp.bfloat16, method).compile().memory_analysis().temp_size_in_bytes
        for L in (4, 32)}
    assert temp[32] <= 1.1 * temp[4], temp  # a layer's temporaries, whatever the stack's depth


def test_fallback_tokenizer_spells_every_id():
    tok = byte_tokenizer(300)
    assert tok.encode("héllo") == list("héllo".encode())
    assert tok.decode([104, 105, 257]) == "hi t257"
    assert byte_tokenizer(100) is None  # too few ids for bytes: prompts must be token ids


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path), load_format="dummy", **SMALL)
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"), load_format="dummy", **SMALL)


def test_unknown_random_shape():
    with pytest.raises(ValueError, match=r"unknown random_shape 'llama9-1t'.*llama3-8b"):
        EngineConfig(random_shape="llama9-1t")
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pt")
    with pytest.raises(ValueError, match="give one"):
        EngineConfig(model="x", random_shape="tiny")


def test_random_shape_generates():
    llm = LLM(random_shape="tiny", **SMALL)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.slow
def test_cli_generate_dummy(cfg_dir, capsys):
    from jaxllm.cli import main
    assert main(["generate", "Hi", "--model", cfg_dir, "--load-format", "dummy", "--max-tokens", "4",
                 "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res[0]["token_ids"]) <= 4 and res[0]["prompt"] == "Hi"


@pytest.mark.slow
def test_serve_dummy_answers_completion(cfg_dir):
    """`jaxllm serve <config folder> --load-format dummy`, flags parsed as the CLI parses them."""
    import uvicorn
    from jaxllm.engine.arg_utils import add_engine_args
    from jaxllm.server.args import add_serve_args, build_server_app

    p = argparse.ArgumentParser()
    add_serve_args(p)
    add_engine_args(p)
    args = p.parse_args([cfg_dir, "--load-format", "dummy", "--max-model-len", "128", "--max-num-seqs", "4",
                         "--max-num-batched-tokens", "64"])
    app = build_server_app(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.05)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": cfg_dir, "prompt": "Once upon", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == len("Once upon")
        assert isinstance(body["choices"][0]["text"], str)
    finally:
        server.should_exit = True
        thread.join(30)
