"""Architecture name -> model class and its loading / sharding hooks (as vLLM's ModelRegistry).

The checkpoint's config names its architecture (`architectures[0]` in an HF config.json,
or the GGUF loader's equivalent); `resolve` picks the entry, and everything that builds,
loads or shards a model asks that entry instead of naming `Llama`:

- `config(hf)`: the frozen `ModelConfig` (MoE fields filled in for MoE models),
- `model_cls(cfg, dtype, rngs=..., attention_fn=..., embed_fn=..., **hooks)`: the NNX module,
- `to_state(cfg, weights, dtype)`: HF-named host weights -> the module's nested state dict,
- `split_layers(params, cfg)`: the unrolled per-layer layout used on accelerators,
- `split_axes(expert_parallel)`: parameter name -> mesh-split axis, on top of the dense rules.

Entries import their module lazily, so registering costs nothing at import time.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from jaxllm.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    architecture: str
    module: str  # "jaxllm.models.llama"
    cls_name: str  # the NNX module class in `module`
    is_moe: bool = False

    def _mod(self):
        return importlib.import_module(self.module)

    @property
    def model_cls(self) -> type:
        return getattr(self._mod(), self.cls_name)

    def config(self, hf: dict[str, Any]) -> ModelConfig:
        mod = self._mod()
        make = getattr(mod, "config_from_hf", None)
        cfg = make(hf) if make is not None else ModelConfig.from_hf(hf)
        return dataclasses.replace(cfg, architecture=self.architecture)

    def to_state(self, cfg: ModelConfig, weights: dict, dtype, consume: bool = False) -> dict:
        """`consume=True` pops each tensor from `weights` as it is stacked (the caller's dict
        is then emptied), so the model is never held twice in host memory."""
        return self._mod().hf_to_state(cfg, weights, dtype, consume=consume)

    def split_layers(self, params, cfg: ModelConfig, shards: int = 1) -> list[dict]:
        """`shards`: tensor-parallel devices (dense models fuse q/k/v and gate/up per shard)."""
        mod = self._mod()
        fn = getattr(mod, "split_model_layers", None)
        if fn is not None:
            return fn(params, cfg, shards=shards)
        return mod.split_layers(params, cfg.num_layers, shards=shards)

    def split_axes(self, expert_parallel: bool) -> dict[str, int]:
        fn = getattr(self._mod(), "split_axes", None)
        return fn(expert_parallel) if fn is not None else {}


_REGISTRY: dict[str, ModelEntry] = {}
# Configs without `architectures` (hand-written dicts in tests, some GGUF conversions).
_BY_MODEL_TYPE: dict[str, str] = {}


def register(architecture: str, module: str, cls_name: str, model_types: tuple[str, ...] = (),
             is_moe: bool = False) -> None:
    _REGISTRY[architecture] = ModelEntry(architecture, module, cls_name, is_moe)
    for t in model_types:
        _BY_MODEL_TYPE.setdefault(t, architecture)


for _arch, _type in (("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"),
                     ("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3")):
    register(_arch, "jaxllm.models.llama", "Llama", (_type,))
for _arch, _type in (("Qwen3MoeForCausalLM", "qwen3_moe"), ("Qwen2MoeForCausalLM", "qwen2_moe"),
                     ("MixtralForCausalLM", "mixtral")):
    register(_arch, "jaxllm.models.moe_model", "MoeLlama", (_type,), is_moe=True)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get(architecture: str) -> ModelEntry:
    if architecture not in _REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported_architectures()}")
    return _REGISTRY[architecture]


def resolve(hf: dict[str, Any]) -> ModelEntry:
    """The entry for an HF config dict: its first known `architectures` name, else its model_type."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in _REGISTRY:
            return _REGISTRY[a]
    model_type = hf.get("model_type", "llama")
    if not archs and model_type in _BY_MODEL_TYPE:
        return _REGISTRY[_BY_MODEL_TYPE[model_type]]
    raise ValueError(f"unsupported architecture {archs or model_type!r} (config.json "
                     f"'architectures'/'model_type'); supported: {supported_architectures()}")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` for any registered architecture."""
    return resolve(hf).config(hf)
