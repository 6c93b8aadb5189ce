"""Quantized weights under tensor parallelism (quantization/tp.py): tp=2 greedy output equals
the same mode's tp=1 run, and each QArray part is split with its weight. Runs in a subprocess
with 2 forced host devices (tests/quant_tp_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def runs() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.join(HERE, "quant_tp_worker.py")], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp8", "int4", "hf_fp8"])
def test_tp2_greedy_equals_tp1(runs, mode):
    assert runs[f"{mode}_tp2"]["tokens"] == runs[f"{mode}_tp1"]["tokens"]
    assert all(len(t) == 8 for t in runs[f"{mode}_tp1"]["tokens"])


@pytest.mark.slow
def test_modes_really_differ(runs):
    assert runs["int4_tp1"]["tokens"] != runs["fp8_tp1"]["tokens"]


@pytest.mark.slow
def test_unrolled_layout_tp2_equals_tp1(runs):
    assert runs["int4_tp2_unrolled"]["tokens"] == runs["int4_tp1"]["tokens"]
    r = runs["int4_tp2_unrolled"]["wq"]  # per layer [K/2, N]: split by N
    assert r["values"]["shard"] == [r["values"]["shape"][0], r["values"]["shape"][1] // 2]


@pytest.mark.slow
def test_parts_split_with_their_weights(runs):
    half = lambda p, ax: p["shard"][ax] * 2 == p["shape"][ax] and all(
        s == g for i, (s, g) in enumerate(zip(p["shard"], p["shape"])) if i != ax % len(p["shape"]))
    whole = lambda p: p["shard"] == p["shape"]
    fp8, int4 = runs["fp8_tp2"], runs["int4_tp2"]
    # Column-parallel wq ([L, K, N] float, split N): fp8 stores [L, N, K], scale [L, N, 1].
    assert half(fp8["wq"]["values"], 1) and half(fp8["wq"]["scale"], 1)
    assert all(half(int4["wq"][k], 2) for k in ("values", "scale", "offset"))
    # Row-parallel w_down (split K): per-channel scales replicated, int4 groups split.
    assert half(fp8["w_down"]["values"], 2) and whole(fp8["w_down"]["scale"])
    assert all(half(int4["w_down"][k], 1) for k in ("values", "scale", "offset"))
    # o_proj: K = 128 is one int4 group, which cannot split: the whole QArray replicated.
    assert all(whole(p) for p in int4["wo"].values())
    # HF FP8 128x128 blocks: wq [256, 256] -> 2 x 2 blocks, split with the values.
    hf = runs["hf_fp8_tp2"]["wq"]
    assert half(hf["values"], 1) and half(hf["scale"], 1)
    # Each device holds about half the quantized weights.
    for m in ("fp8", "int4", "hf_fp8"):
        assert runs[f"{m}_tp2"]["weight_bytes"] < 0.75 * runs[f"{m}_tp1"]["weight_bytes"], m
