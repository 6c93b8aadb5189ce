"""GGUF mixture-of-experts files as llama.cpp's converter writes them -> HF config keys and names.

llama.cpp (`convert_hf_to_gguf.py`) stacks each layer's per-expert HF linears into one tensor
per projection, `[E, out, in]` in numpy order (ggml `ne = (in, out, E)`):

    blk.{i}.ffn_gate_exps / ffn_up_exps / ffn_down_exps   <- mlp.experts.{j}.gate|up|down_proj
                                                             (Mixtral: block_sparse_moe.experts.{j}.w1|w3|w2)
    blk.{i}.ffn_gate_inp                                  <- the router (mlp.gate / block_sparse_moe.gate)
    blk.{i}.ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp  <- Qwen2-MoE's shared expert and its gate

Files from before that stacking (early Mixtral GGUFs) hold one tensor per expert,
`blk.{i}.ffn_{gate,up,down}.{j}`: those map onto the HF per-expert names and load too.

Architectures: `qwen2moe`, `qwen3moe`, and Mixtral, which llama.cpp files as `llama` with
`llama.expert_count` (q/k rows permuted like every `llama` file). The stacked tensors keep their
`[E, out, in]` layout under the names `model.layers.{i}.mlp.experts.{gate,up,down}_proj.weight`,
which `moe_model.hf_to_state` stacks like the other HF layouts (no per-expert split, no copy).
GGUF has no `mlp_only_layers`: a layer stored with a dense `ffn_gate` instead of `ffn_gate_exps`
is listed there, so mixed dense/MoE files load too. llama.cpp renormalises the top-k weights for
`qwen3moe` and not for `qwen2moe`; `{arch}.expert_weights_norm`, when written, overrides that.
"""

from __future__ import annotations

import re
from typing import Any, Callable

ARCHS: dict[str, dict[str, Any]] = {
    "qwen2moe": {"model_type": "qwen2_moe", "arch": "Qwen2MoeForCausalLM", "permute": False},
    "qwen3moe": {"model_type": "qwen3_moe", "arch": "Qwen3MoeForCausalLM", "permute": False},
}
MIXTRAL = {"model_type": "mixtral", "arch": "MixtralForCausalLM", "permute": True}
_NORM_DEFAULT = {"qwen2moe": False, "qwen3moe": True}

BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_gate_exps\.weight$")
# Files converted before llama.cpp stacked experts (early 2024, e.g. the first Mixtral GGUFs)
# keep one tensor per expert: blk.{i}.ffn_gate.{e} / ffn_up.{e} / ffn_down.{e}.
_LEGACY = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


def legacy_name(gguf_name: str) -> str | None:
    """HF checkpoint name of a per-expert tensor of a pre-stacking file, else None."""
    m = _LEGACY.match(gguf_name)
    return None if m is None else f"model.layers.{m.group(1)}.mlp.experts.{m.group(3)}.{m.group(2)}_proj.weight"


def is_moe_file(arch: str, get: Callable[[str], Any]) -> bool:
    return arch in ARCHS or (arch == "llama" and (get("expert_count") or 0) > 0)


def arch_info(arch: str) -> dict[str, Any]:
    return ARCHS.get(arch, MIXTRAL)


def is_expert_tensor(gguf_name: str) -> bool:
    """An expert's weights (stacked, or one expert of a pre-stacking file): always dequantized,
    never handed to the 2-D quantized-linear hook."""
    return "_exps." in gguf_name or _LEGACY.match(gguf_name) is not None


def hf_keys(arch: str, get: Callable[[str, Any], Any], tensor_names: list[str]) -> dict[str, Any]:
    """The HF config keys of the expert block (added to the dense keys gguf_file writes)."""
    E, k = get("expert_count", None), get("expert_used_count", None)
    if not E or not k:
        raise ValueError(f"GGUF {arch} MoE file lacks {arch}.expert_count / {arch}.expert_used_count")
    blocks = int(get("block_count", 0))
    moe_layers = {int(m.group(1)) for n in tensor_names if (m := _EXPS.match(n) or _LEGACY.match(n))}
    keys: dict[str, Any] = {"num_experts_per_tok": int(k)}
    if arch not in ARCHS:  # Mixtral: every layer is MoE, expert size = feed_forward_length
        missing = sorted(set(range(blocks)) - moe_layers)
        if missing:
            raise ValueError(f"GGUF llama MoE file: layers {missing} have no ffn_gate_exps "
                             f"(dense layers are not supported for Mixtral)")
        return keys | {"num_local_experts": int(E)}
    inter = get("expert_feed_forward_length", None)
    if not inter:
        raise ValueError(f"GGUF {arch} MoE file lacks {arch}.expert_feed_forward_length")
    norm = get("expert_weights_norm", None)
    keys |= {"num_experts": int(E), "moe_intermediate_size": int(inter),
             "norm_topk_prob": _NORM_DEFAULT[arch] if norm is None else bool(norm),
             "decoder_sparse_step": 1,
             "mlp_only_layers": sorted(set(range(blocks)) - moe_layers)}
    shared = get("expert_shared_feed_forward_length", None)
    if arch == "qwen2moe" and shared:
        keys["shared_expert_intermediate_size"] = int(shared)
    return keys
