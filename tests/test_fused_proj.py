"""Fused q/k/v and gate/up projections of the unrolled layout (llama_state.fuse_layer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.llama_state import fuse_layer


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_fused_columns_keep_each_shard_together(shards):
    E, Q, K, F = 8, 16, 8, 12
    k = iter(jax.random.split(jax.random.key(0), 8))
    w = {"wq": jax.random.normal(next(k), (E, Q)), "wk": jax.random.normal(next(k), (E, K)),
         "wv": jax.random.normal(next(k), (E, K)), "bq": jax.random.normal(next(k), (Q,)),
         "bk": jax.random.normal(next(k), (K,)), "bv": jax.random.normal(next(k), (K,)),
         "w_gate": jax.random.normal(next(k), (E, F)), "w_up": jax.random.normal(next(k), (E, F)),
         "ln_attn": jnp.ones(E)}
    f = fuse_layer(w, shards)
    assert set(f) == {"wqkv", "bqkv", "w_gu", "ln_attn"}
    assert f["wqkv"].shape == (E, shards, (Q + 2 * K) // shards) and f["w_gu"].shape == (E, shards, 2, F // shards)
    q, kk, F_ = Q // shards, K // shards, F // shards
    for s in range(shards):  # device s's slice holds its own heads' q, k, v and its own MLP units
        np.testing.assert_array_equal(f["wqkv"][:, s], np.concatenate(
            [w["wq"][:, s * q:(s + 1) * q], w["wk"][:, s * kk:(s + 1) * kk], w["wv"][:, s * kk:(s + 1) * kk]], -1))
        np.testing.assert_array_equal(f["bqkv"][s], np.concatenate(
            [w["bq"][s * q:(s + 1) * q], w["bk"][s * kk:(s + 1) * kk], w["bv"][s * kk:(s + 1) * kk]]))
        np.testing.assert_array_equal(f["w_gu"][:, s, 0], w["w_gate"][:, s * F_:(s + 1) * F_])
        np.testing.assert_array_equal(f["w_gu"][:, s, 1], w["w_up"][:, s * F_:(s + 1) * F_])


def test_uneven_split_falls_back_to_one_shard():
    w = {"wq": jnp.ones((4, 6)), "wk": jnp.ones((4, 3)), "wv": jnp.ones((4, 3))}
    assert fuse_layer(w, 2)["wqkv"].shape == (4, 1, 12)
