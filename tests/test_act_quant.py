"""The fused activation quantization (kernels/act_quant.py, quantization/act.py): the kernels in
Pallas' interpreter against their jnp references, their Triton lowering for cuda, and the
model handing fp8 W8A8 linears their inputs quantized once by the norm / silu*mul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import greedy_with_logprobs, make, make_llm, unrolled_layers

from jaxllm import SamplingParams
from jaxllm.kernels import act_quant as aq
from jaxllm.quantization import act
from jaxllm.quantization.qarray import QArray

SHAPES = [(3, 576), (2, 14336), (1, 4096), (5, 192)]  # one- and many-chunk rows, odd row counts


def _inputs(T, K, dtype):
    ks = jax.random.split(jax.random.key(T * K), 3)
    x = (3 * jax.random.normal(ks[0], (T, K))).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(ks[1], (K,))).astype(dtype)
    g = jax.random.normal(ks[2], (T, K)).astype(dtype)
    return x, w, g


@pytest.mark.parametrize("T,K", SHAPES)
def test_float32_rows_match_the_reference_exactly(T, K):
    """Without bf16 roundings between the ops, kernel and reference are the same arithmetic."""
    x, w, g = _inputs(T, K, jnp.float32)
    for (q, s), (qr, sr) in ((aq.norm_quant(x, w, 1e-5, interpret=True), aq.norm_quant_ref(x, w, 1e-5)),
                             (aq.silu_mul_quant(g, x, interpret=True), aq.silu_mul_quant_ref(g, x))):
        assert q.dtype == jnp.float8_e4m3fn and q.shape == (T, K) and s.shape == (T, 1)
        np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)
        assert np.mean(np.asarray(q.astype(jnp.float32)) != np.asarray(qr.astype(jnp.float32))) < 1e-3


@pytest.mark.parametrize("T,K", SHAPES)
def test_bf16_rows_dequantize_to_the_reference_within_fp8_rounding(T, K):
    """bf16: where a product is rounded may differ by a bf16 ulp; the dequantized rows stay
    within half an fp8 (e4m3) step of the reference's float rows."""
    x, w, g = _inputs(T, K, jnp.bfloat16)
    for (q, s), y in ((aq.norm_quant(x, w, 1e-5, interpret=True), aq.rms_norm_ref(x, w, 1e-5)),
                      (aq.silu_mul_quant(g, x, interpret=True), jax.nn.silu(g) * x)):
        y = np.asarray(y.astype(jnp.float32))
        s = np.asarray(s)
        np.testing.assert_allclose(s[:, 0], np.abs(y).max(-1) / 448.0, rtol=2 ** -7)
        deq = np.asarray(q.astype(jnp.float32)) * s
        bound = np.maximum(np.abs(y) * (2 ** -4 + 2 ** -7), s * 2 ** -9)
        assert (np.abs(deq - y) <= bound).all()
        assert np.abs(deq).max() > 0


def test_lowers_for_cuda():
    """Triton's lowering (power-of-two blocks, fp8 stores) runs at export, no GPU needed."""
    x = jnp.zeros((16, 14336), jnp.bfloat16)
    w = jnp.zeros((14336,), jnp.bfloat16)
    for f, args in ((lambda x, w: aq.norm_quant(x, w, 1e-5), (x, w)),
                    (lambda g, u: aq.silu_mul_quant(g, u), (x, x)),
                    (lambda x, w: aq.norm_quant(x, w, 1e-5), (x[:, :4096], w[:4096])),
                    (lambda gu: aq.silu_mul_quant(gu), (jnp.zeros((4, 57344), jnp.bfloat16),)),
                    (lambda g, u: aq.silu_mul_quant(g, u, hold="bfloat16", warps=8), (x, x))):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "jaxllm_act_quant" in text


def test_takes_rows_only_per_channel_fp8_w8a8():
    fp8 = QArray(jnp.zeros((8, 16), jnp.float8_e4m3fn), jnp.ones((8, 1)), kind="fp8", act="fp8")
    blocks = QArray(jnp.zeros((256, 256), jnp.float8_e4m3fn), jnp.ones((2, 2)), kind="fp8")
    assert act.takes_rows(fp8)
    assert not act.takes_rows(blocks) and not act.takes_rows(jnp.zeros((16, 8)))
    x = jnp.ones((4, 16))
    assert isinstance(act.norm(x, jnp.ones((16,)), 1e-5, fp8), act.Fp8Rows)
    assert isinstance(act.norm(x, jnp.ones((16,)), 1e-5, [fp8, fp8]), act.Fp8Rows)
    assert isinstance(act.norm(x, jnp.ones((16,)), 1e-5, blocks), jax.Array)
    assert isinstance(act.norm(x, jnp.ones((16,)), 1e-5, [fp8, blocks]), jax.Array)  # one does not
    assert isinstance(act.norm(x, jnp.ones((16,)), 1e-5, []), jax.Array)


@pytest.mark.parametrize("path,quantized", [("xla", True), ("mosaic/t", True), ("ws/t", True),
                                            ("pallas/t", False), ("mgpu", False)])
