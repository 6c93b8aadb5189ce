"""Load a Hugging Face model folder (config.json + safetensors) as a config dict and lazy float32 numpy.

Why numpy and no torch: the Flax model takes host arrays and shards them itself; reading
safetensors through its numpy backend (bf16 via ml_dtypes) keeps torch out of the serving process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _require_dir(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if not os.path.isdir(path):
        raise ValueError(f"expected a model folder, got a file: {path}")


def load_hf_config(path: str) -> dict[str, Any]:
    """config.json of an HF folder as a dict (``rope_theta`` filled in from transformers-5 ``rope_parameters``)."""
    _require_dir(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in model folder {path}")
    with open(cfg_path, encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        config.setdefault("rope_theta", params["rope_theta"])
    return config


def safetensors_files(path: str) -> list[str]:
    """The safetensors files holding the weights: the index's shards, or the single file(s)."""
    _require_dir(path)
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {missing}")
        return files
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        return [single]
    found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if found:
        return found
    if any(n.endswith(".bin") or n.endswith(".pt") for n in os.listdir(path)):
        raise ValueError(f"{path} holds only PyTorch pickle weights; convert them to safetensors first")
    raise FileNotFoundError(f"no safetensors weights in model folder {path}")


class LazyTensors(Mapping[str, np.ndarray]):
    """The tensors of safetensors files, each read (and upcast to float32) only when asked for.

    Why: a checkpoint is stacked into the model's layout one tensor at a time (`to_state` with
    `consume=True` pops each as it is copied), so reading lazily means the checkpoint is never
    held whole in host memory next to the stacked model -- nor ever as a float32 copy. `pop`
    forgets a tensor once read; `reads` counts the tensors read (tests).
    """

    def __init__(self, files: list[str]):
        from safetensors import safe_open

        self._files = [safe_open(f, framework="np") for f in files]
        self._where = {name: i for i, f in enumerate(self._files) for name in f.keys()}
        self.reads = 0

    def __getitem__(self, name: str) -> np.ndarray:
        arr = self._files[self._where[name]].get_tensor(name)
        self.reads += 1
        return arr if arr.dtype == np.float32 else arr.astype(np.float32)

    def pop(self, name: str, *default: Any) -> np.ndarray:
        if name not in self._where and default:
            return default[0]
        arr = self[name]
        del self._where[name]
        return arr

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)


def load_safetensors(files: list[str]) -> LazyTensors:
    """Every tensor of ``files``, read as a float32 numpy array on access (bf16/f16 upcast exactly)."""
    return LazyTensors(files)


def load_hf_folder(path: str) -> tuple[dict[str, Any], Mapping[str, np.ndarray]]:
    """``(config, weights)`` of an HF model folder; weights keep their HF names and layout
    and are read lazily (`LazyTensors`)."""
    config = load_hf_config(path)
    weights = load_safetensors(safetensors_files(path))
    if not weights:
        raise ValueError(f"safetensors files in {path} contain no tensors")
    return config, weights
