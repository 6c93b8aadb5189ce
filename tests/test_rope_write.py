"""q/k head RMSNorm, RoPE and the K/V write in one kernel (kernels/rope_write.py) against the
model's own path (`llama.rms_norm`, `rope.apply_rope`, `ref.write_kv`), in Pallas' interpreter
on the CPU: with and without head norms, head counts that are no power of two, padding tokens,
a page pool written in place; where it declines; lowered for cuda."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import rope_write as rw
from jaxllm.kernels.ref import write_kv
from jaxllm.models.llama import rms_norm
from jaxllm.models.rope import apply_rope


def _case(T, H, K, D, dtype, seed, L=2, P=6, S=4):
    rng = np.random.default_rng(seed)
    a = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    q, k, v = a(T, H, D), a(T, K, D), a(T, K, D)
    qn, kn = a(D) * 0.3 + 1, a(D) * 0.3 + 1
    pages = a(L, 2, K, P, S, D)
    positions = jnp.asarray(rng.integers(0, 500, T), jnp.int32)
    slots = jnp.asarray(rng.permutation(P * S)[:T], jnp.int32).at[-1].set(-1)  # last: padding
    positions = positions.at[-1].set(-1)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    return q, k, v, qn, kn, pages, positions, slots, inv_freq


@pytest.mark.parametrize("T,H,K,D,dtype,norm", [
    (8, 32, 4, 128, jnp.bfloat16, True),  # Qwen3-30B-A3B's heads at a batch-1 bucket
    (5, 9, 3, 64, jnp.float32, False),  # SmolLM2's (no head norm), heads no power of two
    (3, 6, 2, 32, jnp.bfloat16, True),
])
def test_matches_the_model_path(T, H, K, D, dtype, norm):
    q, k, v, qn, kn, pages, pos, slots, inv = _case(T, H, K, D, dtype, seed=T + H)
    layer = jnp.int32(1)
    qkv = jnp.concatenate([a.reshape(T, -1) for a in (q, k, v)], -1)
    f = jax.jit(lambda qkv, qn, kn, p: rw.rope_write(
        qkv, (H, K), qn if norm else None, kn if norm else None, 1e-6, pos, inv, p, layer, slots,
        interpret=True), donate_argnums=(3,))
    got_q, got_pages = f(qkv, qn, kn, pages + 0)
    wq, wk = (rms_norm(q, qn, 1e-6), rms_norm(k, kn, 1e-6)) if norm else (q, k)
    want_q = apply_rope(wq, pos, inv)
    want_pages = write_kv(pages, layer, apply_rope(wk, pos, inv), v, slots)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    real = np.asarray(pos) >= 0
    np.testing.assert_allclose(np.asarray(got_q, np.float32)[real], np.asarray(want_q, np.float32)[real], **tol)
    np.testing.assert_allclose(np.asarray(got_pages, np.float32), np.asarray(want_pages, np.float32), **tol)
    # exactly the slots written: everything else as it was, layer 0 untouched
    changed = np.asarray(got_pages != pages).any(axis=(1, 2, 5))  # [L, P, S]
    expect = np.zeros_like(changed)
    for s in np.asarray(slots)[np.asarray(slots) >= 0]:
        expect[1, s // pages.shape[4], s % pages.shape[4]] = True
    np.testing.assert_array_equal(changed, expect)
    if dtype == jnp.bfloat16:  # the bf16 rounding points are the model's: nearly all bits equal
        same = np.mean(np.asarray(got_q)[real] == np.asarray(want_q)[real])
        assert same > 0.97, same


@pytest.mark.parametrize("S", [2, 4])
def test_split_k_partials_are_summed_as_the_projection_rounds_them(S):
    """qkv as a gemv's float32 split-K partials [S, T, C]: the kernel sums them, rounds to the
    pages' bf16 (as the projection's output) and matches the kernel on that rounded qkv."""
    T, H, K, D = 3, 8, 2, 64
    _, _, _, qn, kn, pages, pos, slots, inv = _case(T, H, K, D, jnp.bfloat16, seed=S)
    rng = np.random.default_rng(S)
    parts = jnp.asarray(rng.standard_normal((S, T, (H + 2 * K) * D)), jnp.float32)
    qkv = parts.sum(0).astype(jnp.bfloat16)
    layer = jnp.int32(0)
    run = lambda a: rw.rope_write(a, (H, K), qn, kn, 1e-6, pos, inv, pages + 0, layer, slots, interpret=True)
    assert rw.fits(parts, D, pages) and not rw.fits(parts.astype(jnp.bfloat16), D, pages)
    got_q, got_pages = run(parts)
    want_q, want_pages = run(qkv)
    assert got_q.dtype == jnp.bfloat16
    real = np.asarray(pos) >= 0
    np.testing.assert_array_equal(np.asarray(got_q, np.float32)[real], np.asarray(want_q, np.float32)[real])
    np.testing.assert_array_equal(np.asarray(got_pages, np.float32), np.asarray(want_pages, np.float32))


def test_where_it_declines(monkeypatch):
    """Quantized pages, more than MAX_TOKENS tokens, a head dim that is no power of two, a
    model without head norms (`rope_write_small`: XLA's kernels are as few there under jax 0.10)
    unless JAXLLM_ROPE_WRITE=all; a bad mode names the variable."""
    qkv = jnp.zeros((4, 12 * 64), jnp.bfloat16)
    pages = jnp.zeros((1, 2, 2, 4, 4, 64), jnp.bfloat16)
    assert rw.fits(qkv, 64, pages)
    assert not rw.fits(qkv, 64, pages.astype(jnp.float8_e4m3fn))
    assert not rw.fits(qkv, 64, jnp.zeros((1, 2, 2, 4, 4, 72), jnp.int8))
    assert not rw.fits(jnp.zeros((rw.MAX_TOKENS + 1, 12 * 64), jnp.bfloat16), 64, pages)
    assert not rw.fits(jnp.zeros((4, 12 * 48), jnp.bfloat16), 48,
                       jnp.zeros((1, 2, 2, 4, 4, 48), jnp.bfloat16))
    args = (1e-6, jnp.zeros(4, jnp.int32), np.ones(32, np.float32), pages, jnp.int32(0),
            jnp.zeros(4, jnp.int32))
    norm = jnp.ones(64, jnp.bfloat16)
    assert rw.rope_write_small(qkv, (8, 2), None, None, *args) is None
    assert rw.rope_write_small(qkv, (8, 2), norm, norm, *args) is not None
    monkeypatch.setenv("JAXLLM_ROPE_WRITE", "all")
    assert rw.rope_write_small(qkv, (8, 2), None, None, *args) is not None
    monkeypatch.setenv("JAXLLM_ROPE_WRITE", "on")
    with pytest.raises(ValueError, match="JAXLLM_ROPE_WRITE"):
        rw.enabled()
    monkeypatch.delenv("JAXLLM_ROPE_WRITE")
    with pytest.raises(ValueError, match="rope_write"):
        rw.rope_write(qkv, (8, 2), None, None, *args[:3], pages.astype(jnp.float8_e4m3fn), *args[4:])
    with pytest.raises(ValueError, match="heads"):
        rw.rope_write(qkv, (8, 3), None, None, *args)


@pytest.mark.slow
@pytest.mark.parametrize("arch,mode", [("qwen3", "kernel"), ("llama3_d32", "all")])
def test_engine_keeps_greedy_ids(monkeypatch, arch, mode):
    """The engine on a tiny Qwen3 (head norms, head dim 32) with the kernel as its head norm, RoPE
    and K/V write (the unrolled layout's fused q/k/v, as on a GPU) gives HF's greedy ids; so does
    a tiny Llama-3 (no head norms) under JAXLLM_ROPE_WRITE=all."""
    from hf_tiny import hf_greedy, make, make_llm, random_prompts, unrolled_layers

    from jaxllm import SamplingParams
    from jaxllm.models import llama

    unrolled_layers(monkeypatch)
    monkeypatch.setenv("JAXLLM_ROPE_WRITE", mode)
    calls = []

    def hook(*a):
        out = rw.rope_write_small(*a)
        calls.append(out is not None)
        return out

    init = llama.Llama.__init__
    monkeypatch.setattr(llama.Llama, "__init__", lambda self, *a, **kw: init(
        self, *a, **{**kw, "rope_write_fn": hook}))
    model, cfg, sd = make(arch)
    llm = make_llm((cfg, sd), token_buckets=(8, 64), max_model_len=128)
    prompts = random_prompts(3, cfg["vocab_size"], 3, 70, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for p, o in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(model, p, 6)
    assert any(calls)  # the decode steps went through the kernel


@pytest.mark.slow
def test_qwen3_engine_with_gemv_partials_keeps_greedy_ids(monkeypatch):
    """A two-token bucket whose q/k/v projection is a gemv with a K split hands its float32
    partials to the kernel (no sum of its own) and the engine still gives HF's greedy ids."""
    from hf_tiny import hf_greedy, make, make_llm, random_prompts, unrolled_layers

    from jaxllm import SamplingParams
    from jaxllm.kernels import gemv
    from jaxllm.models import gemv_choice, llama

    unrolled_layers(monkeypatch)
    t = gemv.Tiling(block_n=32, block_k=16, k_splits=2)
    monkeypatch.setattr(gemv_choice, "tiling_for", lambda rows, w: t if rows <= gemv.MAX_ROWS and t.fits(
        w.shape[0], int(np.prod(w.shape[1:]))) else None)
    seen = []

    def hook(qkv, *a):
        seen.append(qkv.ndim)
        return rw.rope_write_small(qkv, *a)

    init = llama.Llama.__init__
    monkeypatch.setattr(llama.Llama, "__init__", lambda self, *a, **kw: init(
        self, *a, **{**kw, "rope_write_fn": hook}))
    model, cfg, sd = make("qwen3")
    llm = make_llm((cfg, sd), token_buckets=(2, 64), seq_buckets=(2, 8), max_model_len=128)
    prompt = random_prompts(1, cfg["vocab_size"], 5, 9, seed=3)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 6)
    assert 3 in seen  # the decode bucket's partials reached the kernel


def test_lowers_for_cuda():
    T, H, K, D = 8, 32, 4, 128
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f = jax.jit(lambda qkv, qn, kn, p, pos, sl: rw.rope_write(
        qkv, (H, K), qn, kn, 1e-6, pos, np.ones(D // 2, np.float32), p, jnp.int32(3), sl,
        interpret=False))
    i32 = jax.ShapeDtypeStruct((T,), jnp.int32)
    text = f.trace(sd(T, (H + 2 * K) * D), sd(D), sd(D), sd(48, 2, K, 64, 16, D),
                   i32, i32).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxllm_rope_write" in text
    parts = jax.ShapeDtypeStruct((4, T, (H + 2 * K) * D), jnp.float32)  # a gemv's split-K partials
    text = f.trace(parts, sd(D), sd(D), sd(48, 2, K, 64, 16, D), i32, i32).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jaxllm_rope_write" in text
