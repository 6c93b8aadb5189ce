"""The unrolled-layers step (the accelerator layout) equals the scanned one (the CPU layout)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hf_tiny import make, random_prompts

from jaxllm import LLM, SamplingParams
from jaxllm.engine.runner import ModelRunner
from jaxllm.models import llama_state
from jaxllm.models.params import value


def test_unrolled_layers_match_scan(monkeypatch):
    _, cfg, sd = make("qwen3", seed=2)
    kw = dict(hf_config=cfg, weights=sd, dtype="float32", max_model_len=128, max_num_seqs=8,
              token_buckets=(16, 64), seq_buckets=(8,))
    prompts = random_prompts(5, cfg["vocab_size"], 2, 60, seed=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    scanned = LLM(**kw)
    assert scanned.engine.runner.layer_params is None  # CPU default: scan
    init = ModelRunner.__init__
    monkeypatch.setattr(ModelRunner, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": True}))
    unrolled = LLM(**kw)
    runner = unrolled.engine.runner
    assert len(runner.layer_params) == cfg["num_hidden_layers"]
    assert {"wqkv", "w_gu"} <= set(runner.layer_params[0]) and "wq" not in runner.layer_params[0]  # fused
    assert all(np.asarray(v).size == 0 for v in runner.params["layers"].values())  # held once
    a = [o.outputs[0].token_ids for o in scanned.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in unrolled.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert unrolled.stats()["compiles_after_warmup"] == 0


def test_unstack_through_host_releases_the_stack(monkeypatch):
    """A stack split through host memory (a card short of room for a second copy of it) gives the
    same layers as slicing on the device, and is released before they are put back."""
    stack = jnp.arange(4 * 2 * 3, dtype=jnp.float32).reshape(4, 2, 3).astype(jnp.bfloat16)
    expect = [np.asarray(stack[j]) for j in (0, 2, 3)]
    assert not llama_state._short_of(stack)  # the CPU: never short
    jax.eval_shape(lambda a: llama_state._short_of(a) and a, stack)  # traced: never asks a device
    monkeypatch.setattr(llama_state, "_short_of", lambda arr: True)
    var = nnx.Param(stack)
    layers = llama_state.unstack(var, [0, 2, 3])
    assert stack.is_deleted() and value(var).shape == (0,)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 for x in layers)
    for got, want in zip(layers, expect):
        np.testing.assert_array_equal(np.asarray(got), want)
