"""Weight quantization (jaxllm/quantization/): quantizers, matmuls, pre-quantized checkpoints
(HF FP8 with 128x128 block scales, GGUF Q8_0/Q4_0/Q4_1) and the start-up errors.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from hf_tiny import make, make_llm

from jaxllm import SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.quantization import checkpoints, methods
from jaxllm.quantization.qarray import QArray
from jaxllm.quantization.quantize import QUANTIZERS

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("method,bound", [("fp8", 0.04), ("int8", 0.01), ("int4", 0.12)])
def test_quantizers_and_matmul(method, bound):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((2, 256, 96)) * np.exp(rng.uniform(-2, 2, (1, 1, 96)))).astype(np.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    qa = QUANTIZERS[method](w)  # numpy, leading layer axis
    assert qa.shape == w.shape
    assert rel(qa.dequantize(), w) < bound
    # The jnp quantizer (the one the runner uses) stores the same values (XLA's division
    # may differ in the last bit, which can move a value at a rounding boundary).
    qj = jax.jit(lambda a: QUANTIZERS[method](a, jnp))(w)
    for a, b in zip(jax.tree.leaves(qa), jax.tree.leaves(qj)):
        a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
        assert a.shape == b.shape and np.mean(~np.isclose(a, b, rtol=1e-3)) < 1e-3
    layer = jax.tree.map(jnp.asarray, qa)[1]  # as split_layers / the scan slice it
    y = jax.jit(lambda x, q: x @ q)(x, layer)  # `@` defers to QArray.__rmatmul__
    if method == "fp8":  # W8A8: activations quantized per token too
        assert rel(y, x @ w[1]) < 2 * bound
        assert rel(y, x @ np.asarray(layer.dequantize())) < 0.05
    else:  # weight-only: exactly x @ dequantized W
        assert rel(y, x @ np.asarray(layer.dequantize())) < 1e-6
        assert rel(y, x @ w[1]) < bound


@pytest.fixture(scope="module")
def tiny():
    _, cfg, sd = make("llama3", seed=3)
    return cfg, sd


def _run(llm, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = np.array([[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs])
    return toks, lps


PROMPTS = [[5, 17, 99, 3, 250, 11], list(range(40, 80))]
ONE_BUCKET = dict(token_buckets=(64,), skip_warmup=True)  # one compile per engine


@pytest.fixture(scope="module")
def float_run(tiny):
    return _run(make_llm(tiny, **ONE_BUCKET), PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "int4"])  # int8 and every mode on SmolLM2: test_quant_quality
def test_engine_online_quantization(tiny, float_run, method):
    llm = make_llm(tiny, quantization=method, **ONE_BUCKET)
    params = llm.engine.runner.params
    assert isinstance(params["layers"]["wq"].get_value(), QArray)
    float_bytes = sum(np.asarray(v).nbytes for k, v in tiny[1].items() if "proj" in k)
    q_bytes = sum(x.nbytes for n, v in params["layers"].items() if n.startswith("w")
                  for x in jax.tree.leaves(v.get_value()))
    assert q_bytes < float_bytes * (0.3 if method != "int4" else 0.2)
    toks, lps = _run(llm, PROMPTS)
    ref_toks, ref_lps = float_run
    assert np.isfinite(lps).all()
    if method != "int4":
        assert toks[0][:3] == ref_toks[0][:3]
    assert not np.array_equal(lps, ref_lps)  # the quantized weights are what ran


def _fp8_block_checkpoint(cfg: dict, sd: dict, block: int = 128) -> tuple[dict, dict]:
    """A random float model quantized the way HF FP8 releases are: e4m3 [out, in] weights
    and float32 weight_scale_inv per 128 x 128 block (partial blocks at the edges)."""
    out = {}
    for name, w in sd.items():
        if checkpoints.is_linear(name):
            o, i = w.shape
            bo, bi = -(-o // block), -(-i // block)
            pad = np.zeros((bo * block, bi * block), np.float32)
            pad[:o, :i] = w
            amax = np.abs(pad.reshape(bo, block, bi, block)).max(axis=(1, 3))
            s = np.maximum(amax, 1e-12) / 448.0
            q = pad / np.repeat(np.repeat(s, block, 0), block, 1)
            out[name] = q[:o, :i].astype(ml_dtypes.float8_e4m3fn)
            out[name[:-len("weight")] + "weight_scale_inv"] = s.astype(np.float32)
        else:
            out[name] = w.astype(ml_dtypes.bfloat16)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [block, block]}
    return {**cfg, "quantization_config": qc}, out


def test_hf_fp8_block_checkpoint_loads_as_stored(tmp_path):
    from safetensors.numpy import save_file

    from tp_worker import tiny_model
    cfg, sd = tiny_model("llama", 4, 2, hidden=256, inter=384, head_dim=64, layers=2, seed=4)
    qcfg, qsd = _fp8_block_checkpoint(cfg, sd)
    save_file(qsd, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(qcfg, f)
    config, weights = checkpoints.load_hf_fp8(str(tmp_path))
    qa = weights["model.layers.1.mlp.up_proj.weight"]
    assert isinstance(qa, QArray) and qa.values.dtype == ml_dtypes.float8_e4m3fn
    assert qa.values.shape == (384, 256) and qa.scale.shape == (3, 2) and qa.shape == (256, 384)
    # The fp8 reference path: the same stored values dequantized in numpy, run as float.
    ref_w = {k: (v.dequantize().T if isinstance(v, QArray) else v) for k, v in weights.items()}
    kw = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              token_buckets=(64,), seq_buckets=(4,), skip_warmup=True)
    from jaxllm import LLM
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140))]
    got = _run(LLM(hf_config=config, weights=weights, **kw), prompts)
    want = _run(LLM(hf_config=config, weights=ref_w, **kw), prompts)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4)
    # ... and the checkpoint is close to the float model it was made from.
    assert rel(ref_w["model.layers.1.mlp.up_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]) < 0.05


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_stay_quantized_and_match_gguf_dequantize(qtype):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((48, 128)).astype(np.float32)  # [out, in]
    raw = gguf_quantize(w, GT[qtype])
    qa = checkpoints.gguf_linear(raw, qtype, "blk.0.ffn_up.weight")
    assert qa.shape == (128, 48) and qa.kind == ("int8" if qtype == "Q8_0" else "int4")
    assert qa.values.nbytes <= raw.nbytes  # stored, not dequantized
    x = rng.standard_normal((3, 128)).astype(np.float32)
    want = x @ gguf_dequantize(raw, GT[qtype]).T
    got = jax.jit(lambda x, q: x @ q)(x, jax.tree.map(jnp.asarray, qa))
    assert rel(got, want) < 1e-6


def test_gguf_q4_k_blocks_match_gguf_dequantize():
    rng = np.random.default_rng(3)
    rows, nb = 24, 2  # in = 512: two 256-value super-blocks per row
    raw = rng.integers(0, 256, (rows, nb, 144), dtype=np.uint8)
    raw[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)  # d, dmin: finite
    raw[..., 2:4] = np.array([0.02], np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    qa = checkpoints.gguf_linear(raw, "Q4_K", "blk.0.ffn_up.weight")
    assert qa.shape == (512, rows) and qa.values.shape == (256, rows)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    want = x @ gguf_dequantize(raw, GT.Q4_K).T
    got = jax.jit(lambda x, q: x @ q)(x, jax.tree.map(jnp.asarray, qa))
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("qtype,size,group", [("Q6_K", 210, 16), ("Q5_K", 176, 32)])
def test_gguf_k_quant_mixes_kept_as_int8_match_gguf_dequantize(qtype, size, group):
    """Q4_K_M / Q5_K_M files hold Q6_K (and Q5_K) linears beside Q4_K ones: kept as int8 values
    with float32 scales (and offsets) per sub-block, exactly gguf's dequantization."""
    rng = np.random.default_rng(5)
    rows, nb = 24, 2  # in = 512: two 256-value super-blocks per row
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    if qtype == "Q6_K":
        raw[..., 208:210] = np.array([0.003], np.float16).view(np.uint8)  # d: finite
    else:
        raw[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)
        raw[..., 2:4] = np.array([0.02], np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    qa = checkpoints.gguf_linear(raw, qtype, "blk.0.ffn_down.weight")
    assert qa.kind == "int8" and qa.values.dtype == np.int8 and qa.shape == (512, rows)
    assert qa.group == group and (qa.offset is None) == (qtype == "Q6_K")
    want_w = gguf_dequantize(raw, GT[qtype])  # [out, in]
    np.testing.assert_array_equal(qa.dequantize().T, want_w)
    assert len(np.unique(qa.values)) > 30  # the high bits are used: 6- / 5-bit values
    x = rng.standard_normal((3, 512)).astype(np.float32)
    got = jax.jit(lambda x, q: x @ q)(x, jax.tree.map(jnp.asarray, qa))
    assert rel(got, x @ want_w.T) < 1e-6


def test_gguf_type_without_kernel_is_named():
    with pytest.raises(ValueError, match="Q3_K"):
        checkpoints.gguf_linear(np.zeros((4, 110), np.uint8), "Q3_K", "blk.0.ffn_down.weight")


def test_bad_methods_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown quantization 'fp6'"):
        EngineConfig(quantization="fp6")
    with pytest.raises(ValueError, match="'awq' is not supported"):
        EngineConfig(quantization="awq")
    for method in ("awq", "gptq", "bitsandbytes"):
        d = tmp_path / method
        d.mkdir()
        with open(d / "config.json", "w") as f:
            json.dump({"model_type": "llama", "quantization_config": {"quant_method": method}}, f)
        with pytest.raises(ValueError, match=f"quant_method '{method}' is not supported"):
            checkpoints.load_prequantized(str(d), None)
    with pytest.raises(ValueError, match="needs a .gguf"):
        checkpoints.load_prequantized(str(tmp_path / "awq"), "gguf")


def test_fp8_needs_fp8_hardware():
    class Ampere:
        platform, device_kind, compute_capability = "gpu", "NVIDIA A100", "8.0"

    class Hopper(Ampere):
        device_kind, compute_capability = "NVIDIA H200", "9.0"

    with pytest.raises(ValueError, match="fp8 support.*A100"):
        methods.check_fp8_device("quantization='fp8'", Ampere())
    methods.check_fp8_device("quantization='fp8'", Hopper())


def test_int4_constant_groups_quantize_exactly_without_warnings():
    """A group whose values are all equal (pruned or zero-padded weights) has a zero range: its
    scale is floored at float16's smallest subnormal, not 0, so nothing divides by zero."""
    import warnings
    from jaxllm.quantization.quantize import quantize_int4

    w = np.zeros((256, 8), np.float32)
    w[:, 1] = 0.25
    w[128:, 2] = np.linspace(-1, 1, 128)
    for xp in (np, jnp):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            qa = quantize_int4(w, xp, group=128)
        got = np.asarray(qa.dequantize())
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got[:, :2], w[:, :2])
        np.testing.assert_allclose(got[:, 2], w[:, 2], atol=1 / 15 + 1e-3)


