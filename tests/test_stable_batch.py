"""JAXLLM_STABLE_BATCH=1: the step reads its batch from a copy it makes (`Batch.copied`), the
same values; the engine's output is unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import make, make_llm

from jaxllm import SamplingParams
from jaxllm.engine.device_batch import Batch
from jaxllm.engine.runner import stable_batch


def test_copied_batch_holds_the_same_values():
    rng = np.random.default_rng(0)
    b = Batch(jnp.asarray(rng.integers(-5, 99, (5, 16)), jnp.int32),
              jnp.asarray(rng.integers(-5, 99, (4, 11)), jnp.int32), 0)
    c = jax.jit(lambda b: b.copied())(b)
    np.testing.assert_array_equal(np.asarray(c.per_token), np.asarray(b.per_token))
    np.testing.assert_array_equal(np.asarray(c.per_row), np.asarray(b.per_row))
    assert c.spec_width == b.spec_width
    text = str(jax.make_jaxpr(lambda b: b.copied())(b))
    assert text.count("sort[") == 2  # a kernel of its own, which XLA does not fuse into the layers


@pytest.mark.slow
def test_engine_output_unchanged(monkeypatch):
    _, cfg, sd = make("llama3", seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 250, 11], list(range(40, 70))]

    def run():
        llm = make_llm((cfg, sd), token_buckets=(64,), skip_warmup=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                for o in outs]
    calls = []
    real = Batch.copied
    monkeypatch.setattr(Batch, "copied", lambda self: calls.append(1) or real(self))
    plain = run()
    assert not calls
    monkeypatch.setenv("JAXLLM_STABLE_BATCH", "1")
    assert stable_batch()
    assert run() == plain and calls  # traced through the copy
    monkeypatch.setenv("JAXLLM_STABLE_BATCH", "yes")
    with pytest.raises(ValueError, match="JAXLLM_STABLE_BATCH"):
        stable_batch()
