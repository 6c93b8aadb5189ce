"""Mixture-of-experts (issue 15): router, grouped matmul, models against HF, config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import checkpoint_layout, hf_greedy, make, make_llm, random_prompts

from jaxllm import SamplingParams
from jaxllm.models import moe, registry
from jaxllm.models.moe_config import MoEConfig


# -- router ---------------------------------------------------------------------------------------

def _np_route(logits: np.ndarray, k: int, routing: str, norm: bool):
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # ties: lower id first
    if routing == "softmax_topk":
        top = np.take_along_axis(logits, ids, -1)
        w = np.exp(top - top.max(-1, keepdims=True))
        return w / w.sum(-1, keepdims=True), ids
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = np.take_along_axis(p, ids, -1)
    return (w / w.sum(-1, keepdims=True) if norm else w), ids


@pytest.mark.parametrize("routing,norm", [("softmax", False), ("softmax", True), ("softmax_topk", True)])
def test_route_matches_numpy(routing, norm):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((33, 16)).astype(np.float32)
    logits[3] = 0.5  # a row of ties: experts 0..k-1 win, equally weighted
    logits[4, [2, 9, 11]] = 7.0  # a three-way tie at the top
    w, ids = moe.route(jnp.asarray(logits), 4, routing, norm)
    rw, rids = _np_route(logits, 4, routing, norm)
    np.testing.assert_array_equal(np.asarray(ids), rids)
    np.testing.assert_allclose(np.asarray(w), rw, rtol=1e-6, atol=1e-7)
    assert list(np.asarray(ids[3])) == [0, 1, 2, 3] and list(np.asarray(ids[4])[:3]) == [2, 9, 11]
    if norm:
        np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    else:  # plain top-k of a softmax over 16 experts sums to < 1
        assert (np.asarray(w).sum(-1) < 1.0).all()


# -- grouped matmul and the expert block --------------------------------------------------------

def _dense_loop(x, weights, ids, wg, wu, wd, valid=None):
    """Per-expert reference: for each expert, its tokens, SwiGLU, weighted, summed."""
    out = np.zeros_like(x, dtype=np.float64)
    for e in range(wg.shape[0]):
        for t, j in zip(*np.nonzero(ids == e)):
            if valid is not None and not valid[t]:
                continue
            h = x[t] @ wg[e]
            h = h / (1 + np.exp(-h)) * (x[t] @ wu[e])
            out[t] += weights[t, j] * (h @ wd[e])
    return out


def _weights(E=8, H=16, F=24, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
            for s in ((E, H, F), (E, H, F), (E, F, H))]


@pytest.mark.parametrize("case", ["random", "one_expert", "empty_experts", "padding"])
def test_experts_match_dense_loop(case):
    rng = np.random.default_rng(2)
    T, k, E, H = 20, 2, 8, 16
    wg, wu, wd = _weights(E, H)
    x = rng.standard_normal((T, H)).astype(np.float32)
    weights = rng.random((T, k)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    valid = None
    if case == "one_expert":  # every row to expert 5 (k = 2 rows of each token, both to 5)
        ids[:] = 5
    elif case == "empty_experts":  # experts 0, 3, 4, 7 receive no rows
        ids = np.asarray([1, 2, 5, 6], np.int32)[rng.integers(0, 4, (T, k))]
    elif case == "padding":
        valid = np.arange(T) < 13
    got = moe.experts(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(ids), jnp.asarray(wg),
                      jnp.asarray(wu), jnp.asarray(wd), None if valid is None else jnp.asarray(valid))
    ref = _dense_loop(x, weights, ids, wg, wu, wd, valid)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)
    if valid is not None:
        assert not np.asarray(got)[13:].any()


def test_sort_rows_groups_and_sizes():
    groups = jnp.asarray([3, 0, 3, 1, 4, 0], jnp.int32)  # 4 = past the last of 4 groups: skipped
    order, inverse, sizes = moe.sort_rows(groups, 4)
    assert list(np.asarray(sizes)) == [2, 1, 0, 2]
    assert list(np.asarray(groups)[np.asarray(order)]) == [0, 0, 1, 3, 3, 4]
    assert list(np.asarray(order)[np.asarray(inverse)]) == list(range(6))


def test_expert_slices_sum_to_all_experts():
    """Expert parallelism's partial outputs (each device's slice of experts) add up to the whole."""
    rng = np.random.default_rng(3)
    T, k, E, H = 12, 3, 8, 16
    wg, wu, wd = _weights(E, H)
    x = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    weights = jnp.asarray(rng.random((T, k)).astype(np.float32))
    ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    full = moe.experts(x, weights, ids, wg, wu, wd)
    parts = sum(moe.experts(x, weights, ids, wg[s:s + 2], wu[s:s + 2], wd[s:s + 2], first_expert=s)
                for s in range(0, E, 2))
    np.testing.assert_allclose(np.asarray(parts), np.asarray(full), rtol=1e-5, atol=1e-6)


def test_no_recompile_when_routing_changes():
    wg, wu, wd = _weights()
    f = jax.jit(lambda x, w, i: moe.experts(x, w, i, wg, wu, wd))
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((16, 16)).astype(np.float32))
    for trial in range(4):  # random, then all rows to one expert, ...
        ids = rng.integers(0, 8, (16, 2)) if trial % 2 == 0 else np.full((16, 2), trial)
        f(x, jnp.ones((16, 2)), jnp.asarray(ids, jnp.int32)).block_until_ready()
    assert f._cache_size() == 1


def test_expert_loads():
    ids = jnp.asarray([[0, 2], [2, 3], [1, 2]], jnp.int32)
    assert list(np.asarray(moe.expert_loads(ids, 5))) == [1, 1, 3, 1, 0]
    valid = jnp.asarray([True, True, False])
    assert list(np.asarray(moe.expert_loads(ids, 5, valid))) == [1, 0, 2, 1, 0]


# -- models against HF ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_mixed", "qwen2_moe", "mixtral"])
def test_greedy_parity_with_hf(arch):
    model, cfg, sd = make(arch)
    llm = make_llm((cfg, sd), token_buckets=(64,), max_model_len=128)  # one bucket: one compile
    mc = llm.engine.model_cfg
    assert mc.architecture == cfg["architectures"][0] and mc.moe is not None
    if arch == "qwen3_moe_mixed":  # sparse step 2 -> layers 1 and 3 MoE, but 3 is mlp_only
        assert mc.moe.moe_layers == (1,) and mc.moe.top_k == 3
    prompts = random_prompts(3, cfg["vocab_size"], 3, 70, seed=1)  # > 64 tokens: chunked
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, 10)
    assert llm.stats()["compiles_after_warmup"] == 0  # routings changed from step to step


@pytest.mark.slow
def test_unrolled_layers_match_scan(monkeypatch):
    """The accelerator layout (per-layer arrays, dense and MoE layers mixed) = the scan; each
    stack split through host memory, as on a card without room for a second copy of it."""
    from jaxllm.engine.runner import ModelRunner
    from jaxllm.models import llama_state

    staged = []
    monkeypatch.setattr(llama_state, "_short_of", lambda arr: staged.append(arr) or True)

    _, cfg, sd = make("qwen3_moe_mixed")
    prompts = random_prompts(2, cfg["vocab_size"], 3, 40, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    scan = make_llm((cfg, sd), token_buckets=(64,), max_model_len=128, skip_warmup=True)
    ref = [o.outputs[0].token_ids for o in scan.generate(prompts, greedy, use_tqdm=False)]
    init = ModelRunner.__init__
    ModelRunner.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": True})
    try:
        llm = make_llm((cfg, sd), token_buckets=(64,), max_model_len=128, skip_warmup=True)
    finally:
        ModelRunner.__init__ = init
    layers = llm.engine.runner.layer_params
    assert staged and all(a.is_deleted() for a in staged)  # the stacks released
    # dense layers' gate/up and every layer's q/k/v fused (llama_state.fuse_layer), as the dense models'
    assert "router" in layers[1] and "w_gu" in layers[0] and "router" not in layers[3]
    assert all("wqkv" in w and "wq" not in w for w in layers)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == ref


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_checkpoint_layout_stacks_the_same(arch):
    _, cfg, sd = make(arch)
    entry = registry.resolve(cfg)
    mc = entry.config(cfg)
    fused = entry.to_state(mc, sd, np.float32)
    files = checkpoint_layout(sd, arch == "mixtral")
    assert not any("gate_up_proj" in n for n in files)
    per_expert = entry.to_state(mc, files, np.float32, consume=True)
    assert not files  # consumed: every tensor moved into the stacked state exactly once
    for name, arr in fused["experts"].items():
        np.testing.assert_array_equal(per_expert["experts"][name], arr)
    assert fused["experts"]["e_gate"].shape == (2, mc.moe.num_experts, 64, mc.moe.moe_intermediate_size)


# -- bad input --------------------------------------------------------------------------------------

def _hf(**kw):
    base = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=64,
                hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    return base | kw


@pytest.mark.parametrize("kw,match", [
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    (dict(n_group=8, topk_group=4), "n_group=8: grouped top-k"),
    (dict(num_experts=0), "num_experts must be a positive integer"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok must be in"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
    (dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"), "DeepseekV3ForCausalLM"),
])
def test_bad_moe_config(kw, match):
    with pytest.raises(ValueError, match=match):
        registry.config_from_hf(_hf(**kw))


def test_registry_resolves_by_architecture_then_model_type():
    assert registry.resolve(_hf()).cls_name == "MoeLlama"
    assert registry.resolve({"model_type": "mixtral"}).architecture == "MixtralForCausalLM"
    assert registry.resolve({"architectures": ["Qwen2ForCausalLM"]}).cls_name == "Llama"
    cfg = registry.config_from_hf(_hf(decoder_sparse_step=1, mlp_only_layers=[0]))
    assert isinstance(cfg.moe, MoEConfig) and cfg.moe.moe_layers == (1,)


@pytest.mark.parametrize("name", ["e_gate", "e_down"])
def test_split_experts_slot_layout(name):
    """Expert x tensor parallel layout: slot (g * splits + t) * El + j holds expert g * El + j's
    t-th slice of the intermediate dimension F (the axis each weight keeps F on)."""
    from jaxllm.models.moe import split_experts

    E, H, F, groups, splits = 8, 3, 6, 2, 3
    shape = (2, E, H, F) if name == "e_gate" else (2, E, F, H)
    w = np.arange(np.prod(shape)).reshape(shape)
    out = split_experts(w, name, groups, splits, xp=np)
    El, Fs = E // groups, F // splits
    assert out.shape == ((2, E * splits, H, Fs) if name == "e_gate" else (2, E * splits, Fs, H))
    for g in range(groups):
        for t in range(splits):
            for j in range(El):
                slot, e = (g * splits + t) * El + j, g * El + j
                want = w[:, e, :, t * Fs:(t + 1) * Fs] if name == "e_gate" else w[:, e, t * Fs:(t + 1) * Fs]
                np.testing.assert_array_equal(out[:, slot], want)
    np.testing.assert_array_equal(np.asarray(split_experts(jnp.asarray(w), name, groups, splits)), out)
