"""The roofline of mixture-of-experts models (jaxllm/benchmarks/roofline.py), by hand.

FLOPs per token come from the active parameters (top_k experts, router, the shared expert
of Qwen2-MoE, dense layers where mlp_only_layers / decoder_sparse_step say so); a step's
weight bytes from the experts its tokens touch.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.benchmarks.roofline import (ModelCost, cost_of_config, expected_touched, param_counts, run_floor,
                                        step_cost)
from jaxllm.models import registry
from jaxllm.models.shapes import get_shape


def _cfg(name: str, **kw):
    return registry.config_from_hf(get_shape(name) | kw)


# tiny-moe: hidden 64, 4 query / 2 KV heads of 16, 2 layers, 8 experts top-2 of 32, vocab 512
ATTN = 64 * 64 + 2 * 64 * 2 * 16 + 64 * 64  # q, k + v, o = 12,288
EXPERT = 3 * 64 * 32  # gate, up, down = 6,144
ROUTER = 64 * 8


def test_tiny_moe_by_hand():
    m = _cfg("tiny-moe")
    expert_bytes = EXPERT * 4
    c = ModelCost.of(m, weight_bytes=10_000_000, kv_bytes_per_token=7, expert_bytes=expert_bytes)
    assert c.matmul_params == 2 * (ATTN + ROUTER + 2 * EXPERT) == 50_176
    assert (c.moe_layers, c.num_experts, c.top_k, c.local_experts) == (2, 8, 2, 8)
    assert c.head_params == 64 * 512
    # params: + q/k norms (16 each), 2 RMSNorms per layer + the final one, untied embeddings + head
    norms = 2 * 2 * 16 + 2 * 2 * 64 + 64
    embed = 2 * 512 * 64
    assert param_counts(m) == {"total": 2 * (ATTN + ROUTER + 8 * EXPERT) + norms + embed,
                               "active": 2 * (ATTN + ROUTER + 2 * EXPERT) + norms + embed,
                               "matmul_active": 50_176}
    # One decode row at context 9: 1 token touches top_k = 2 experts per layer, 4 of 16.
    b, f = step_cost(c, (1, [(1, 9, True)]))
    assert f == 2 * 50_176 + 2 * 64 * 512 + c.attn_flops_per_pair * 9
    assert b == pytest.approx(10_000_000 - 2 * 8 * expert_bytes + 4 * expert_bytes + 7 * (9 + 1))
    # 3 tokens: per layer 8 * (1 - (1 - 2/8)^3) = 4.625 distinct experts expected
    b3, _ = step_cost(c, (3, [(1, 5, True)] * 3))
    assert b3 == pytest.approx(10_000_000 - 16 * expert_bytes + 2 * 4.625 * expert_bytes + 7 * (15 + 3))
    # measured counts replace the expectation: 5 (layer, expert) pairs read
    bm, _ = step_cost(c, (3, [(1, 5, True)] * 3), touched=5)
    assert bm == pytest.approx(10_000_000 - 16 * expert_bytes + 5 * expert_bytes + 7 * (15 + 3))
    r = run_floor(c, [(3, [(1, 5, True)] * 3)] * 2, 1e6, 1e12, touched=[5, 16])
    assert r["bytes"] == pytest.approx(bm + (10_000_000 + 7 * 18))
    # many tokens: every expert read, the dense model's bytes
    big, _ = step_cost(c, (4096, [(4096, 4096, True)]))
    assert big == pytest.approx(10_000_000 + 7 * 2 * 4096, rel=1e-9)


def test_dense_layers_and_shared_expert_by_hand():
    # 4 layers, decoder_sparse_step 2 (layers 1, 3 sparse), 3 in mlp_only_layers: layer 1 MoE only
    m = _cfg("tiny-moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert m.moe.moe_layers == (1,)
    dense_mlp = 3 * 64 * 128  # intermediate_size 128
    c = ModelCost.of(m, 0, 0, expert_bytes=1)
    assert c.matmul_params == 4 * ATTN + 3 * dense_mlp + ROUTER + 2 * EXPERT
    # Qwen2-MoE: a shared expert of 48 and its sigmoid gate [H, 1] on every token, top_k 2 of 8
    q2 = _cfg("tiny-moe", model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
              shared_expert_intermediate_size=48)
    assert q2.moe.shared_expert_intermediate_size == 48
    c2 = ModelCost.of(q2, 0, 0, expert_bytes=1)
    assert c2.matmul_params == 2 * (ATTN + ROUTER + 2 * EXPERT + 3 * 64 * 48 + 64)
    # Mixtral: every layer MoE, experts of intermediate_size
    mx = registry.config_from_hf(get_shape("mixtral-8x7b"))
    E = 4096
    attn = E * 4096 + 2 * E * 8 * 128 + 4096 * E
    assert ModelCost.of(mx, 0, 0).matmul_params == 32 * (attn + E * 8 + 2 * 3 * E * 14336)
    assert param_counts(mx)["total"] == pytest.approx(46.7e9, rel=0.005)  # published: 46.7B
    assert param_counts(mx)["active"] == pytest.approx(12.9e9, rel=0.005)  # published: 12.9B
    dense = registry.config_from_hf(get_shape("llama3-8b"))  # dense models: unchanged
    assert ModelCost.of(dense, 0, 0).matmul_params == 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)


def test_qwen3_30b_a3b():
    m = registry.config_from_hf(get_shape("qwen3-30b-a3b"))
    H, V = 2048, 151936
    attn = H * 32 * 128 + 2 * H * 4 * 128 + 32 * 128 * H  # 18,874,368
    moe = H * 128 + 8 * 3 * H * 768  # router + top-8 of 128 experts of 768
    counts = param_counts(m)
    norms = 48 * (2 * 128 + 2 * H) + H
    assert counts["active"] == 48 * (attn + moe) + norms + 2 * V * H
    assert counts["active"] == pytest.approx(3.3e9, rel=0.02)  # published: 3.3B activated
    assert counts["total"] == pytest.approx(30.5e9, rel=0.005)  # published: 30.5B
    cost = cost_of_config(get_shape("qwen3-30b-a3b"))  # bf16
    assert cost.matmul_params == 48 * (attn + moe) and cost.head_params == H * V
    assert cost.weight_bytes == 2 * counts["total"]
    assert cost.expert_bytes == 3 * H * 768 * 2 and cost.all_expert_bytes == 48 * 128 * 3 * H * 768 * 2
    # decode at batch 1 reads the non-expert weights and 8 experts per layer
    b1, f1 = step_cost(cost, (1, [(1, 2048, True)]))
    non_expert = cost.weight_bytes - cost.all_expert_bytes
    kv = 48 * 2 * 4 * 128 * 2
    assert b1 == pytest.approx(non_expert + 48 * 8 * cost.expert_bytes + kv * 2049)
    assert 6.6e9 < b1 - kv * 2049 < 6.8e9  # 3.1 GB of attention, router, embeddings + 3.6 GB of experts
    # batch 64: 128 * (1 - (120/128)^64) = 125.9 experts per layer, near all of them
    touched = expected_touched(128, 8, 64)
    assert touched == pytest.approx(125.94, abs=0.01)
    b64, _ = step_cost(cost, (64, [(1, 2048, True)] * 64))
    assert b64 == pytest.approx(non_expert + 48 * touched * cost.expert_bytes + kv * 64 * 2049)
    # prefill 8 x 2048: FLOPs of the active parameters (2 per param per token) + attention
    _, fp = step_cost(cost, (2048, [(2048, 2048, True)]))
    assert fp == pytest.approx(2 * 48 * (attn + moe) * 2048 + 2 * H * V + 4 * 48 * 32 * 128 * 2048 * 2049 / 2)


@pytest.mark.parametrize("E,k,n", [(8, 2, 3), (128, 8, 1), (128, 8, 64), (60, 4, 17)])
def test_expected_touched_matches_sampling(E, k, n):
    rng = np.random.default_rng(0)
    picks = np.argpartition(rng.random((2000, n, E)), k, axis=-1)[..., :k]  # k distinct of E per token
    hit = np.zeros((2000, E), bool)
    np.put_along_axis(hit, picks.reshape(2000, -1), True, axis=1)
    got = hit.sum(1).mean()
    assert expected_touched(E, k, n) == pytest.approx(got, rel=0.02)
    assert expected_touched(E, k, 1) == pytest.approx(k) and expected_touched(E, k, 0) == 0.0
    assert expected_touched(E, k, 100_000) == pytest.approx(E)


def _runner_cost(**kw):
    from jaxllm import LLM

    llm = LLM(random_shape="tiny-moe", load_format="dummy", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=(32,), seq_buckets=(4,), skip_warmup=True, **kw)
    return llm, ModelCost.of_runner(llm.engine.runner)


@pytest.mark.parametrize("unroll", [False, True])
def test_of_runner_counts_the_experts_held(unroll):
    """The experts' bytes as the runner holds them (the scan's stacks or the accelerator's
    per-layer arrays): 16 experts of 6,144 float32 weights, and the rest of the weights."""
    from jaxllm.engine.runner import ModelRunner

    init = ModelRunner.__init__
    ModelRunner.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": unroll})
    try:
        llm, c = _runner_cost()
    finally:
        ModelRunner.__init__ = init
    runner = llm.engine.runner
    assert (runner.layer_params is not None) == unroll
    assert c.expert_bytes == EXPERT * 4 and c.local_experts == 8 and c.moe_layers == 2
    assert c.weight_bytes == runner.weight_bytes
    # every parameter counted (the smallest, the q/k norms, are 256 bytes); the state may also
    # hold a few floats per layer that are not parameters (KV cache scales)
    assert abs(runner.weight_bytes - param_counts(runner.model_cfg)["total"] * 4) <= 64
    assert c.matmul_params == 50_176
    assert c.weights_read(1) == pytest.approx(runner.weight_bytes - 12 * EXPERT * 4)
