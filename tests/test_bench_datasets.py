"""Benchmark workloads (vLLM's random / jsonl datasets) and the run roofline, on CPU."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from jaxllm.benchmarks.datasets import (add_dataset_args, jsonl_dataset, length_range, load_dataset,
                                        percentiles, random_dataset)
from jaxllm.benchmarks.roofline import ModelCost, StepRecorder, run_floor, step_cost


@pytest.mark.parametrize("n,ratio", [(544, 0.88), (288, 0.88), (100, 0.0), (7, 0.5), (1000, 0.1)])
def test_random_lengths_follow_the_range_ratio(n, ratio):
    samples = random_dataset(4000, n, n, ratio, vocab_size=1000, seed=1)
    lens = np.array([len(s.prompt) for s in samples])
    outs = np.array([s.output_len for s in samples])
    low, high = max(1, int(np.floor(n * (1 - ratio)))), int(np.ceil(n * (1 + ratio)))
    for a in (lens, outs):
        assert a.min() >= low and a.max() <= high
        if ratio == 0:
            assert (a == n).all()
        else:  # uniform: both ends reached, mean in the middle, quartiles where uniform puts them
            assert a.min() <= low + (high - low) * 0.01 + 1 and a.max() >= high - (high - low) * 0.01 - 1
            assert abs(a.mean() - (low + high) / 2) < 0.03 * (high - low) + 1
            assert abs(np.percentile(a, 25) - (low + 0.25 * (high - low))) < 0.05 * (high - low) + 1
    assert all(100 <= t < 900 for s in samples[:50] for t in s.prompt)  # ids inside the vocabulary


@pytest.mark.parametrize("ratio", [1.0, 1.5, -0.1])
def test_ratio_outside_unit_interval_is_refused(ratio):
    with pytest.raises(ValueError, match=r"random-range-ratio must be in \[0, 1\)"):
        random_dataset(4, 10, 10, ratio, vocab_size=100)
    with pytest.raises(ValueError, match="random-range-ratio"):
        length_range(10, ratio)


def test_flags_and_jsonl(tmp_path):
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    a = p.parse_args(["--input-len", "20", "--output-len", "5", "--num-prompts", "3"])  # old names alias
    assert (a.random_input_len, a.random_output_len) == (20, 5)
    assert [len(s.prompt) for s in load_dataset(a, 500)] == [20, 20, 20]
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hello", "output_len": 7}\nplain text line\n\n{"prompt": [1, 2, 3], "max_tokens": 2}\n')
    got = jsonl_dataset(str(f), None, 9)
    assert [(s.prompt, s.output_len) for s in got] == [("hello", 7), ("plain text line", 9), ([1, 2, 3], 2)]
    a = p.parse_args(["--dataset-name", "jsonl", "--dataset-path", str(f), "--num-prompts", "2"])
    assert len(load_dataset(a, 500)) == 2
    f.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        jsonl_dataset(str(f), None, 9)


def test_percentiles():
    d = percentiles(list(range(1, 101)), scale=1.0)
    assert d["p50"] == pytest.approx(50.5) and d["p90"] == pytest.approx(90.1) and d["p99"] == pytest.approx(99.01)
    assert percentiles([])["p50"] is None


def test_step_cost_by_hand():
    c = ModelCost(weight_bytes=1000, matmul_params=10, head_params=4, kv_bytes_per_token=2, attn_flops_per_pair=3)
    # one prefill chunk of 4 tokens ending at position 6 (sampled), one decode row at context 9
    b, f = step_cost(c, (5, [(4, 6, True), (1, 9, False)]))
    pairs = (4 * 6 - 4 * 3 / 2) + 9
    assert f == 2 * 10 * 5 + 2 * 4 * 1 + 3 * pairs
    assert b == 1000 + 2 * (6 + 9 + 5)
    r = run_floor(c, [(5, [(4, 6, True), (1, 9, False)])] * 3, copy_bytes_per_s=100.0, matmul_flops_per_s=1e9)
    assert r["floor_s"] == pytest.approx(3 * b / 100.0) and r["memory_bound_steps"] == 3


def test_recorder_sees_every_scheduled_token():
    from jaxllm import LLM, SamplingParams

    llm = LLM(random_shape="tiny", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
    rec = StepRecorder(llm.engine)
    samples = random_dataset(6, 30, 5, 0.5, vocab_size=512, seed=3)
    llm.generate([{"prompt_token_ids": s.prompt} for s in samples],
                 [SamplingParams(max_tokens=s.output_len, ignore_eos=True) for s in samples], use_tqdm=False)
    tokens = sum(t for t, _ in rec.steps)
    assert tokens == sum(len(s.prompt) + s.output_len - 1 for s in samples)
    assert all(t == sum(q for q, _, _ in rows) for t, rows in rec.steps)
    assert max(end for _, rows in rec.steps for _, end, _ in rows) <= max(len(s.prompt) + s.output_len for s in samples)
    cost = ModelCost.of_runner(llm.engine.runner)
    assert cost.weight_bytes == llm.engine.runner.weight_bytes and cost.kv_bytes_per_token > 0
    assert len(rec.times) == len(rec.steps) and rec.times == sorted(rec.times)


def test_breakdown_by_kind_of_step():
    """Steps split into decode / mixed / prefill; each gets the interval `lag` calls later."""
    from jaxllm.benchmarks.roofline import breakdown, step_kind

    c = ModelCost(weight_bytes=1000, matmul_params=10, head_params=4, kv_bytes_per_token=2, attn_flops_per_pair=3)
    pre, mixed, dec = (8, [(8, 8, True)]), (5, [(4, 6, True), (1, 9, True)]), (2, [(1, 9, True), (1, 3, True)])
    assert [step_kind(s) for s in (pre, mixed, dec)] == ["prefill", "mixed", "decode"]
    steps, times = [pre, mixed, dec, dec], [0.0, 1.0, 3.0, 3.5]
    sync = breakdown(c, steps, times, 4.5, 100.0, 1e9, lag=0)
    assert sync["prefill"]["measured_s"] == 1.0 and sync["mixed"]["measured_s"] == 2.0
    assert sync["decode"]["measured_s"] == pytest.approx(1.5) and sync["decode"]["steps"] == 2
    assert sync["decode"]["floor_s"] == pytest.approx(2 * step_cost(c, dec)[0] / 100.0)
    lagged = breakdown(c, steps, times, 4.5, 100.0, 1e9, lag=1)  # step k gets the interval after k + 1
    assert lagged["prefill"]["measured_s"] == 2.0 and lagged["mixed"]["measured_s"] == 0.5
    assert lagged["decode"]["measured_s"] == 1.0 and lagged["decode"]["x_floor"] > 0


def test_serving_floor_of_a_config():
    """bench_serving.py --roofline-shape's floor: prompts cost their FLOPs, outputs decode steps."""
    from jaxllm.benchmarks.roofline import cost_of_config, serving_floor
    from jaxllm.models.shapes import get_shape

    cost = cost_of_config(get_shape("tiny"))
    assert cost.weight_bytes > 0 and cost.kv_bytes_per_token > 0
    r = serving_floor(cost, [32, 64], [8, 8], 2.0, copy_bytes_per_s=1e9, matmul_flops_per_s=1e12)
    assert r["decode_steps"] == 8 and r["floor_s"] > r["prefill_floor_s"] > 0