def test_rows_only_for_paths_that_quantize_x(monkeypatch, path, quantized):
    """A decode-sized step whose measured path is a weight-only kernel (x in bf16) gets the
    plain norm; a path that quantizes x per token gets the rows."""
    from jaxllm.quantization import kernels as qk
    fp8 = QArray(jnp.zeros((8, 16), jnp.float8_e4m3fn), jnp.ones((8, 1)), kind="fp8", act="fp8")
    monkeypatch.setattr(qk, "path_for", lambda x_shape, w: path)
    h = act.norm(jnp.ones((4, 16)), jnp.ones((16,)), 1e-5, fp8)
    assert isinstance(h, act.Fp8Rows) == quantized
    g = act.silu_mul(jnp.ones((4, 16)), jnp.ones((4, 16)), fp8)
    assert isinstance(g, act.Fp8Rows) == quantized


def test_fp8_rows_matmul_equals_the_matmuls_own_quantization():
    ks = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(ks[0], (6, 64))
    w = QArray(jax.random.normal(ks[1], (32, 64)).astype(jnp.float8_e4m3fn), jnp.full((32, 1), 0.01),
               kind="fp8", act="fp8")
    rows = act.Fp8Rows(*aq.quantize_ref(x), x.dtype)
    np.testing.assert_array_equal(np.asarray(rows @ w), np.asarray(x @ w))
    assert (rows @ w).dtype == x.dtype


