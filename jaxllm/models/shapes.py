"""HF-style configs of well-known model shapes, for random-weight runs (`random_shape=`).

Only the shape matters (weights are drawn on the device, `load_format="dummy"`), so each
entry is the `config.json` fields the engine reads. Names are lower-case, family-size.
"""

from __future__ import annotations

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                 tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64)
LLAMA2_7B = dict(LLAMA3_8B, vocab_size=32000, intermediate_size=11008, num_key_value_heads=32,
                 rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
MISTRAL_7B = dict(LLAMA3_8B, model_type="mistral", vocab_size=32768, rope_theta=1000000.0,
                  max_position_embeddings=32768, bos_token_id=1, eos_token_id=2)
QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
QWEN2_5_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                  tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
LLAMA3_2_1B = dict(LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   head_dim=64, tie_word_embeddings=True, max_position_embeddings=131072)
SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     bos_token_id=151643, eos_token_id=151645)
MIXTRAL_8X7B = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
                    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                    rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                    bos_token_id=1, eos_token_id=2)
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            bos_token_id=256, eos_token_id=257)  # inside the 512 ids (the fallback tokenizer's " t256")
TINY_MOE = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, bos_token_id=256, eos_token_id=257)

SHAPES: dict[str, dict] = {
    "llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "llama2-7b": LLAMA2_7B,
    "mistral-7b": MISTRAL_7B, "qwen3-8b": QWEN3_8B, "qwen2.5-7b": QWEN2_5_7B,
    "llama3.2-1b": LLAMA3_2_1B, "smollm2-135m": SMOLLM2_135M, "tiny": TINY,
    "qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B, "tiny-moe": TINY_MOE,
}


def get_shape(name: str) -> dict:
    """A copy of the named shape's config, or a ValueError listing the known names."""
    if name not in SHAPES:
        raise ValueError(f"unknown random_shape {name!r}; known shapes: {sorted(SHAPES)}")
    return dict(SHAPES[name])
