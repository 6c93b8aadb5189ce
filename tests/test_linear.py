"""`linear.linear`: one-token float matmuls padded to two rows on a GPU (XLA would otherwise
rewrite a small vector-matrix product as a materialized multiply and a reduce)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import linear
from jaxllm.quantization.qarray import QArray


def _prims(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))  # (jnp.pad is a nested jit: its text names "_pad")


@pytest.mark.parametrize("spec", [None, "te,esp->tsp"])
def test_one_row_is_padded_on_a_gpu_only_below_the_threshold(monkeypatch, spec):
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (1, 64), jnp.float32)
    w = jax.random.normal(k[1], (64, 48) if spec is None else (64, 1, 48), jnp.float32)
    want = np.asarray(x @ w if spec is None else jnp.einsum(spec, x, w))
    assert "_pad" not in _prims(lambda x, w: linear.linear(x, w, spec), x, w)  # the CPU: as it was
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    f = lambda x, w: linear.linear(x, w, spec)  # noqa: E731
    assert "_pad" in _prims(f, x, w)
    out = f(x, w)
    assert out.shape == want.shape
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    x2 = jnp.concatenate([x, x])  # more rows: a GEMM already
    assert "_pad" not in _prims(f, x2, w)
    monkeypatch.setattr(linear, "GEMV_REWRITE_BELOW", w.size)  # large enough to stay a GEMM
    assert "_pad" not in _prims(lambda x, w: linear.linear(x, w, spec), x, w)  # (a new fn: traces are cached)


def test_out_dtype_and_quantized_weights(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jnp.ones((1, 8), jnp.bfloat16)
    w = jnp.ones((8, 4), jnp.bfloat16)
    y = linear.linear(x, w, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32 and y.shape == (1, 4) and float(y[0, 0]) == 8.0
    seen = []
    q = QArray(jnp.ones((8, 4), jnp.int8), jnp.ones((1, 4), jnp.float32), kind="int8")
    monkeypatch.setattr(QArray, "__rmatmul__", lambda self, x: seen.append(x.shape) or x[:, :4])
    linear.linear(jnp.ones((1, 8), jnp.float32), q)
    assert seen == [(1, 8)]  # the quantized matmul's own path, unpadded
