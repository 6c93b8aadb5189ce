"""The mixture-of-experts part of a model's config, read from HF config keys.

Frozen and hashable (it rides inside `ModelConfig`, a static jit argument).
Unsupported variants fail here, at start-up, with the offending field named.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# How router probabilities become the top-k weights.
#   "softmax": softmax over all experts, top-k, renormalised when norm_topk_prob (Qwen-MoE)
#   "softmax_topk": softmax over the top-k logits only (Mixtral; equal to renormalising)
ROUTINGS = ("softmax", "softmax_topk")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    routing: str  # one of ROUTINGS
    moe_layers: tuple[int, ...]  # decoder layers whose MLP is the expert block (the rest are dense)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated always-on expert

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @classmethod
    def from_hf(cls, hf: dict[str, Any], num_layers: int) -> "MoEConfig":
        model_type = hf.get("model_type")
        mixtral = model_type == "mixtral"
        # Mixtral names it num_local_experts; Qwen num_experts (transformers 5 writes either).
        field = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
        E = hf.get(field)
        if not isinstance(E, int) or E < 1:
            raise ValueError(f"{field} must be a positive integer for a MoE model, got {E!r}")
        k = hf.get("num_experts_per_tok")
        if not isinstance(k, int) or not 1 <= k <= E:
            raise ValueError(f"num_experts_per_tok must be in [1, {field}={E}], got {k!r}")
        scoring = hf.get("scoring_func", "softmax")
        if scoring != "softmax":
            raise ValueError(f"scoring_func={scoring!r} is not supported (only 'softmax')")
        for key in ("n_group", "topk_group"):
            if (hf.get(key) or 1) > 1:
                raise ValueError(f"{key}={hf[key]!r}: grouped top-k routing is not implemented")
        if hf.get("topk_method") not in (None, "greedy"):
            raise ValueError(f"topk_method={hf['topk_method']!r} is not implemented (only 'greedy')")
        if mixtral:
            inter, layers = hf["intermediate_size"], tuple(range(num_layers))
            routing, norm = "softmax_topk", True
        else:
            inter = hf.get("moe_intermediate_size")
            if not isinstance(inter, int) or inter < 1:
                raise ValueError(f"moe_intermediate_size must be a positive integer, got {inter!r}")
            step = hf.get("decoder_sparse_step") or 1
            if step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1, got {step!r}")
            dense = set(hf.get("mlp_only_layers") or ())
            layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
            routing, norm = "softmax", bool(hf.get("norm_topk_prob", False))
        shared = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        return cls(num_experts=E, top_k=k, moe_intermediate_size=int(inter), norm_topk_prob=norm,
                   routing=routing, moe_layers=layers, shared_expert_intermediate_size=shared)
