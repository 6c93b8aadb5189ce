"""Draft configs and random-weight EAGLE heads for speculative-decoding benchmarks (GPU script).

    python scripts/spec_heads.py draft-config DIR --shape llama3.2-1b   # config.json only (load_format dummy)
    python scripts/spec_heads.py eagle DIR --method eagle3 --target llama3-8b

The heads are written in vLLM's checkpoint layout (HF names, [out, in] linears, safetensors),
with random weights: acceptance near zero, so they bound the cost of the head's program.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

# Llama-3.2-1B's shape (the Llama-3 vocabulary): a draft for a Llama-3-8B target.
LLAMA32_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                  intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                  tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001)


def write_draft_config(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(LLAMA32_1B, f)
    return path


def write_eagle(path: str, method: str, target: dict, draft_vocab: int = 32000, seed: int = 0) -> str:
    draft_vocab = min(draft_vocab, target["vocab_size"] // 2)
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    E, V, L = target["hidden_size"], target["vocab_size"], target["num_hidden_layers"]
    H, K = target["num_attention_heads"], target["num_key_value_heads"]
    D, F = target.get("head_dim") or E // H, target["intermediate_size"]
    r = lambda *s: (0.02 * rng.standard_normal(s, dtype=np.float32)).astype(np.float16)
    one = lambda n: np.ones(n, np.float16)
    pre = "midlayer." if method == "eagle3" else "layers.0."
    qkv_in = 2 * E if method == "eagle3" else E
    w = {pre + "self_attn.q_proj.weight": r(H * D, qkv_in), pre + "self_attn.k_proj.weight": r(K * D, qkv_in),
         pre + "self_attn.v_proj.weight": r(K * D, qkv_in), pre + "self_attn.o_proj.weight": r(E, H * D),
         pre + "mlp.gate_proj.weight": r(F, E), pre + "mlp.up_proj.weight": r(F, E),
         pre + "mlp.down_proj.weight": r(E, F), pre + "post_attention_layernorm.weight": one(E)}
    cfg = dict(hidden_size=E, num_attention_heads=H, num_key_value_heads=K, head_dim=D, intermediate_size=F,
               num_hidden_layers=1, vocab_size=V, rms_norm_eps=1e-5, rope_theta=target.get("rope_theta", 1e4),
               max_position_embeddings=target.get("max_position_embeddings", 8192))
    if method == "eagle3":
        w |= {"fc.weight": r(E, 3 * E), pre + "input_layernorm.weight": one(E), pre + "hidden_norm.weight": one(E),
              "norm.weight": one(E), "lm_head.weight": r(draft_vocab, E)}
        keep = np.sort(rng.choice(V, draft_vocab, replace=False))
        w["d2t"] = (keep - np.arange(draft_vocab)).astype(np.int64)
        cfg |= dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    else:
        w["fc.weight"] = r(E, 2 * E)
        cfg |= dict(architectures=["EagleLlamaForCausalLM"])
    os.makedirs(path, exist_ok=True)
    save_file(w, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["draft-config", "eagle"])
    p.add_argument("dir")
    p.add_argument("--method", choices=["eagle", "eagle3"], default="eagle3")
    p.add_argument("--target", default="llama3-8b", help="a jaxllm.models.shapes name")
    args = p.parse_args()
    if args.kind == "draft-config":
        print(write_draft_config(args.dir))
    else:
        from jaxllm.models.shapes import get_shape
        print(write_eagle(args.dir, args.method, get_shape(args.target)))


if __name__ == "__main__":
    main()
