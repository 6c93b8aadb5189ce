"""HF-style configs of well-known shapes, for random-weight benchmarks (no download)."""

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                 tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SHAPES["tiny"] = TINY
SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
SHAPES["smollm2-135m"] = SMOLLM2_135M


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
