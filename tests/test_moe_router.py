"""The one-kernel MoE router (kernels/moe_router.py) against `moe.route` on the float32 logits, in
Pallas' interpreter on the CPU: both routings, renormalised or not, padded expert counts, ties,
padding tokens, two programs; where it declines a batch; lowered for cuda."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import moe_router
from jaxllm.models import moe


def _case(T: int, H: int, E: int, seed: int, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((T, H)), dtype)
    w = jnp.asarray(rng.standard_normal((H, E)) / np.sqrt(H), dtype)
    return h, w


def _route(h, w, valid, k, routing, norm, splits=1):
    return jax.jit(lambda h, w, v: moe_router.route_tokens(h, w, v, k, routing, norm, interpret=True,
                                                           splits=splits))(h, w, valid)


@pytest.mark.parametrize("T,H,E,k,routing,norm,splits", [
    (8, 256, 128, 8, "softmax", True, 1),  # Qwen3-MoE's routing at a batch-1 decode bucket
    (8, 256, 128, 8, "softmax", True, 4),  # the same, H cut into 4 shares of 64 rows
    (1, 256, 128, 8, "softmax", True, 16),  # one token, shares of 16 rows
    (2, 256, 128, 8, "softmax", True, 8),  # two tokens (the second padding), no 16-row tiles
    (20, 128, 64, 4, "softmax", False, 1),  # two programs, the second partial; Qwen2-MoE's
    (20, 128, 64, 4, "softmax", False, 2),  # two row blocks x two shares
    (5, 128, 8, 2, "softmax_topk", False, 1),  # Mixtral's: 8 experts padded to 16 columns
    (5, 128, 8, 2, "softmax_topk", False, 4),
    (3, 64, 60, 4, "softmax", True, 1),  # 60 experts (Qwen1.5/2-MoE-A2.7B) padded to 64
    (3, 64, 60, 4, "softmax", True, 2),
    (1, 64, 16, 1, "softmax_topk", False, 1),  # top-1
])
def test_router_kernel_matches_route(T, H, E, k, routing, norm, splits):
    h, w = _case(T, H, E, seed=T + E)
    valid = jnp.arange(T) < max(T - 2, 1)
    weights, ids = _route(h, w, valid, k, routing, norm, splits)
    logits = jnp.einsum("th,he->te", h, w, preferred_element_type=jnp.float32)
    want_w, want_ids = moe.route(logits, k, routing, norm)
    v = np.asarray(valid)
    np.testing.assert_array_equal(np.asarray(ids)[v], np.asarray(want_ids)[v])
    np.testing.assert_allclose(np.asarray(weights)[v], np.asarray(want_w)[v], rtol=1e-5, atol=1e-6)
    # padding tokens: no expert (id E), weight 0
    assert (np.asarray(ids)[~v] == E).all() and (np.asarray(weights)[~v] == 0).all()
    _, ref_ids = moe_router.route_tokens_ref(h, w, valid, k, routing, norm)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))


@pytest.mark.parametrize("routing", moe_router.ROUTINGS)
def test_ties_pick_the_lower_expert(routing):
    """Equal logits (duplicated weight columns: experts 3 = 9 = 12, 5 = 7) rank as `lax.top_k`
    ranks them, the lower id first."""
    T, H, E, k = 4, 64, 16, 4
    h, w = _case(T, H, E, seed=3)
    w = w.at[:, 3].add(jnp.sign(h[0]) * 0.5)  # expert 3 far ahead for token 0
    w = w.at[:, 9].set(w[:, 3]).at[:, 12].set(w[:, 3]).at[:, 7].set(w[:, 5])
    _, ids = _route(h, w, None, k, routing, True)
    logits = jnp.einsum("th,he->te", h, w, preferred_element_type=jnp.float32)
    _, want = moe.route(logits, k, routing, True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want))
    assert list(np.asarray(ids)[0, :3]) == [3, 9, 12]


def test_where_the_kernel_declines(monkeypatch):
    """`fits` / `route_small`: more than MAX_TOKENS tokens, a top-k that is no power of two, an
    unknown routing, more than 256 experts, a weight of another dtype (or a quantized one); the
    split form (the default) above SPLIT_TOKENS tokens."""
    h, w = _case(8, 64, 16, seed=1)
    assert moe_router.fits(8, 64, 16, 4, "softmax")
    assert not moe_router.fits(moe_router.MAX_TOKENS + 1, 64, 16, 4, "softmax")
    assert not moe_router.fits(8, 64, 16, 6, "softmax")
    assert not moe_router.fits(8, 64, 16, 4, "sigmoid")
    assert not moe_router.fits(8, 64, 512, 4, "softmax")
    assert not moe_router.fits(8, 40, 16, 4, "softmax")  # H not a multiple of 16
    valid, ln = jnp.ones(8, bool), jnp.ones(64, jnp.float32)
    assert moe_router.route_small(h, w.astype(jnp.bfloat16), valid, 4, "softmax", True, ln, 1e-6) is None
    assert moe_router.route_small(h, {"values": w}, valid, 4, "softmax", True, ln, 1e-6) is None
    assert moe_router.route_small(h, w, valid, 6, "softmax", True, ln, 1e-6) is None
    monkeypatch.delenv("JAXLLM_MOE_ROUTER", raising=False)
    assert moe_router.route_small(h, w, valid, 4, "softmax", True, ln, 1e-6) is None  # 8 > 2 tokens
    got = moe_router.route_small(h[:2], w, valid[:2], 4, "softmax", True, ln, 1e-6)
    assert got is not None and got[1].shape == (2, 4) and got[2].shape == (2, 64)
    monkeypatch.setenv("JAXLLM_MOE_ROUTER", "kernel")  # the one-program kernel: up to MAX_TOKENS
    got = moe_router.route_small(h, w, valid, 4, "softmax", True, ln, 1e-6)
    assert got is not None and got[1].shape == (8, 4) and got[2].shape == (8, 64)
    with pytest.raises(ValueError, match="top_k=6"):
        moe_router.route_tokens(h, w, valid, 6, "softmax", True)
    with pytest.raises(ValueError, match="splits=3"):  # 64 rows do not cut into 3 shares
        moe_router.route_tokens(h, w, valid, 4, "softmax", True, splits=3)


def test_default_splits():
    """About 16 KB of router weight a program: Qwen3-30B-A3B's [2048, 128] in 32 shares of 64
    rows; shares stay multiples of 16 rows; a small weight is not split."""
    assert moe_router.default_splits(2048, 128) == 32 and moe_router.split_rows(2048, 128, 32) == 64
    assert moe_router.default_splits(4096, 8) == 8  # Mixtral: 8 experts padded to 16 columns
    assert moe_router.split_rows(4096, 8, 8) == 512
    assert moe_router.default_splits(64, 16) == 1
    assert moe_router.split_rows(2048, 60, 32) == 64 and moe_router.split_rows(2048, 128, 3) == 0


@pytest.mark.parametrize("dtype,splits", [(jnp.float32, 1), (jnp.bfloat16, 1), (jnp.bfloat16, 4)])
def test_rms_norm_before_the_router(dtype, splits):
    """`rms_norm`: the kernel normalises the residual stream itself (two programs, padding rows)
    and returns the normed rows, as `llama.rms_norm` computes them, beside the routing of them;
    split, each share's program stores its columns of the normed rows."""
    from jaxllm.models.llama import rms_norm

    T, H, E, k = 20, 256, 64, 4
    x, w = _case(T, H, E, seed=7, dtype=dtype)
    x = x * 3 + 0.5
    ln = jnp.asarray(np.random.default_rng(2).standard_normal(H) * 0.2 + 1, dtype)
    valid = jnp.arange(T) < 17
    weights, ids, h = jax.jit(lambda x, w, v, ln: moe_router.route_tokens(
        x, w, v, k, "softmax", True, interpret=True, rms_norm=(ln, 1e-6), splits=splits))(x, w, valid, ln)
    want_h = rms_norm(x, ln, 1e-6)
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-5, atol=1e-6)
    else:  # the same bf16 rounding points: nearly every value equal, none off by more than an ulp
        assert np.mean(np.asarray(h) == np.asarray(want_h)) > 0.97
        np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32), rtol=8e-3)
    want_w, want_ids = moe_router.route_tokens_ref(h, w, valid, k, "softmax", True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-4, atol=1e-5)


