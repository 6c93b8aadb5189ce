"""Architecture description shared by every Llama-family model.

Frozen and hashable so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
# MoE model types whose attention is that of a dense type (models/moe_model.py adds the experts).
ATTENTION_OF = {"qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "mixtral": "mistral"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # Llama with attention_bias
    qk_norm: bool = False  # Qwen3
    # llama3 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_position)
    rope_llama3: tuple[float, float, float, int] | None = None
    rope_linear_factor: float | None = None
    sliding_window: int | None = None  # Mistral; attention here is full, so max_model_len is capped
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"  # the models/registry.py entry that builds it
    moe: Any = None  # models.moe_config.MoEConfig for mixture-of-experts models

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        model_type = ATTENTION_OF.get(model_type, model_type)
        if model_type not in SUPPORTED:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED)}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        llama3 = linear = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                llama3 = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                          float(scaling["high_freq_factor"]),
                          int(scaling["original_max_position_embeddings"]))
            elif kind == "linear":
                linear = float(scaling["factor"])
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 keeps it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type in ("llama", "mistral") and bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_llama3=llama3,
            rope_linear_factor=linear,
            sliding_window=(cfg.get("sliding_window") if model_type == "mistral"
                            or cfg.get("use_sliding_window") else None),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)
