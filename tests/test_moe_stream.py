"""Streamed expert stacking (issue 15): an HF safetensors MoE checkpoint is read one tensor at a
time while its experts are stacked, never as a whole-checkpoint float32 copy."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from hf_tiny import checkpoint_layout, make

from jaxllm.models import registry
from jaxllm.models.hf_files import LazyTensors, load_hf_folder
from jaxllm.models.loader import load_model_files


def _save(tmp_path, arch: str, per_expert: bool):
    """A safetensors folder in bfloat16 (per-expert checkpoint names or transformers 5's fused)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    _, hf, sd = make(arch)
    files = checkpoint_layout(sd, arch == "mixtral") if per_expert else sd
    folder = tmp_path / arch
    folder.mkdir()
    names = sorted(files)
    half = len(names) // 2  # two shards, as big checkpoints come
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: np.ascontiguousarray(files[n]).astype(ml_dtypes.bfloat16) for n in part},
                  str(folder / f"model-{i:05d}-of-00002.safetensors"))
    import json
    (folder / "config.json").write_text(json.dumps(hf))
    return hf, sd, folder


def _nbytes(tree) -> int:
    return sum(_nbytes(v) for v in tree.values()) if isinstance(tree, dict) else tree.nbytes


@pytest.mark.parametrize("arch,per_expert", [("qwen2_moe", True), ("mixtral", False)])
def test_stacking_streams_the_checkpoint(tmp_path, arch, per_expert):
    hf, sd, folder = _save(tmp_path, arch, per_expert)
    entry = registry.resolve(hf)
    mc = entry.config(hf)
    largest = max(w.size for w in sd.values()) * 4  # one float32 tensor (the fused stacks: a layer)

    tracemalloc.start()
    try:
        _, weights = load_hf_folder(str(folder))
        assert isinstance(weights, LazyTensors) and weights.reads == 0  # nothing read up front
        state = entry.to_state(mc, weights, np.float32, consume=True)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        eager = dict(load_hf_folder(str(folder))[1].items())  # the old loader: all of it as float32
        _, eager_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    model_bytes = _nbytes(state)
    assert not weights  # every tensor consumed exactly once
    assert weights.reads <= len(eager) + mc.num_layers * 16  # (stack_layers peeks at a first layer)
    # Peak while stacking: the stacked model plus a few tensors in flight, not a second model.
    assert peak < model_bytes + 4 * largest, (peak, model_bytes, largest)
    assert eager_peak > model_bytes + 4 * largest  # reading the whole checkpoint would fail the bound
    ref = entry.to_state(mc, {k: v.astype(np.float32) for k, v in checkpoint_layout(sd, arch == "mixtral").items()},
                         np.float32)
    for name, arr in ref["experts"].items():  # bf16-rounded weights, stacked the same
        np.testing.assert_allclose(state["experts"][name], arr, rtol=1e-2, atol=1e-2)


def test_engine_load_reads_folders_lazily(tmp_path):
    from jaxllm.models.loader import embedded_model_path
    from jaxllm.models.tokenizer import Tokenizer

    hf, sd, folder = _save(tmp_path, "qwen3_moe", per_expert=True)
    Tokenizer.from_gguf(embedded_model_path()).save(str(folder))
    config, weights, _ = load_model_files(str(folder), cache_dir=str(tmp_path / "cache"))
    assert isinstance(weights, LazyTensors) and weights.reads == 0
    assert registry.config_from_hf(config) == registry.config_from_hf(hf) and set(weights) == set(checkpoint_layout(sd, False))
    assert not (tmp_path / "cache").exists()  # no float32 copy of the checkpoint on disk either