def test_switch(monkeypatch):
    monkeypatch.delenv("JAXLLM_MOE_ROUTER", raising=False)
    assert moe_router.mode() == "split"  # the split kernels unless asked (XLA's time, fewer kernels)
    monkeypatch.setenv("JAXLLM_MOE_ROUTER", "kernel")
    assert moe_router.enabled()
    monkeypatch.setenv("JAXLLM_MOE_ROUTER", "split")
    assert moe_router.enabled() and moe_router.mode() == "split"
    monkeypatch.setenv("JAXLLM_MOE_ROUTER", "xla")
    assert not moe_router.enabled()
    monkeypatch.setenv("JAXLLM_MOE_ROUTER", "triton")
    with pytest.raises(ValueError, match="JAXLLM_MOE_ROUTER"):
        moe_router.enabled()


@pytest.mark.parametrize("E,splits", [(128, 1), (60, 1), (128, 32)])
def test_lowers_for_cuda(E, splits):
    """The Triton kernel at Qwen3-30B-A3B's router (H 2048, 128 experts, top-8, the RMSNorm
    before it) and with padded columns, lowered for a GPU on this CPU."""
    h = jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2048, E), jnp.bfloat16)
    valid = jax.ShapeDtypeStruct((8,), jnp.bool_)
    ln = jax.ShapeDtypeStruct((2048,), jnp.bfloat16)
    f = jax.jit(lambda h, w, v, ln: moe_router.route_tokens(h, w, v, 8, "softmax", True, interpret=False,
                                                            rms_norm=(ln, 1e-6) if E == 128 else None,
                                                            splits=splits))
    text = f.trace(h, w, valid, ln).lower(lowering_platforms=("cuda",)).as_text()
    assert ("jaxllm_moe_router_split" in text) == (splits > 1) and "jaxllm_moe_router" in text
