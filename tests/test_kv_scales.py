"""Per-layer K/V scales of fp8 KV pages (kernels/kv_quant.py, models/llama.py `_attention`).

fp8 pages hold k / k_scale and v / v_scale; attention runs on the pages as stored with
q * k_scale and multiplies its output by v_scale. Scales come from the checkpoint
(`...self_attn.k_scale` / `...self_attn.attn.k_scale`) or from the first batch
(`calculate_kv_scales`: amax / fp8 max), and are step data: nothing compiles after warm-up.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf_tiny import make, make_llm

from jaxllm import SamplingParams
from jaxllm.models.llama_state import checkpoint_kv_scales

L = 2
ENGINE = dict(token_buckets=(64,), seq_buckets=(8,))


@pytest.fixture(scope="module")
def tiny():
    _, cfg, sd = make("llama3", seed=3)
    return cfg, sd


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 384, size=n).tolist() for n in (40, 25, 60, 33, 50, 20)]


def scaled(sd: dict, ck: list[float], cv: list[float]) -> dict:
    """The same model with layer i's K (V) projection times ck[i] (cv[i]) and Q (O) divided by
    it: attention is unchanged in exact arithmetic, and K/V values grow by those factors."""
    out = dict(sd)
    for i in range(L):
        p = f"model.layers.{i}.self_attn."
        out[p + "k_proj.weight"] = sd[p + "k_proj.weight"] * np.float32(ck[i])
        out[p + "q_proj.weight"] = sd[p + "q_proj.weight"] / np.float32(ck[i])
        out[p + "v_proj.weight"] = sd[p + "v_proj.weight"] * np.float32(cv[i])
        out[p + "o_proj.weight"] = sd[p + "o_proj.weight"] / np.float32(cv[i])
    return out


def run(llm, prompts, max_tokens=1):
    """(greedy tokens, each first token's top-20 logprobs {id: logprob})."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=20,
                                                ignore_eos=True), use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs])


def logprob_error(got: list[dict], want: list[dict]) -> float:
    """Mean |logprob difference| over the reference's top-5 next tokens of each prompt (a token
    that fell out of the top 20 counts with the 20th logprob, a lower bound on its error)."""
    errs = []
    for g, w in zip(got, want):
        for t in sorted(w, key=w.get, reverse=True)[:5]:
            errs.append(abs(g.get(t, min(g.values())) - w[t]))
    return float(np.mean(errs))


def test_checkpoint_scales_are_read_and_applied_exactly(tiny, prompts, tmp_path):
    """A safetensors checkpoint whose K/V projections are scaled by powers of two (K up to
    1024x: far beyond fp8's 448 unscaled) and that ships the matching k_scale / v_scale (both
    spellings) runs bit-for-bit like the unscaled model on fp8 pages: k / k_scale is the
    unscaled k exactly, and so are q * k_scale and the output times v_scale."""
    from safetensors.numpy import save_file

    from jaxllm.models.hf_files import load_hf_folder
    from jaxllm.quantization.checkpoints import hf_fp8_weights

    cfg, sd = tiny
    ck, cv = [1024.0, 512.0], [256.0, 2048.0]
    ckpt = scaled(sd, ck, cv)
    ckpt["model.layers.0.self_attn.k_scale"] = np.array(ck[0], np.float32)  # HF / ModelOpt
    ckpt["model.layers.0.self_attn.v_scale"] = np.array(cv[0], np.float32)
    ckpt["model.layers.1.self_attn.attn.k_scale"] = np.array([ck[1]], np.float32)  # vLLM's naming
    ckpt["model.layers.1.self_attn.attn.v_scale"] = np.array([cv[1]], np.float32)
    save_file({k: np.ascontiguousarray(v) for k, v in ckpt.items()}, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    _, weights = load_hf_folder(str(tmp_path))
    assert checkpoint_kv_scales(weights, L).tolist() == [[ck[0], cv[0]], [ck[1], cv[1]]]
    # FP8 checkpoints keep the scales too (they used to be dropped).
    kept = hf_fp8_weights({"model.layers.0.self_attn.k_scale": np.array(2.0, np.float32)})
    assert float(kept["model.layers.0.self_attn.k_scale"]) == 2.0

    want_ids, want_lp = run(make_llm(tiny, kv_cache_dtype="fp8", **ENGINE), prompts, 6)
    llm = make_llm((cfg, dict(weights)), kv_cache_dtype="fp8", **ENGINE)
    np.testing.assert_array_equal(llm.engine.runner.kv_scales, [[ck[0], cv[0]], [ck[1], cv[1]]])
    ids, lp = run(llm, prompts, 6)
    assert ids == want_ids
    assert logprob_error(lp, want_lp) < 1e-5
    assert llm.stats()["compiles_after_warmup"] == 0


def test_a_k_scale_without_its_v_scale_is_named(tiny):
    _, sd = tiny
    weights = {**sd, "model.layers.1.self_attn.attn.k_scale": np.array(2.0, np.float32)}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.attn\.k_scale but no v scale"
                                         r".*model\.layers\.1\.self_attn\.v_scale"):
        checkpoint_kv_scales(weights, L)
    assert checkpoint_kv_scales(sd, L).tolist() == [[1.0, 1.0]] * L  # none: 1.0


def test_calculate_kv_scales_recovers_values_beyond_fp8_range(tiny, prompts):
    """K and V 30000x larger (amax ~ 15000 >> 448): with scale 1.0 they are clipped and the
    next-token logprobs drift from the float engine's; calibrated on the first batch they are as
    close as fp8 pages of the unscaled model. Calibration runs once, inside the warmed-up step."""
    cfg, sd = tiny
    big = (cfg, scaled(sd, [30000.0] * L, [30000.0] * L))
    _, want = run(make_llm(big, **ENGINE), prompts)  # float pages: the reference
    _, clipped = run(make_llm(big, kv_cache_dtype="fp8", **ENGINE), prompts)
    llm = make_llm(big, kv_cache_dtype="fp8", calculate_kv_scales=True, **ENGINE)
    runner = llm.engine.runner
    assert runner.kv_scales.tolist() == [[0.0, 0.0]] * L  # not calibrated: warm-up steps are padding
    traces = runner.num_traces
    _, got = run(llm, prompts)
    scales = runner.kv_scales
    assert np.all(scales > 448 / 448) and np.all(scales < 30000), scales  # amax / 448, amax >> 448
    err_clipped, err = logprob_error(clipped, want), logprob_error(got, want)
    assert err < 0.005 and err_clipped > 10 * err, (err, err_clipped)
    # Once: a later batch with other values keeps the first batch's scales.
    run(llm, [p[::-1] + p for p in prompts[:2]], 4)
    np.testing.assert_array_equal(runner.kv_scales, scales)
    assert runner.num_traces == traces and llm.stats()["compiles_after_warmup"] == 0


def test_cli_flag():
    import argparse

    from jaxllm.engine.arg_utils import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--calculate-kv-scales"]))["calculate_kv_scales"] is True
    assert "calculate_kv_scales" not in engine_kwargs(p.parse_args([]))
