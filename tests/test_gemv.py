"""The one- and two-row dense product (kernels/gemv.py) against x @ w in Pallas' interpreter on the
CPU, its lowering for cuda, the warm-up's choice (models/gemv_choice.py) and `linear.linear` taking
it, through the engine for HF's greedy ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import gemv, timing
from jaxllm.models import gemv_choice, linear

SMALL = (gemv.Tiling(block_n=32, block_k=16, k_splits=1), gemv.Tiling(block_n=16, block_k=16, k_splits=2))


@pytest.fixture(autouse=True)
def _clear_choice():
    gemv_choice.clear()
    yield
    gemv_choice.clear()


@pytest.mark.parametrize("tiling", SMALL, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_matches_the_reference(tiling, rows):
    rng = np.random.default_rng(rows + tiling.k_splits)
    K, N = 64, 96
    x = jnp.asarray(rng.standard_normal((rows, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)) / 8, jnp.float32)
    got = jax.jit(lambda x, w: gemv.gemv(x, w, tiling, interpret=True))(x, w)
    assert got.shape == (rows, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(gemv.gemv_ref(x, w)), rtol=1e-5, atol=1e-5)
    # bf16 operands, a float32 result (the router's `out_dtype`)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got = gemv.gemv(xb, wb, tiling, out_dtype=jnp.float32, interpret=True)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(gemv.gemv_ref(xb, wb, jnp.float32)),
                               rtol=1e-4, atol=1e-4)


def test_gemv_partials_sum_to_the_product():
    """partials=True: the K splits' float32 partials [S, M, N] unsummed; refused without a split."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 96)) / 8, jnp.bfloat16)
    parts = gemv.gemv(x, w, SMALL[1], interpret=True, partials=True)
    assert parts.shape == (2, 2, 96) and parts.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(gemv.gemv_ref(x, w, jnp.float32)),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="without a K split"):
        gemv.gemv(x, w, SMALL[0], interpret=True, partials=True)


def test_gemv_refuses_what_it_cannot_take():
    t = SMALL[0]
    assert gemv.unsupported((3, 64), (64, 96), t) == "3 rows (1..2)"
    assert "K 64" in gemv.unsupported((1, 64), (32, 96), t)
    assert "does not fit" in gemv.unsupported((1, 64), (64, 40), t)
    with pytest.raises(ValueError, match="3 rows"):
        gemv.gemv(jnp.zeros((3, 64)), jnp.zeros((64, 96)), t, interpret=True)


@pytest.mark.parametrize("tiling", gemv.TILINGS, ids=lambda t: t.name)
def test_gemv_lowers_to_triton(tiling):
    """Every shipped tiling at Qwen3-30B-A3B's q/k/v and o shapes, lowered for cuda on this CPU."""
    for K, N in ((2048, 5120), (4096, 2048)):
        f = jax.jit(lambda x, w: gemv.gemv(x, w, tiling, interpret=False))
        text = f.trace(jax.ShapeDtypeStruct((2, K), jnp.bfloat16),
                       jax.ShapeDtypeStruct((K, N), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "jaxllm_gemv" in text


def test_linear_takes_the_measured_tiling(monkeypatch):
    """`linear.linear`: a (K, N, rows) the warm-up chose goes through gemv, with an einsum spec's
    weight flattened to [K, N] and the result shaped back; other row counts keep XLA's dot."""
    rng = np.random.default_rng(3)
    x2 = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 1, 96)) / 8, jnp.float32)
    calls = []
    kernel = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **k: calls.append(a[2].name) or kernel(*a, **k))
    monkeypatch.setitem(gemv.BY_NAME, SMALL[1].name, SMALL[1])
    want = jnp.einsum("te,esp->tsp", x2, w)
    gemv_choice._CHOICE[(64, 96, 2, "float32")] = SMALL[1].name
    got = linear.linear(x2, w, "te,esp->tsp")
    assert calls == [SMALL[1].name] and got.shape == (2, 1, 96)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    linear.linear(x2[:1], w, "te,esp->tsp")  # one row: not measured, XLA's dot
    assert calls == [SMALL[1].name]
    assert linear.linear(x2, w[:, 0], out_dtype=jnp.float32).shape == (2, 96) and len(calls) == 2


