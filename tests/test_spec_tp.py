"""Speculative decoding with tensor_parallel_size=2 (one process, two CPU devices): ngram, a draft
model (the target drafting for itself: every draft accepted; a random draft: almost none) and
EAGLE / EAGLE-3 heads (random weights in the published format) give greedy output identical to
the same engine without proposals (and to tp=1 without speculation), the speculative metrics add
up, no block leaks, zero compiles after warm-up (also in the accelerators' unrolled layer layout,
forced on CPU); the draft's pages and weights are split over the mesh, the head reads the target's replicated hidden states, and its drafts equal the dense
float64 reference (test_spec_eagle). Several processes: a clear start-up error."""

import json
import os
import subprocess
import sys

import pytest

from hf_tiny import make

CASES = ("ngram", "draft", "eagle3", "eagle")


@pytest.fixture(scope="module")
def results():
    """One subprocess (tests/spec_tp_worker.py) runs every case: one JAX start-up, one target."""
    here = os.path.dirname(__file__)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.join(here, "spec_tp_worker.py"), *CASES], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    return {r.pop("case"): r for r in lines}


def _check(r, warm=True):
    assert r["identical"] and r["plain_tp1"], r
    assert r["adds_up"] and r["leaked"] == 0, r
    assert r["compiles_after_warmup"] == 0 or not warm, r


@pytest.mark.slow
def test_tp_ngram(results):
    r = results["ngram"]
    _check(r)
    assert 0 < r["accepted"] < r["drafts"]
    assert r["overlapped"] > 0  # verification steps overlapped the next over the mesh (spec/shift.py)


@pytest.mark.slow
def test_tp_draft_model(results):
    r = results["draft"]
    _check(r["self"])
    assert 40 < r["self"]["drafts"] == r["self"]["accepted"]  # the target's own guesses
    assert r["self"]["overlapped"] == 0  # a draft model's steps stay synchronous
    _check(r["random"])
    assert r["random"]["drafts"] > 100 and r["random"]["accepted"] < 0.05 * r["random"]["drafts"]
    assert r["split"] == [1, 2]  # one of the draft's 2 KV heads on each device
    assert r["unrolled"]  # target and draft in the accelerators' per-layer layout


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_tp_eagle(results, method):
    """EAGLE-3 warmed (zero compiles after warm-up) over a target in the accelerators' unrolled
    layout; EAGLE-1 without warm-up, over the scan (the target's shared vocabulary-parallel
    embedding and LM head)."""
    r = results[method]
    _check(r, warm=method == "eagle3")
    assert r["drafts"] > 100 and r["hidden_replicated"]
    assert r["split"] == [1, 2, 32, 64]  # KV heads per device / all; wq columns per device / all
    assert r["unrolled"] == (method == "eagle3")
    assert r["checked"] == 10 and r["reference"] >= 9, r  # (f32 paged vs f64 dense: a near-tie may flip)


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_several_processes_refused(method, tmp_path):
    """Followers would need the draft's batches too: a start-up error naming the limit, before any
    weight is loaded."""
    import jax.numpy as jnp
    from jaxllm.config import EngineConfig
    from jaxllm.models.config import ModelConfig
    from jaxllm.spec.build import draft_config
    _, hf, _ = make("llama3", seed=3)
    (tmp_path / "config.json").write_text(json.dumps(hf))  # a config, no weights
    spec = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 2}
    cfg = EngineConfig(tensor_parallel_size=2, num_processes=2, distributed_coordinator="127.0.0.1:1",
                       speculative_config=spec)
    with pytest.raises(ValueError, match=rf"{method}' with several processes \(num_processes=2\) is not "
                                         r"implemented.*tensor_parallel_size > 1 works"):
        draft_config(cfg.speculative_config, cfg, ModelConfig.from_hf(hf), jnp.float32)
    one = EngineConfig(tensor_parallel_size=2, speculative_config=spec, block_size=16)
    if method == "draft_model":  # one process: past the check, to the weights (none here)
        with pytest.raises(ValueError, match="cannot load the draft"):
            draft_config(one.speculative_config, one, ModelConfig.from_hf(hf), jnp.float32)
    elif method == "eagle":  # the head's pages: one of its 2 KV heads per device
        _, per_block, aux = draft_config(one.speculative_config, one, ModelConfig.from_hf(hf), jnp.float32)
        assert (per_block, aux) == (2 * 1 * 16 * 16 * 4, (-1,))


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_heads_the_mesh_cannot_split_refused(method, tmp_path):
    """A draft with one attention head at tp=2: refused at start-up, naming the key, before weights."""
    import jax.numpy as jnp
    from jaxllm.config import EngineConfig
    from jaxllm.models.config import ModelConfig
    from jaxllm.spec.build import draft_config
    _, hf, _ = make("llama3", seed=3)
    (tmp_path / "config.json").write_text(json.dumps(
        dict(hf, num_attention_heads=1, num_key_value_heads=1, head_dim=64)))
    cfg = EngineConfig(tensor_parallel_size=2, speculative_config={
        "method": method, "model": str(tmp_path), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config.model: the (draft|EAGLE head) cannot be split "
                                         r"like the target: tensor_parallel_size=2 must divide the model's 1 "):
        draft_config(cfg.speculative_config, cfg, ModelConfig.from_hf(hf), jnp.float32)
