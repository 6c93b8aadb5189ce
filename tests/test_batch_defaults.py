"""max_num_batched_tokens defaults by platform and entry point, and the token buckets they give."""

from __future__ import annotations

import pytest

from jaxllm.config import (EngineConfig, default_buckets, default_max_num_batched_tokens,
                           default_token_buckets)
from jaxllm.engine.batch import pick_bucket


def test_defaults_by_platform_and_entry_point():
    assert default_max_num_batched_tokens("gpu", "llm", 64) == 16384  # offline: long prefill chunks
    assert default_max_num_batched_tokens("gpu", "serve", 64) == 2048  # server: short steps, low ITL
    assert default_max_num_batched_tokens("gpu", "engine", 64) == 2048
    assert default_max_num_batched_tokens("gpu", "serve", 4096) == 4096  # at least one token a row
    for ctx in ("llm", "serve", "engine"):
        assert default_max_num_batched_tokens("cpu", ctx, 64) == 512  # CPU: small, fast compiles
    with pytest.raises(ValueError, match="usage_context"):
        EngineConfig(usage_context="bench")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


@pytest.mark.parametrize("budget,max_seqs", [(16384, 64), (2048, 64), (512, 64), (16384, 256), (8192, 8)])
def test_decode_steps_pad_to_their_row_bucket(budget, max_seqs):
    seqs = default_buckets(max_seqs, 8)
    toks = default_token_buckets(budget, seqs)
    assert toks[-1] == budget and set(seqs) - {s for s in seqs if s >= budget} <= set(toks)
    for n in range(1, max_seqs + 1):  # a decode-only step of n rows: n tokens
        T, R = pick_bucket(toks, n), pick_bucket(seqs, n)
        assert T <= R, (n, T, R)  # never padded to the prefill budget
    for n in (budget // 3, budget // 2 + 1, budget):  # prefill chunks pad at most 4x, within budget
        T = pick_bucket(toks, n)
        assert n <= T <= budget and T < 4 * n + 16


def test_llm_and_server_pass_their_context(monkeypatch):
    import jaxllm.engine.async_engine as ae
    import jaxllm.llm as llm_mod

    seen = []

    class Probe:
        def __init__(self, cfg, **kw):
            seen.append(cfg.usage_context)
            raise RuntimeError("stop")

    monkeypatch.setattr(llm_mod, "LLMEngine", Probe)
    monkeypatch.setattr(ae, "LLMEngine", Probe)
    with pytest.raises(RuntimeError):
        llm_mod.LLM(random_shape="tiny")
    import argparse

    from jaxllm.engine.arg_utils import add_engine_args
    from jaxllm.server.args import add_serve_args, build_server_app
    p = argparse.ArgumentParser()
    add_serve_args(p)
    add_engine_args(p)
    with pytest.raises(RuntimeError):
        build_server_app(p.parse_args(["--random-shape", "tiny"]))
    assert seen == ["llm", "serve"]


def test_moe_models_get_a_two_token_bucket_on_gpus():
    """A batch of one runs in a bucket of two for MoE models on a GPU (its routed rows take the
    unsorted-row grouped matmul, no sort, and XLA compiles no one-row step); dense models, CPUs
    and given buckets are unchanged."""
    import dataclasses

    from jaxllm.engine.startup import step_shapes
    from jaxllm.models import registry
    from jaxllm.models.shapes import get_shape

    moe = registry.config_from_hf(get_shape("tiny-moe"))
    dense = registry.config_from_hf(get_shape("tiny"))
    assert moe.moe is not None and dense.moe is None
    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    s = step_shapes(cfg, moe, "gpu")
    assert s.seq_buckets[:2] == (2, 8) and s.token_buckets[0] == 2
    for model, platform in ((moe, "cpu"), (dense, "gpu")):
        s = step_shapes(cfg, model, platform)
        assert s.seq_buckets[0] == 8 and 2 not in s.token_buckets
    given = step_shapes(dataclasses.replace(cfg, seq_buckets=(8, 64)), moe, "gpu")
    assert given.seq_buckets == (8, 64)
    assert step_shapes(dataclasses.replace(cfg, max_num_seqs=1), moe, "gpu").seq_buckets == (2,)
    assert step_shapes(dataclasses.replace(cfg, max_num_seqs=2), moe, "gpu").seq_buckets == (2,)
    assert step_shapes(dataclasses.replace(cfg, max_num_seqs=1), dense, "gpu").seq_buckets == (1,)