def test_measure_keeps_a_tiling_only_when_clearly_faster(monkeypatch):
    """Each fitting tiling is timed against XLA's dot (checked outputs); a tiling is kept only
    below MARGIN of XLA's time; row counts above MAX_ROWS are not timed."""
    monkeypatch.setattr(gemv, "TILINGS", SMALL)
    monkeypatch.setattr(gemv, "BY_NAME", {t.name: t for t in SMALL})
    seen = []

    def fake(fns, args, reps, what, where="", **kw):
        seen.append((args[0].shape, sorted(fns)))
        # copies of the weight in turn, so that it comes from HBM (`timing.turns`; a GPU's here)
        assert len(kw["more"]) == timing.turns(64 * 96 * 4, "gpu") - 1
        assert all(m[0].shape == args[1].shape and m[0] is not args[1] for m in kw["more"])
        fast = 0.5 if args[0].shape[0] == 1 else 0.99
        return {n: (1.0 if n == "xla" else fast + 0.01 * i) for i, n in enumerate(fns)}

    monkeypatch.setattr(gemv_choice, "time_checked", fake)
    monkeypatch.setattr(gemv_choice, "turns", lambda n: timing.turns(n, "gpu"))
    choice = gemv_choice.measure({(64, 96, "float32")}, [1, 2, 8])
    assert [s[0] for s in seen] == [(1, 64), (2, 64)]
    assert seen[0][1] == sorted(["xla", *(t.name for t in SMALL)])
    assert choice == {(64, 96, 1, "float32"): SMALL[0].name}  # 2 rows: 0.99 of XLA's time, kept XLA
    w = jnp.zeros((64, 96), jnp.float32)
    assert gemv_choice.tiling_for(1, w) == SMALL[0] and gemv_choice.tiling_for(2, w) is None


def test_measure_times_real_kernels_on_the_cpu(monkeypatch):
    monkeypatch.setattr(gemv, "TILINGS", SMALL[:1])
    gemv_choice.measure({(32, 32, "float32")}, [2], reps=1, chain=2)
    assert set(gemv_choice.TIMINGS[(32, 32, 2, "float32")]) == {"xla", SMALL[0].name}


def test_dense_shapes_of_per_layer_weights():
    layers = [{"wqkv": jnp.zeros((64, 1, 128)), "wo": jnp.zeros((64, 64)), "ln_attn": jnp.zeros(64),
               "w_down": jnp.zeros((128, 64), jnp.bfloat16)}] * 2
    assert gemv_choice.dense_shapes(layers) == {(64, 128, "float32"), (64, 64, "float32"), (128, 64, "bfloat16")}
    assert gemv_choice.dense_shapes(None) == set()


@pytest.mark.slow
def test_engine_with_gemv_keeps_greedy_ids(monkeypatch):
    """A tiny Llama-3 engine (layers unrolled as on a GPU) whose two-token bucket takes gemv for
    every dense linear gives HF's greedy ids."""
    from hf_tiny import hf_greedy, make, make_llm, random_prompts, unrolled_layers

    from jaxllm import SamplingParams

    t = gemv.Tiling(block_n=32, block_k=16, k_splits=2)
    monkeypatch.setitem(gemv.BY_NAME, t.name, t)
    calls = []
    kernel = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    # the warm-up measures on GPUs only: every dense linear of a one- or two-token step takes it
    monkeypatch.setattr(gemv_choice, "tiling_for", lambda rows, w: t if rows <= gemv.MAX_ROWS and t.fits(
        w.shape[0], int(np.prod(w.shape[1:]))) else None)
    unrolled_layers(monkeypatch)
    model, cfg, sd = make("llama3")
    llm = make_llm((cfg, sd), max_model_len=128, token_buckets=(2, 64), seq_buckets=(2, 8))
    prompt = random_prompts(1, cfg["vocab_size"], 5, 9, seed=2)[0]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 5)
    assert (2, 64) in calls  # the decode steps' bucket of two traced through gemv (q/k/v, gate/up)


def test_a_failing_measurement_leaves_xla_everywhere(monkeypatch, caplog):
    """The warm-up's gemv measurement failing (a device error, say) costs nothing but the choice."""
    from jaxllm.engine.warmup import Warmup

    def boom(shapes, rows):
        gemv_choice._CHOICE[(64, 64, 2, "float32")] = SMALL[0].name
        raise RuntimeError("out of memory\ntrace")

    monkeypatch.setattr(gemv_choice, "measure", boom)
    w = Warmup()
    w.layer_params = [{"wo": jnp.zeros((64, 64))}]
    with caplog.at_level("WARNING", logger="jaxllm"):
        w.measure_dense_gemv((2, 64))
    assert not gemv_choice._CHOICE and "RuntimeError: out of memory" in caplog.text
