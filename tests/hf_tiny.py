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
    if arch == "llama3":
        cfg = tf.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling={
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
    else:
        raise ValueError(arch)
    model = model.float().eval()
    # HF initialises biases and norms to 0/1; randomise them so the test can see them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return model, cfg.to_dict(), sd


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens with no EOS handling (HF's own cached forward, argmax each step)."""
    import torch

    out, past, ids = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
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