def _unrolled_search(w, method, xp=np):
    """The scale searches as they were written before the loop (every candidate's values kept
    beside its error, the least per slice picked by `where`): the definition the looped
    search must reproduce bit for bit, with the same array module (numpy, or jnp under jit)."""
    from jaxllm.quantization.qarray import FP8_MAX
    from jaxllm.quantization.quantize import FP8_SEARCH, INT4_SHRINK

    w = xp.asarray(w).astype(np.float32)
    best = None

    def keep(cand, e, rows):  # the least error so far, per slice
        if best is None:
            return (*cand, e)
        better = e < best[-1]
        pick = [xp.where(better[:, None, :] if rows and c.ndim == 3 else better, c, b)
                for c, b in zip(cand, best)]
        return (*pick, xp.where(better, e, best[-1]))

    if method == "fp8":
        s0 = xp.maximum(xp.abs(w).max(axis=-2, keepdims=True), 1e-12) / FP8_MAX
        for i in range(FP8_SEARCH):
            s = s0 * np.float32(1 + i / FP8_SEARCH)
            q = xp.clip(w / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
            e = ((q.astype(np.float32) * s - w) ** 2).sum(axis=-2, keepdims=True)
            best = keep((q, s), e, False)
        return best[0].swapaxes(-1, -2), best[1].swapaxes(-1, -2)
    k, n = w.shape
    blocks = w.reshape(k // 128, 128, n)
    lo, hi = blocks.min(axis=-2), blocks.max(axis=-2)
    for a in INT4_SHRINK[0]:
        for c in INT4_SHRINK[1]:
            s = xp.maximum((hi * np.float32(a) - lo * np.float32(c)) / 15.0, 2.0 ** -24)
            s, o = s.astype(np.float16), (lo * np.float32(c)).astype(np.float16)
            sf, of = s.astype(np.float32)[:, None, :], o.astype(np.float32)[:, None, :]
            q = xp.clip(xp.round((blocks - of) / sf), 0, 15)
            best = keep((q, s, o), ((q * sf + of - blocks) ** 2).sum(axis=-2), True)
    return best[0].astype(np.uint8).reshape(k, n), best[1], best[2]


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_scale_search_loop_matches_unrolled_and_stays_small(method):
    """The fp8 and int4 scale searches (numpy, and jnp under jit, where the candidates run in a
    fori_loop) pick exactly what the unrolled search picks, and under jit need a few weights'
    worth of temporary memory, not one per candidate (the unrolled search took 62x the float32
    weight for int4 and 17x for fp8: a 4096 x 28672 int4 weight asked an H100 for 29 GiB)."""
    from jaxllm.quantization.qarray import unpack_int4
    from jaxllm.quantization.quantize import quantize_fp8, quantize_int4

    rng = np.random.default_rng(27)
    w = rng.standard_normal((512, 384)) * np.exp(rng.standard_normal((1, 384)))
    w = w.astype(np.float32)
    w[:, :8] *= 40  # outlier channels, so the search picks different candidates per slice
    f = (lambda w, xp: quantize_fp8(w, xp)) if method == "fp8" else (
        lambda w, xp: quantize_int4(w, xp, group=128))
    jitted = (jax.jit(lambda w: f(w, jnp))(jnp.asarray(w)),
              jax.jit(lambda w: _unrolled_search(w, method, jnp))(jnp.asarray(w)))
    for got, want, ulp in ((f(w, np), _unrolled_search(w, method), 0), (*jitted, 2)):
        want = [np.asarray(x) for x in want]
        if method == "fp8":
            np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8),
                                          want[0].view(np.uint8))
            # under jit XLA folds the unrolled search's constant factors into s0's division
            # (a / 448 * c): its scales may differ in the last bit; the values may not
            np.testing.assert_array_max_ulp(np.asarray(got.scale), want[1], maxulp=ulp)
        else:
            q = np.asarray(unpack_int4(jnp.asarray(got.values), 128))
            np.testing.assert_array_equal(q, want[0])
            np.testing.assert_array_equal(np.asarray(got.scale), want[1])
            np.testing.assert_array_equal(np.asarray(got.offset), want[2])
    picked = np.unique(np.asarray(want[1]).reshape(-1)).size
    assert picked > 8, "the test's weight should make the search pick several candidates"
    spec = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16)
    mem = jax.jit(lambda w: f(w, jnp)).lower(spec).compile().memory_analysis()
    assert mem.temp_size_in_bytes <= 4 * 1024 * 2048 * 4, mem.temp_size_in_bytes