@pytest.mark.slow
def test_engine_fp8_takes_fused_rows(monkeypatch):
    """An fp8 engine quantizes each norm's / silu*mul's output once (traced: the references run),
    and its greedy tokens and logprobs equal those of each matmul quantizing its own input."""
    calls = {"norm": 0, "silu": 0}
    real_norm, real_silu = aq.norm_quant_ref, aq.silu_mul_quant_ref

    def norm(*a, **k):
        calls["norm"] += 1
        return real_norm(*a, **k)

    def silu(*a, **k):
        calls["silu"] += 1
        return real_silu(*a, **k)
    monkeypatch.setattr(aq, "norm_quant_ref", norm)
    monkeypatch.setattr(aq, "silu_mul_quant_ref", silu)
    _, cfg, sd = make("llama3", seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    prompts = [[5, 17, 99, 3, 250, 11], list(range(40, 80))]

    def run(mode):
        monkeypatch.setenv("JAXLLM_ACT_QUANT", mode)
        llm = make_llm((cfg, sd), quantization="fp8", token_buckets=(64,), skip_warmup=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                for o in outs]
    plain = run("xla")
    assert calls == {"norm": 0, "silu": 0}
    fused = run("kernel")
    assert calls["norm"] >= 2 and calls["silu"] >= 1  # both norms of a layer, and before down
    assert fused == plain


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2"])  # q/k/v biases ride with the fused matmul
def test_unrolled_fp8_fuses_qkv_and_gate_up(monkeypatch, arch):
    """The accelerator layout (unrolled, forced here) holds fp8 W8A8 q/k/v and gate/up as one
    QArray each by default (`act.fuse`), and its greedy output equals the scanned layout's separate matmuls."""
    from jaxllm import LLM

    _, cfg, sd = make(arch, seed=5)
    kw = dict(hf_config=cfg, weights=sd, dtype="float32", max_model_len=128, max_num_seqs=4,
              token_buckets=(64,), seq_buckets=(4,), skip_warmup=True, quantization="fp8")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 250, 11], list(range(40, 80))]

    scanned = greedy_with_logprobs(LLM(**kw), prompts, greedy)
    unrolled_layers(monkeypatch)
    llm = LLM(**kw)
    layer = llm.engine.runner.layer_params[0]
    assert {"wqkv", "w_gu", "bqkv"} <= set(layer) and not {"wq", "wk", "w_gate", "w_up"} & set(layer)
    assert isinstance(layer["wqkv"], QArray) and layer["wqkv"].values.shape[0] == (
        (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["hidden_size"] // cfg["num_attention_heads"])
    unrolled = greedy_with_logprobs(llm, prompts, greedy)
    assert unrolled[0] == scanned[0]
    np.testing.assert_allclose(unrolled[1], scanned[1], atol=1e-5)
    monkeypatch.setenv("JAXLLM_FUSE_FP8", "0")  # the opt-out keeps them apart
    assert act.fuse([layer["wqkv"], layer["wqkv"]]) is None


@pytest.mark.parametrize("T,F", [(3, 192), (2, 14336)])
def test_fused_gate_up_halves(T, F):
    """A fused gate/up matmul's [T, 2F] output read in place: the same as the two halves."""
    x, _, g = _inputs(T, 2 * F, jnp.float32)
    q, s = aq.silu_mul_quant(x, interpret=True)
    q2, s2 = aq.silu_mul_quant(x[:, :F], x[:, F:], interpret=True)
    qr, sr = aq.silu_mul_quant_ref(x)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), np.asarray(q2.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)
    assert q.shape == (T, F)


def test_supported_widths():
    assert aq.supported(4096) is None and aq.supported(14336) is None and aq.supported(576) is None
    assert aq.supported(4104) is not None  # 8 x 513: chunks of 8
    assert [aq.num_warps(k) for k in (576, 4096, 8192, 14336)] == [4, 4, 8, 16]


def test_bad_switches_are_named(monkeypatch):
    fp8 = QArray(jnp.zeros((8, 16), jnp.float8_e4m3fn), jnp.ones((8, 1)), kind="fp8", act="fp8")
    monkeypatch.setenv("JAXLLM_ACT_QUANT", "fast")
    with pytest.raises(ValueError, match="JAXLLM_ACT_QUANT"):
        act.norm(jnp.ones((4, 16)), jnp.ones((16,)), 1e-5, fp8)
    monkeypatch.setenv("JAXLLM_FUSE_FP8", "yes")
    with pytest.raises(ValueError, match="JAXLLM_FUSE_FP8"):
        act.fuse([fp8, fp8])


def test_silu_mul_variants_agree():
    """The benchmark's register variants (y held in bf16, other warp counts) compute the same rows
    within a bf16 rounding of y."""
    x, _, g = _inputs(2, 14336, jnp.bfloat16)
    q, s = aq.silu_mul_quant(g, x, interpret=True)
    qb, sb = aq.silu_mul_quant(g, x, interpret=True, hold="bfloat16", warps=8)
    np.testing.assert_allclose(np.asarray(sb), np.asarray(s), rtol=2 ** -8)
    a, b = (np.asarray(v.astype(jnp.float32)) * np.asarray(t) for v, t in ((q, s), (qb, sb)))
    assert (np.abs(a - b) <= np.maximum(np.abs(a), np.abs(b)) * 2 ** -3 + np.asarray(s) * 2 ** -8).all()  # one fp8 step


@pytest.mark.parametrize("T", [1, 5])
def test_padded_rows_for_the_mosaic_decode_matmul(monkeypatch, T):
    """`out_rows`: the kernels (interpreter) and references write padding rows of zeros past T;
    act.norm pads only when every consumer takes the Mosaic fp8 decode matmul, and that matmul
    then uses the rows as they are, with the same product as rows it pads itself."""
    from jaxllm.kernels import qmatmul_mosaic as qm
    from jaxllm.quantization import kernels as qk

    ks = jax.random.split(jax.random.key(T), 3)
    x = jax.random.normal(ks[0], (T, 256), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (256,), jnp.float32).astype(jnp.bfloat16)
    for fn, ref, args in ((aq.norm_quant, aq.norm_quant_ref, (x, w)), (aq.silu_mul_quant, aq.silu_mul_quant_ref, (x, x))):
        kw = dict(eps=1e-5) if fn is aq.norm_quant else {}
        q, s = fn(*args, interpret=True, out_rows=8, **kw)
        q0, s0 = fn(*args, interpret=True, **kw)
        assert q.shape == (8, 256) and s.shape == (8, 1)
        np.testing.assert_array_equal(np.asarray(q[:T], np.float32), np.asarray(q0, np.float32))
        np.testing.assert_array_equal(np.asarray(s[:T]), np.asarray(s0))
        assert not np.asarray(q[T:], np.float32).any() and not np.asarray(s[T:]).any()
        rq, rs = ref(*args, out_rows=8, **kw)
        np.testing.assert_array_equal(np.asarray(rq[T:], np.float32), np.asarray(q[T:], np.float32))
        assert rs.shape == (8, 1)

    wq = QArray(jax.random.normal(ks[2], (128, 256)).astype(jnp.float8_e4m3fn), jnp.full((128, 1), 0.01),
                kind="fp8", act="fp8")
    monkeypatch.setattr(qk, "path_for", lambda x_shape, w: "xla")
    assert act.padded_for(wq, (T, 256)) == 0  # another path: the rows as they are
    monkeypatch.setattr(qk, "path_for", lambda x_shape, w: "mosaic/" + qm.Tiling(64, 256, 2, 1).name)
    assert act.padded_for(wq, (T, 256)) == 8 and act.padded_for([wq, wq], (T, 256)) == 8
    assert act.padded_for(wq, (8, 256)) == 0 and act.padded_for(wq, (2, T, 256)) == 0
    rows = act.norm(x, w, 1e-5, wq)  # the CPU: the reference, padded
    assert rows.shape == (T, 256) and rows.values.shape == (8, 256) and rows.rows == T
    plain = act.Fp8Rows(*aq.norm_quant_ref(x, w, 1e-5), x.dtype)
    np.testing.assert_array_equal(np.asarray(rows.dequantize(), np.float32), np.asarray(plain.dequantize(), np.float32))
    t = qm.Tiling(64, 256, 2, 1)
    got = qm.fp8_w8a8(rows, wq, t, interpret=True)
    want = qm.fp8_w8a8(plain, wq, t, interpret=True)
    assert got.shape == (T, 128)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
