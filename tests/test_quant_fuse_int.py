"""int8 / int4 weight-only q/k/v and gate/up held fused in the unrolled (accelerator) layout
(`qarray.concat_out`): one decode kernel launch each instead of three / two."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import greedy_with_logprobs, make, unrolled_layers

from jaxllm import SamplingParams
from jaxllm.quantization import quantize
from jaxllm.quantization.qarray import QArray, concat_out


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_concat_out_is_the_matmuls_side_by_side(method):
    ks = jax.random.split(jax.random.key(1), 4)
    ws = [jax.random.normal(k, (256, n), jnp.float32) for k, n in zip(ks, (64, 32, 32))]
    qs = [quantize.QUANTIZERS[method](w, jnp) for w in ws]
    fused = concat_out(qs)
    assert isinstance(fused, QArray) and fused.shape == (256, 128) and fused.kind == method
    x = jax.random.normal(ks[3], (3, 256), jnp.float32)
    np.testing.assert_array_equal(np.asarray(x @ fused),
                                  np.asarray(jnp.concatenate([x @ q for q in qs], axis=-1)))


def test_concat_out_refuses_mixed_or_other_weights():
    w = jnp.ones((256, 32), jnp.float32)
    i8, i4 = quantize.QUANTIZERS["int8"](w, jnp), quantize.QUANTIZERS["int4"](w, jnp)
    assert concat_out([i8, i4]) is None  # kinds differ
    assert concat_out([quantize.QUANTIZERS["fp8"](w, jnp)] * 2) is None  # fp8: act.fuse's
    assert concat_out([w, w]) is None and concat_out([]) is None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_unrolled_int_fuses_qkv_and_gate_up(monkeypatch, method):
    """The unrolled layout (forced here) holds the int q/k/v and gate/up fused by default, and its
    greedy output and logprobs equal the scanned layout's separate matmuls; JAXLLM_FUSE_INT=0
    keeps them apart."""
    from jaxllm import LLM

    _, cfg, sd = make("qwen2", seed=5)  # q/k/v biases ride with the fused matmul
    kw = dict(hf_config=cfg, weights=sd, dtype="float32", max_model_len=128, max_num_seqs=4,
              token_buckets=(64,), seq_buckets=(4,), skip_warmup=True, quantization=method)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 250, 11], list(range(40, 80))]

    scanned = greedy_with_logprobs(LLM(**kw), prompts, greedy)
    unrolled_layers(monkeypatch)
    llm = LLM(**kw)
    layer = llm.engine.runner.layer_params[0]
    assert {"wqkv", "w_gu", "bqkv"} <= set(layer) and not {"wq", "wk", "w_gate", "w_up"} & set(layer)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert isinstance(layer["wqkv"], QArray) and layer["wqkv"].kind == method and layer["wqkv"].shape[-1] == (
        (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim)
    unrolled = greedy_with_logprobs(llm, prompts, greedy)
    assert unrolled[0] == scanned[0]
    np.testing.assert_allclose(unrolled[1], scanned[1], atol=1e-5)
    monkeypatch.setenv("JAXLLM_FUSE_INT", "0")
    apart = LLM(**kw).engine.runner.layer_params[0]
    assert {"wq", "wk", "wv", "w_gate", "w_up"} <= set(apart) and "wqkv" not in apart
