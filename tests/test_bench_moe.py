"""The MoE benchmarks' wiring on the CPU (issue 15): the HF peer's experts implementation
(scripts/bench_throughput.py, jaxllm/benchmarks/hf_peer.py) and prefill MFU on the active
parameters (scripts/bench_moe.py prefill), with the tiny-moe shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

# A tiny random Qwen3-MoE (transformers' Qwen3MoeConfig from the tiny-moe shape: 8 experts, top-2).
PEER = dict(random_shape="tiny-moe", model=None, dtype="float32", seed=0, hf_batch=2, input_len=6, output_len=3)


def _run_hf(experts: str) -> dict:
    import bench_throughput

    args = argparse.Namespace(**PEER, hf_experts=experts)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [1, 2, 3, 4, 5, 6]]
    res = bench_throughput.run_hf(args, prompts)
    assert res["output_tokens_per_s"] > 0 and res["device"] == "cpu"
    return res["experts"]


def test_hf_peer_runs_grouped_mm():
    ex = _run_hf("grouped_mm")
    assert (ex["requested"], ex["prefill"], ex["decode"]) == ("grouped_mm",) * 3
    assert ex["probe"] == {"prefill": ["grouped_mm"], "decode": ["grouped_mm"]}  # what the experts ran
    assert "fallback" not in ex


def test_hf_peer_falls_back_to_eager(monkeypatch):
    """Where torch's grouped_mm kernel cannot run (an old torch, a GPU before SM80), eager."""
    import transformers.integrations.moe as moe

    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *a: False)
    ex = _run_hf("grouped_mm")
    assert (ex["prefill"], ex["decode"]) == ("eager", "eager") and "grouped_mm" in ex["fallback"]
    assert ex["probe"] == {"prefill": ["eager"], "decode": ["eager"]}


def test_grouped_mm_kept_in_decode_off_the_cpu(monkeypatch):
    """transformers' generate swaps grouped_mm for batched_mm in its decode loop off the CPU;
    the peer keeps grouped_mm (unless hf-default), so what was asked runs in decode too."""
    import torch
    import transformers as tf

    from jaxllm.benchmarks import hf_peer
    from jaxllm.models.shapes import get_shape

    torch.manual_seed(0)
    cfg = hf_peer.hf_config(get_shape("tiny-moe"))
    assert type(cfg).__name__ == "Qwen3MoeConfig" and cfg.num_experts == 8
    kept, default = (tf.AutoModelForCausalLM.from_config(cfg).eval() for _ in range(2))
    assert hf_peer.select_experts(kept, "grouped_mm")["decode"] == "grouped_mm"
    assert hf_peer.select_experts(default, "hf-default")["prefill"] == "grouped_mm"
    monkeypatch.setattr(type(kept), "device", property(lambda self: torch.device("cuda")))  # as on a GPU
    with default._optimize_model_for_decode():
        assert default.config._experts_implementation == "batched_mm"
    with kept._optimize_model_for_decode():
        assert kept.config._experts_implementation == "grouped_mm"
    assert default.config._experts_implementation == "grouped_mm"  # restored after decode


