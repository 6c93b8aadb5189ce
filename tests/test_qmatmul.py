"""The decode-sized quantized-weight matmul (kernels/qmatmul.py) against x @ the dequantized
weight, in Pallas' interpreter: every weight layout the engine makes or loads (int4 g128 and
g64, GGUF Q4_0 / Q4_1 / Q4_K runs, int8 per channel, Q8_0 / Q6_K / Q5_K groups, fp8 [N, K]
per channel, in HF's 128 x 128 blocks and per tensor), every
shipped tiling, 1 to 64 rows; and its lowering through Triton for the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import quantize as gguf_quantize

from jaxllm.kernels import qmatmul
from jaxllm.quantization import checkpoints
from jaxllm.quantization.quantize import quantize_fp8, quantize_fp8_blocks, quantize_int4, quantize_int8

K, N = 512, 256


def _gguf_k(qtype: str, size: int, rng) -> np.ndarray:
    """Random K-quant blocks [N, bytes] with finite super-block scales."""
    raw = rng.integers(0, 256, (N, K // 256, size), dtype=np.uint8)
    if qtype == "Q6_K":
        raw[..., 208:210] = np.array([0.003], np.float16).view(np.uint8)
    else:
        raw[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)
        raw[..., 2:4] = np.array([0.02], np.float16).view(np.uint8)
    return raw.reshape(N, -1)


def weights() -> dict:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)  # [K, N]
    return {
        "int4_g128": quantize_int4(w, group=128, search=False),
        "int4_g64": quantize_int4(w, group=64, search=False),
        "int8_channel": quantize_int8(w),
        "fp8_channel": quantize_fp8(w, search=1),  # W8A8 in XLA; weight-only in the kernel
        "fp8_block128": quantize_fp8_blocks(w, 128, 128),
        "fp8_tensor": quantize_fp8_blocks(w, N, K),
        "q4_0": checkpoints.gguf_linear(gguf_quantize(w.T, GT.Q4_0), "Q4_0", "w"),
        "q4_1": checkpoints.gguf_linear(gguf_quantize(w.T, GT.Q4_1), "Q4_1", "w"),
        "q8_0": checkpoints.gguf_linear(gguf_quantize(w.T, GT.Q8_0), "Q8_0", "w"),
        "q4_k": checkpoints.gguf_linear(_gguf_k("Q4_K", 144, rng), "Q4_K", "w"),
        "q6_k": checkpoints.gguf_linear(_gguf_k("Q6_K", 210, rng), "Q6_K", "w"),
        "q5_k": checkpoints.gguf_linear(_gguf_k("Q5_K", 176, rng), "Q5_K", "w"),
    }


WEIGHTS = weights()


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Rows are padded to one block of the tiling-independent row count, so every tiling is checked
# at 5 rows (padded) and a few kinds of tiling (plain, unrolled, bit-op conversion, 8 warps) at
# 1 and 64: the cross product took ~130 s of CI in interpret mode for nothing more.
_FEW = {t.name for t in (qmatmul.TILINGS[0], next(t for t in qmatmul.TILINGS if t.unroll > 1),
                          next(t for t in qmatmul.TILINGS if t.magic),
                          next(t for t in qmatmul.TILINGS if t.num_warps == 8))}


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_matches_dequantized_matmul(name, rows):
    w = jax.tree.map(jnp.asarray, WEIGHTS[name])
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, K)), jnp.float32)
    want = qmatmul.reference(x, w)
    fitting = [t for t in qmatmul.TILINGS if qmatmul.unsupported(x.shape, w, t) is None]
    assert fitting, [qmatmul.unsupported(x.shape, w, t) for t in qmatmul.TILINGS]
    if rows != 5:
        fitting = [t for t in fitting if t.name in _FEW] or fitting[:1]
    for t in fitting:
        got = qmatmul.qmatmul(x, w, t, interpret=True)
        assert got.shape == (rows, N) and got.dtype == x.dtype
        # magic int4: x . (128 + q) - 128 sum(x) cancels ~7 bits of float32 (measured 1.2e-5)
        assert rel(got, want) < (1e-4 if t.magic and w.kind == "int4" else 1e-5), (name, t.name)


def test_bf16_rows_and_leading_axes():
    w = jax.tree.map(jnp.asarray, WEIGHTS["int4_g128"])
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, K)), jnp.bfloat16)
    got = qmatmul.qmatmul(x, w, qmatmul.TILINGS[1], interpret=True)
    assert got.shape == (2, 3, N) and got.dtype == jnp.bfloat16
    assert rel(got, qmatmul.reference(x, w)) < 1e-2  # bf16 output rounding


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: d.__name__)
def test_magic_conversion_is_exact(kind, dtype):
    """Bit-operation conversion: every int4 nibble -> 128 + q, every int8 -> q, exactly."""
    if kind == "int4":
        q, want = jnp.arange(16, dtype=jnp.uint8), np.arange(16) + qmatmul.MAGIC_INT4_BIAS
    else:
        q, want = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8), np.arange(-128, 128)
    got = qmatmul.to_float(q, kind, dtype, magic=True)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("name", ["int4_g128", "int8_channel", "q4_k"])
def test_magic_tilings_on_bf16_rows(name):
    w = jax.tree.map(jnp.asarray, WEIGHTS[name])
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, K)), jnp.bfloat16)
    want = qmatmul.reference(x, w)
    magic = [t for t in qmatmul.TILINGS if t.magic and qmatmul.unsupported(x.shape, w, t) is None]
    assert magic
    for t in magic:
        assert rel(qmatmul.qmatmul(x, w, t, interpret=True), want) < 1e-2, t.name  # bf16 output


def test_unsupported_cases_are_named():
    x = jax.ShapeDtypeStruct((1, K), jnp.float32)
    w = WEIGHTS["int4_g128"]
    assert "rows" in qmatmul.unsupported((65, K), w, qmatmul.TILINGS[0])
    assert "block_n" in qmatmul.unsupported(x.shape, w, qmatmul.Tiling(block_n=512))
    assert "k_splits" in qmatmul.unsupported(x.shape, w, qmatmul.Tiling(k_splits=8))  # 512 / 128 runs
    stacked = jax.tree.map(lambda a: np.stack([a, a]), w)
    assert "dims" in qmatmul.unsupported(x.shape, stacked, qmatmul.TILINGS[0])
    with pytest.raises(ValueError, match="qmatmul q_128k1: 65 rows"):
        qmatmul.qmatmul(jnp.zeros((65, K)), w)


@pytest.mark.parametrize("name", ["int4_g128", "int8_channel", "q4_k", "q6_k", "fp8_channel", "fp8_block128"])
def test_lowers_to_triton(name):
    """The GPU path: Pallas' Triton backend lowers the kernel (on this CPU), every shipped
    tiling that takes the layout."""
    w = WEIGHTS[name]
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
    x = jax.ShapeDtypeStruct((8, K), jnp.bfloat16)
    fitting = [t for t in qmatmul.TILINGS if qmatmul.unsupported(x.shape, w, t) is None]
    assert len(fitting) >= 5, [qmatmul.unsupported(x.shape, w, t) for t in qmatmul.TILINGS]
    for t in fitting:
        f = jax.jit(lambda x, w, t=t: qmatmul.qmatmul(x, w, t, interpret=False))
        text = f.trace(x, spec).lower(lowering_platforms=("cuda",)).as_text()
        assert "jaxllm_qmatmul" in text, t.name


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_engine_decode_steps_through_the_kernel(monkeypatch, method):
    """An engine with online int4 / int8 weights whose quantized matmuls take the "pallas" path
    (every linear of both token buckets, 4 and 64 rows) gives the XLA path's greedy ids and
    logprobs, and the kernel really ran."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.quantization import kernels
    from tp_worker import tiny_model

    cfg, sd = tiny_model("llama", 4, 2, hidden=256, inter=512, head_dim=64, layers=2, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompts = [[5, 17, 99, 3, 250, 11], list(range(40, 80))]
    kw = dict(hf_config=cfg, weights=sd, dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(4, 64), seq_buckets=(4,), skip_warmup=True,
              quantization=method)

    def run():
        outs = LLM(**kw).generate(prompts, greedy, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                np.array([[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]))

    want_ids, want_lps = run()
    calls = []
    plain, kernel = kernels.matmul, qmatmul.qmatmul
    monkeypatch.setattr(kernels, "matmul", lambda x, w, path=None: plain(x, w, "pallas"))
    monkeypatch.setattr(qmatmul, "qmatmul", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    got_ids, got_lps = run()
    rows = {int(np.prod(s[:-1])) for s in calls}
    assert rows == {4, 64}, rows  # both buckets are decode-sized (<= MAX_ROWS): the kernel
    assert got_ids == want_ids
    np.testing.assert_allclose(got_lps, want_lps, atol=2e-4)


def test_plain_pallas_path_takes_the_first_tiling_with_enough_ctas():
    """`kernels.pallas_tiling` (the plain "pallas" path): the first fitting tiling in TILINGS order
    with >= min_ctas CTAs, else the fitting one with the most; None when none fits."""
    from jaxllm.quantization.kernels import pallas_tiling

    w = jax.tree.map(jnp.asarray, WEIGHTS["int4_g128"])
    fits = [t for t in qmatmul.TILINGS if qmatmul.unsupported((1, K), w, t) is None]
    ctas = {t: N // t.block_n * t.k_splits for t in fits}
    assert pallas_tiling((1, K), w, min_ctas=1) == fits[0]
    bar = min(c for c in ctas.values() if c > ctas[fits[0]])  # a bar the first fitting tiling misses
    assert pallas_tiling((1, K), w, min_ctas=bar) == next(t for t in fits if ctas[t] >= bar)
    assert pallas_tiling((1, K), w, min_ctas=10 ** 6) == max(fits, key=ctas.get)
    assert pallas_tiling((qmatmul.MAX_ROWS + 1, K), w) is None  # prefill-sized: no tiling fits
