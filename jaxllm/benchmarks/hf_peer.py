"""HF transformers as the benchmarks' peer: models from HF-style shape configs, and the experts
implementation a mixture-of-experts model runs.

transformers 5 routes a MoE layer's experts through `config._experts_implementation`
(constructor / `from_pretrained` argument `experts_implementation`, switched with
`model.set_experts_implementation`): "eager" (the model's own loop over experts),
"grouped_mm" (rows sorted by expert, `torch.nn.functional.grouped_mm` / `torch._grouped_mm`
over all experts at once; transformers' default where it can dispatch), "batched_mm" (each
row's expert weights gathered, then one bmm). Inside `generate`, transformers swaps
grouped_mm for batched_mm in the decode loop on non-CPU devices
(`GenerationMixin._optimize_model_for_decode`); batched_mm copies every row's expert
weights (at 64 rows x top-8 of Qwen3-30B-A3B, 4.8 GB per layer per step), so the peer keeps
grouped_mm through decode unless "hf-default" is asked for.

torch and transformers are imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig",
                  "mixtral": "MixtralConfig"}
# --hf-experts choices: "grouped_mm" (prefill and decode, eager where it cannot run),
# "hf-default" (transformers' own choice, batched_mm in the decode loop off the CPU), or one
# implementation for both phases.
EXPERTS_CHOICES = ("grouped_mm", "hf-default", "batched_mm", "eager")


def hf_config(shape: dict[str, Any]):
    """The transformers config of an HF-style config dict (`jaxllm.models.shapes`, config.json)."""
    import transformers as tf

    cfg = dict(shape)
    kind = cfg.pop("model_type", "llama")
    cfg.pop("architectures", None)
    if kind not in CONFIG_CLASSES:
        raise ValueError(f"no HF peer config for model_type {kind!r}; known: {sorted(CONFIG_CLASSES)}")
    return getattr(tf, CONFIG_CLASSES[kind])(**cfg)


def experts_modules(model) -> list:
    """The experts modules that dispatch on `config._experts_implementation` (transformers 5's
    `@use_experts_implementation` classes)."""
    return [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]


def grouped_mm_kernel(model) -> bool:
    """Whether torch's grouped_mm kernel runs for this model's expert weights (device, dtype,
    torch version), as transformers decides per call; without it transformers' grouped_mm
    falls back to a loop over experts."""
    import torch

    mods = experts_modules(model)
    if not mods:
        return False
    w = next(p for p in mods[0].parameters())
    try:
        from transformers.integrations.moe import _can_use_grouped_mm
    except ImportError:
        return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    x = torch.zeros((2, w.shape[-1]), device=w.device, dtype=w.dtype)
    offs = torch.tensor([2] * w.shape[0], device=w.device, dtype=torch.int32)
    return bool(_can_use_grouped_mm(x, w, offs))


def select_experts(model, want: str = "grouped_mm") -> dict:
    """Set the experts implementation of a HF MoE model: `want` where it runs here, eager
    otherwise. Returns what was asked and what is configured for prefill and decode (the
    probe, `probe_experts`, records what actually ran)."""
    if want not in EXPERTS_CHOICES:
        raise ValueError(f"experts implementation {want!r}; choose from {EXPERTS_CHOICES}")
    info: dict[str, Any] = {"requested": want}
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if not experts_modules(model) or can_set is None or not can_set():
        moe = any(getattr(model.config, k, None) for k in ("num_experts", "num_local_experts"))
        impl = "eager" if moe else None
        info.update(prefill=impl, decode=impl, note="experts not switchable here (transformers < 5: its loop)"
                    if moe else "not a MoE model")
        return info
    impl = model.config._experts_implementation if want == "hf-default" else want
    if impl == "grouped_mm" and not grouped_mm_kernel(model):
        info["fallback"] = "torch grouped_mm kernel unavailable for these weights (device, dtype, torch)"
        impl = "eager"
    try:
        model.set_experts_implementation(impl)
    except (ValueError, ImportError, KeyError, RuntimeError) as e:
        info["fallback"] = f"{impl}: {type(e).__name__}: {e}"[:300]
        model.set_experts_implementation("eager")
    info["prefill"] = model.config._experts_implementation
    if want == "hf-default":
        off_cpu = next(model.parameters()).device.type not in ("cpu", "mps")
        info["decode"] = "batched_mm" if info["prefill"] == "grouped_mm" and off_cpu else info["prefill"]
    else:
        # generate() would swap grouped_mm for batched_mm in the decode loop: keep the choice.
        model._optimize_model_for_decode = contextlib.nullcontext
        info["decode"] = info["prefill"]
    return info


def probe_experts(model, prompt_len: int = 4, new_tokens: int = 2) -> dict:
    """Which experts implementation each phase of `generate` ran: a short greedy generate
    (batch 1, dynamic cache, untimed) with a hook on every experts module that records the
    implementation in force at each call; prefill calls see `prompt_len` rows, decode 1."""
    import torch

    seen: dict[str, set] = {"prefill": set(), "decode": set()}

    def hook(mod, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        seen["prefill" if x.shape[0] == prompt_len else "decode"].add(mod.config._experts_implementation)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts_modules(model)]
    device = next(model.parameters()).device
    ids = torch.full((1, prompt_len), 5, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    finally:
        for h in handles:
            h.remove()
    return {k: sorted(str(x) for x in v) for k, v in seen.items()}