@pytest.mark.slow
def test_hf_only_then_hf_result(tmp_path, monkeypatch):
    """The peer in its own process (--hf-only), its figures handed to the jaxllm run
    (--hf-result): the JSON records the ratio and which experts implementation ran; a file
    of another workload is refused."""
    import bench_throughput

    common = ["--random-shape", "tiny-moe", "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
              "--dtype", "float32"]
    hf, out = str(tmp_path / "hf.json"), str(tmp_path / "out.json")
    monkeypatch.setattr(sys, "argv", ["x", *common, "--hf-only", "--hf-batch", "2", "--output-json", hf])
    bench_throughput.main()
    peer = json.load(open(hf))["hf"]
    assert peer["experts"]["probe"]["decode"] == ["grouped_mm"] and peer["batch"] == 2
    monkeypatch.setattr(sys, "argv", ["x", *common, "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                                      "--no-roofline", "--hf-result", hf, "--output-json", out])
    bench_throughput.main()
    res = json.load(open(out))
    assert res["hf"]["experts"] == peer["experts"] and res["hf"]["from_file"] == hf
    assert res["ratio_output_tokens_per_s"] == pytest.approx(
        res["jaxllm"]["output_tokens_per_s"] / peer["output_tokens_per_s"])
    monkeypatch.setattr(sys, "argv", ["x", *common[:-4], "--num-prompts", "5", "--hf-result", hf])
    with pytest.raises(SystemExit):
        bench_throughput.main()


@pytest.mark.slow
def test_prefill_mfu_counts_active_parameters(tmp_path, monkeypatch):
    """bench_moe.py prefill: FLOPs of the steps the engine ran from the active parameters
    (tiny-moe: 50,176 matmul params per token), MFU against the matmul rate of the same run."""
    import bench_moe

    out = str(tmp_path / "p.json")
    B, n = 2, 48
    monkeypatch.setattr(sys, "argv", ["x", "prefill", "--random-shape", "tiny-moe", "--prefill-batch", str(B),
                                      "--prefill-len", str(n), "--reps", "1", "--copy-gib", "0.02",
                                      "--output-json", out])
    bench_moe.main()
    r = json.load(open(out))
    assert r["steps"] == 1 and r["tokens"] == B * n and r["matmul_params_active"] == 50_176
    attn = 4 * 2 * 4 * 16  # 4 * L * H * D per (query, key) pair
    assert r["flops"] == pytest.approx(2 * 50_176 * B * n + 2 * 64 * 512 * B + attn * B * n * (n + 1) / 2)
    assert r["mfu"] == pytest.approx(r["flops"] / r["elapsed_s"] / r["rates"]["matmul_flops_per_s"])
    assert r["flops_basis"] == "active parameters" and r["params_active"] < r["params_total"]
    assert r["compiles_after_warmup"] == 0


def test_device_touched_counts_the_busiest_device():
    """Touched (layer, expert) pairs as a device reads them: all of them on one device or with
    experts split along F; under expert parallelism the device that touched the most (experts
    d * E / N .. in a block each); under EPLB the mean over devices."""
    import numpy as np

    import bench_moe

    loads = np.zeros((2, 8), np.int32)  # 2 MoE layers, 8 experts
    loads[0, [0, 1, 5]] = 3  # layer 0: experts 0 and 1 (device 0), 5 (device 2)
    loads[1, [1, 7]] = 1  # layer 1: 1 (device 0), 7 (device 3)
    one = argparse.Namespace(tp=None)
    tp = lambda ep: argparse.Namespace(tp=argparse.Namespace(tp=4, expert_parallel=ep), eplb=None)
    assert bench_moe.device_touched(loads, one) == 5
    assert bench_moe.device_touched(loads, tp(False)) == 5
    assert bench_moe.device_touched(loads, tp(True)) == 3  # device 0: (0, 0), (0, 1), (1, 1)
    eplb = argparse.Namespace(tp=argparse.Namespace(tp=4, expert_parallel=True), eplb=object())
    assert bench_moe.device_touched(loads, eplb) == 5 / 4


@pytest.mark.slow
def test_decode_under_expert_parallelism_on_four_devices(tmp_path):
    """bench_moe.py decode -tp 4 --enable-expert-parallel on 4 forced CPU devices: the engine's
    flags reach it, touched experts are a device's (at most its 2 of 8 experts a layer), no
    compiles after warm-up; with EPLB too."""
    import subprocess

    out = tmp_path / "ep.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    base = [sys.executable, os.path.join(ROOT, "scripts", "bench_moe.py"), "decode", "--random-shape",
            "tiny-moe", "--batch-size", "1", "4", "--input-len", "40", "--num-iters", "6", "--copy-gib",
            "0.02", "-tp", "4", "--enable-expert-parallel", "--output-json", str(out)]
    for extra in ([], ["--enable-eplb", "--eplb-config", '{"window_size": 2, "step_interval": 2}']):
        res = subprocess.run(base + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        r = json.load(open(out))
        assert r["devices"] == 4 and r["parallel"]["tensor_parallel_size"] == 4
        assert r["parallel"].get("enable_eplb", False) == bool(extra)
        for row in r["rows"]:
            assert row["touched_of"] == 2 * 2  # 2 MoE layers x a device's 2 of 8 experts (slots)
            assert 0 < row["touched_experts"] <= row["touched_of"]
            assert row["floor_s"] > 0
        assert r["compiles_after_warmup"] == 0
        if extra:
            assert "EPLB: rebalanced" in res.stderr + res.stdout