def test_throughput_with_quantized_weights_and_kv(tmp_path, monkeypatch):
    """bench_throughput.py --quantization / --kv-cache-dtype (vLLM's flags) reach the engine, the
    run is labelled with them, and the roofline counts the bytes the engine holds (fewer weight
    and K/V bytes than bf16's)."""
    import os
    import sys

    from jaxllm import LLM

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_throughput

    out = str(tmp_path / "q.json")
    monkeypatch.setattr(sys, "argv", ["x", "--random-shape", "tiny", "--num-prompts", "3", "--input-len", "8",
                                      "--output-len", "3", "--dtype", "float32", "--max-num-seqs", "4",
                                      "--max-num-batched-tokens", "32", "--no-roofline", "--quantization", "fp8",
                                      "--kv-cache-dtype", "fp8", "--output-json", out])
    bench_throughput.main()
    res = json.load(open(out))
    assert res["jaxllm"]["engine"] == "jaxllm (async on, fp8 weights, fp8 KV)"
    assert res["jaxllm"]["output_tokens"] == 9 and res["args"]["quantization"] == "fp8"
    costs = [ModelCost.of_runner(LLM(random_shape="tiny", max_model_len=64, max_num_seqs=2,
                                     max_num_batched_tokens=32, **kw).engine.runner)
             for kw in ({}, dict(quantization="fp8", kv_cache_dtype="fp8"))]
    assert costs[1].weight_bytes < costs[0].weight_bytes
    assert costs[1].kv_bytes_per_token < costs[0].kv_bytes_per_token
