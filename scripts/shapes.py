"""Shapes for random-weight benchmarks: the table lives in `jaxllm.models.shapes`."""

from jaxllm.models.shapes import (LLAMA3_8B, LLAMA3_70B, SHAPES, SMOLLM2_135M,  # noqa: F401
                                  TINY, get_shape)


def seeded_weights(cfg: dict, seed: int = 0) -> dict:
    """HF-named float32 numpy weights drawn from a fixed seed: identical on every machine."""
    import numpy as np

    rng = np.random.default_rng(seed)
    E, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, K, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w = lambda *s: (0.02 * rng.standard_normal(s, dtype=np.float32))
    out = {"model.embed_tokens.weight": w(V, E), "model.norm.weight": 1 + w(E)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": 1 + w(E), p + "post_attention_layernorm.weight": 1 + w(E),
                    p + "self_attn.q_proj.weight": w(H * D, E), p + "self_attn.k_proj.weight": w(K * D, E),
                    p + "self_attn.v_proj.weight": w(K * D, E), p + "self_attn.o_proj.weight": w(E, H * D),
                    p + "mlp.gate_proj.weight": w(F, E), p + "mlp.up_proj.weight": w(F, E),
                    p + "mlp.down_proj.weight": w(E, F)})
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(V, E)
    return out
