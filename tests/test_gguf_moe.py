"""GGUF mixture-of-experts files (issue 15): llama.cpp's `ffn_*_exps` layout loads, greedy = HF.

Files are written by tests/gguf_tiny.py from tiny random HF models as llama.cpp's converter
lays them out; the HF reference's weights are first rounded to what the file stores (F16 /
Q8_0), so greedy ids must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

import gguf_tiny
from hf_tiny import hf_greedy, make, random_prompts

from jaxllm import LLM, SamplingParams
from jaxllm.models import registry
from jaxllm.models.gguf_file import load_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
             token_buckets=(64,), seq_buckets=(4,))


def _file(tmp_path, arch: str, qtype: str, seed: int = 0, legacy: bool = False):
    model, hf, sd = make(arch, seed)
    sd = gguf_tiny.round_model(model, qtype)
    path = str(tmp_path / f"{arch}-{qtype}.gguf")
    gguf_tiny.write(path, arch, hf, sd, qtype, legacy=legacy)
    return model, hf, path


@pytest.mark.parametrize("arch,qtype,legacy", [("qwen3_moe", "F32", False), ("qwen2_moe", "F16", False),
                                               ("mixtral", "Q8_0", False), ("mixtral", "F16", True)])
def test_config_and_stacked_experts(tmp_path, arch, qtype, legacy):
    """legacy: a Mixtral file from before llama.cpp stacked experts (one tensor per expert)."""
    _, hf, path = _file(tmp_path, arch, qtype, legacy=legacy)
    config, weights, _ = load_gguf(path)
    entry = registry.resolve(config)
    assert entry.architecture == hf["architectures"][0] and entry.is_moe
    mc, ref = entry.config(config), entry.config(hf)
    assert mc.moe == ref.moe, (mc.moe, ref.moe)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.qk_norm, mc.qkv_bias) == \
        (ref.num_heads, ref.num_kv_heads, ref.head_dim, ref.qk_norm, ref.qkv_bias)
    E, F = mc.moe.num_experts, mc.moe.moe_intermediate_size
    if legacy:
        assert weights[f"model.layers.1.mlp.experts.{E - 1}.down_proj.weight"].shape == (mc.hidden_size, F)
    else:
        assert weights["model.layers.1.mlp.experts.gate_proj.weight"].shape == (E, F, mc.hidden_size)
        assert weights["model.layers.1.mlp.experts.down_proj.weight"].shape == (E, mc.hidden_size, F)
    state = entry.to_state(mc, weights, np.float32, consume=True)
    assert not weights  # every tensor of the file went into the model exactly once
    _, _, sd = make(arch)  # unrounded: the stacking matches up to the file's rounding only
    want = entry.to_state(ref, sd, np.float32)["experts"]
    for name, arr in state["experts"].items():
        np.testing.assert_allclose(arr, want[name], atol=0.05 if qtype == "Q8_0" else 2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("arch,qtype,quant", [("qwen3_moe", "Q8_0", None), ("qwen2_moe", "Q8_0", "gguf"),
                                              ("mixtral", "F32", None)])
def test_gguf_greedy_equals_hf(tmp_path, arch, qtype, quant):
    """quant="gguf": attention / shared-expert linears stay Q8_0 blocks, expert stacks dequantized."""
    model, hf, path = _file(tmp_path, arch, qtype)
    llm = LLM(path, cache_dir=str(tmp_path / "cache"), quantization=quant, **SMALL)
    assert llm.engine.model_cfg.moe is not None
    prompts = random_prompts(2, hf["vocab_size"], 3, 40, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, GREEDY.max_tokens)
    assert llm.stats()["compiles_after_warmup"] == 0


def test_mixed_dense_layers_from_tensor_names(tmp_path):
    """GGUF has no mlp_only_layers: layers stored with a dense ffn_gate become dense layers
    (llama.cpp's qwen3moe writes none such; a file that has them still loads right)."""
    model, hf, sd = make("qwen3_moe_mixed")
    path = str(tmp_path / "mixed.gguf")
    gguf_tiny.write(path, "qwen3_moe", hf, gguf_tiny.round_model(model, "F32"), "F32")
    config, _, _ = load_gguf(path)
    assert registry.config_from_hf(config).moe.moe_layers == registry.config_from_hf(hf).moe.moe_layers == (1,)


def test_moe_file_without_expert_size_is_named(tmp_path):
    from jaxllm.models.gguf_file import gguf_to_hf_config

    meta = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 2, "qwen3moe.embedding_length": 64,
            "qwen3moe.attention.head_count": 4, "qwen3moe.feed_forward_length": 128,
            "qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2, "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match="expert_feed_forward_length"):
        gguf_to_hf_config(meta, ["blk.0.ffn_gate_exps.weight", "blk.1.ffn_gate_exps.weight"])
