"""int4 KV pages hold K and V rotated along the head dimension (kernels/kv_quant.py `rotation`):
the rotation is orthonormal and fixed, leaves attention unchanged, spreads outlier channels
so that a per-row 4-bit range fits them, and is wired into the model (the keys it writes into
int4 pages are rotated). The quality it buys on SmolLM2 is held by tests/test_quant_quality.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import make, make_llm
from test_kernels import make_batch, rel_err

from jaxllm.kernels import kv_quant, ref


@pytest.mark.parametrize("D", [16, 64, 80, 128])
def test_rotation_is_orthonormal_and_fixed(D):
    r = kv_quant.rotation(D)
    assert r.shape == (D, D) and r.dtype == np.float32
    np.testing.assert_allclose(r @ r.T, np.eye(D), atol=1e-5)
    np.testing.assert_array_equal(r, kv_quant.rotation(D))  # the same in every engine
    assert not np.allclose(np.abs(r), np.eye(D), atol=0.1)  # it mixes channels
    if D & (D - 1) == 0:  # a signed Hadamard matrix: every entry +-D^-1/2
        np.testing.assert_allclose(np.abs(r), D ** -0.5, rtol=1e-6)


def test_only_int4_pages_are_rotated():
    for name, rotated in [("auto", False), ("int8", False), ("int4", True)]:
        dtype, width = kv_quant.page_layout(name, jnp.float32, 64)
        pages = jnp.zeros((1, 2, 1, 1, 4, width), dtype)
        assert (kv_quant.page_rotation(pages, 64) is not None) == rotated, name


def outlier_rows(rng, n: int, D: int) -> np.ndarray:
    x = rng.standard_normal((n, D))
    x[:, [3, 3 + D // 2]] *= 30.0  # one channel pair (RoPE's) much larger, as keys have
    return x.astype(np.float32)


def test_rotation_spreads_outlier_channels():
    rng = np.random.default_rng(0)
    D = 64
    x = outlier_rows(rng, 256, D)
    dtype, width = kv_quant.page_layout("int4", jnp.float32, D)
    r = kv_quant.rotation(D)

    def err(rows):
        return float(np.sqrt(((rows - x) ** 2).mean()))

    plain = np.asarray(kv_quant.decode(kv_quant.encode(jnp.asarray(x), dtype, width), D))
    back = np.asarray(kv_quant.decode(kv_quant.encode(jnp.asarray(x @ r), dtype, width), D)) @ r.T
    assert err(back) < 0.4 * err(plain), (err(back), err(plain))


def test_rotated_attention_equals_plain_attention():
    """The identity the model relies on: attention of q R over pages of k R, v R, times R^T."""
    rng = np.random.default_rng(1)
    q, kv, md = make_batch(rng, [(37, 9), (20, 1)], page_size=8, num_kv_heads=2, group=2)
    r = kv_quant.rotation(q.shape[-1])
    want = ref.ragged_paged_attention(q, kv, jnp.int32(0), md, sm_scale=0.25)
    got = ref.ragged_paged_attention(kv_quant.rotate(q, r), kv_quant.rotate(kv, r), jnp.int32(0), md,
                                     sm_scale=0.25)
    assert rel_err(kv_quant.rotate(got, r, transpose=True), want) < 1e-5


@pytest.fixture(scope="module")
def outlier_model():
    """The tiny Llama with one key channel pair per KV head made 30x larger."""
    _, cfg, sd = make("llama3", seed=5)
    D = cfg["hidden_size"] // cfg["num_attention_heads"]
    for name in [n for n in sd if n.endswith("k_proj.weight")]:
        w = sd[name].copy()
        for h in range(cfg["num_key_value_heads"]):
            w[[h * D + 3, h * D + 3 + D // 2]] *= 30.0
        sd[name] = w
    return cfg, sd


def key_rows(llm, D: int) -> np.ndarray:
    """The decoded key rows [n, D] the engine wrote into its int4 pool (rows never written
    decode to zeros and are left out)."""
    pages = np.asarray(llm.engine.runner.kv_pages)
    rows = np.asarray(kv_quant.decode(jnp.asarray(pages[:, 0]), D)).reshape(-1, D)
    return rows[np.abs(rows).sum(-1) > 0]


def test_int4_model_writes_rotated_keys(outlier_model, monkeypatch):
    """The keys' outlier pair holds most of their energy; in the pages that the model wrote,
    rotated, it holds its share of the channels, and rotating the rows back restores it."""
    from jaxllm import SamplingParams

    cfg, _ = outlier_model
    D = cfg["hidden_size"] // cfg["num_attention_heads"]
    prompt = np.random.default_rng(2).integers(0, 384, 100).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def outlier_share(rows):
        e = rows ** 2
        return float(e[:, [3, 3 + D // 2]].sum() / e.sum())

    shares = {}
    for rotated in (True, False):
        if not rotated:
            monkeypatch.setattr(kv_quant, "ROTATED_FORMATS", ())
        llm = make_llm(outlier_model, kv_cache_dtype="int4", skip_warmup=True)
        llm.generate([prompt], greedy, use_tqdm=False)
        rows = key_rows(llm, D)
        assert len(rows) >= 100 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
        shares[rotated] = outlier_share(rows)
        if rotated:
            shares["back"] = outlier_share(rows @ kv_quant.rotation(D).T)
    assert shares[False] > 0.8 and shares["back"] > 0.8, shares
    assert shares[True] < 0.3, shares
