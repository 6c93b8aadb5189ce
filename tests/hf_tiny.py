"""Tiny random-weight HF models (no download) for parity tests."""

from __future__ import annotations

import numpy as np

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def make(arch: str, seed: int = 0):
    """Returns (torch model, hf config dict, numpy state dict)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if arch in ("llama3", "llama3_d32"):  # d32: head dim 32 (kernels taking D >= 32)
        extra = dict(head_dim=32) if arch == "llama3_d32" else {}
        cfg = tf.LlamaConfig(**TINY, **extra, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**TINY, head_dim=16, sliding_window=None)
        model = tf.MistralForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**TINY, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**TINY, head_dim=32)
        model = tf.Qwen3ForCausalLM(cfg)
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True)
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif arch == "qwen3_moe_mixed":  # dense and MoE layers: layer 0 dense (mlp_only), 2 dense (step)
        cfg = tf.Qwen3MoeConfig(**(TINY | dict(num_hidden_layers=5)), head_dim=16, num_experts=8,
                                num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
                                decoder_sparse_step=2, mlp_only_layers=[3])
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=False)
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(**(TINY | dict(intermediate_size=48)), num_local_experts=4,
                               num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model = model.float().eval()
    # HF initialises biases and norms to 0/1; randomise them so the test can see them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.3)  # spread router logits and experts, so routing matters
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    hf = cfg.to_dict()
    hf["architectures"] = [type(model).__name__]
    return model, hf, sd


def checkpoint_layout(sd: dict, mixtral: bool) -> dict:
    """transformers-5 fused expert tensors -> the per-expert names of HF checkpoint files."""
    out = {}
    for name, w in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p, F = name[: -len("mlp.experts.gate_up_proj")], w.shape[1] // 2
            for e in range(w.shape[0]):
                if mixtral:
                    out[f"{p}block_sparse_moe.experts.{e}.w1.weight"] = w[e, :F]
                    out[f"{p}block_sparse_moe.experts.{e}.w3.weight"] = w[e, F:]
                else:
                    out[f"{p}mlp.experts.{e}.gate_proj.weight"] = w[e, :F]
                    out[f"{p}mlp.experts.{e}.up_proj.weight"] = w[e, F:]
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("mlp.experts.down_proj")]
            for e in range(w.shape[0]):
                key = f"{p}block_sparse_moe.experts.{e}.w2.weight" if mixtral else f"{p}mlp.experts.{e}.down_proj.weight"
                out[key] = w[e]
        elif mixtral and name.endswith("mlp.gate.weight"):
            out[name.replace("mlp.gate", "block_sparse_moe.gate")] = w
        else:
            out[name] = w
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens with no EOS handling (HF's own cached forward, argmax each step)."""
    import torch

    import inspect

    # transformers 5.x renames past_key_values to cache (MoE models warn on the old name).
    new = "cache" in inspect.signature(model.forward).parameters
    out, past, ids = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, use_cache=True, **{"cache" if new else "past_key_values": past})
            past = res["cache"] if new else res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def hf_last_logits(model, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].numpy()


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def make_llm(tiny, **kw):
    """An engine on a (config, weights) pair from `make`, with the small buckets tests use."""
    from jaxllm import LLM

    cfg, sd = tiny
    args = dict(hf_config=cfg, weights=sd, dtype="float32", max_model_len=384, max_num_seqs=8,
                max_num_batched_tokens=64, token_buckets=(16, 64), seq_buckets=(8,))
    args.update(kw)
    return LLM(**args)


def unrolled_layers(monkeypatch) -> None:
    """Engines built after this hold their layers unrolled, as on an accelerator (`ModelRunner`'s
    `unroll_layers`), on the CPU too."""
    from jaxllm.engine.runner import ModelRunner

    init = ModelRunner.__init__
    monkeypatch.setattr(ModelRunner, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": True}))


def greedy_with_logprobs(llm, prompts: list[list[int]], greedy) -> tuple[list[list[int]], np.ndarray]:
    """(each prompt's greedy token ids, their logprobs [prompts, tokens])."""
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            np.array([[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]))
