"""The Hopper W4A16 decode matmul (kernels/qmatmul_int4_mosaic.py) in Mosaic GPU's CPU interpreter
(simulated TMA, barriers and wgmma; race detection) against x @ the dequantized int4 weight; its
[N, K] layout; its tilings; its lowering for cuda."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import qmatmul_int4_mosaic as q4
from jaxllm.quantization.quantize import quantize_int4

K, N = 512, 128


def _races() -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    return ipc.get_races().races_found


def _weight(seed: int = 0, offset: float = 0.0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * 0.05 + offset).astype(np.float32)
    return quantize_int4(w, group=128, search=False)


def test_layout_is_the_same_weight():
    """`to_nk`: signed nibbles q - 8 in int4 [N, K], offsets o + 8 s: the same float weight, from
    numpy (load) or jax (device) arrays."""
    w = _weight(offset=0.3)  # offsets far from 0
    for src in (w, jax.tree.map(jnp.asarray, w)):
        nk = q4.to_nk(src)
        assert nk.values.dtype == jnp.int4 and nk.values.shape == (N, K) and nk.shape == (K, N)
        v = np.asarray(nk.values, np.int8)
        assert v.min() >= -8 and v.max() <= 7
        np.testing.assert_allclose(np.asarray(nk.dequantize()), np.asarray(w.dequantize(np.float32)),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 128"):
        q4.to_nk(quantize_int4(np.ones((K, N), np.float32), group=64, search=False))


@pytest.mark.parametrize("M,tiling", [(1, q4.Tiling(64, 2, 1)), (5, q4.Tiling(64, 3, 2)),
                                      (16, q4.Tiling(128, 2, 4))], ids=lambda a: getattr(a, "name", str(a)))
def test_matches_the_dequantized_product_in_the_interpreter(M, tiling):
    """Each group's scale and offset on its own partial (a wrong group index, split or reused
    slot shows), the padding rows dropped; bf16 rows and output."""
    w = _weight(seed=M, offset=0.1)
    nk = jax.tree.map(jnp.asarray, q4.to_nk(w))
    x = jnp.asarray(np.random.default_rng(M + 1).standard_normal((M, K)), jnp.bfloat16)
    got = jax.jit(lambda x, w: q4.int4_matmul(x, w, tiling, interpret=True))(x, nk)
    want = np.asarray(x, np.float32) @ np.asarray(w.dequantize(np.float32))
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16 and not _races()
    g = np.asarray(got, np.float32)
    assert np.linalg.norm(g - want) / np.linalg.norm(want) < 5e-3  # bf16 output rounding


def test_tilings():
    for M, Kx, Nx in ((1, 4096, 6144), (64, 14336, 4096), (8, 4096, 28672)):
        ts = q4.tilings_for(M, Kx, Nx)
        assert ts and all(q4.unsupported(M, Kx, Nx, t) is None for t in ts)
        assert all(q4.Tiling.parse(t.name) == t for t in ts)
    assert "rows" in q4.unsupported(65, 4096, 4096, q4.Tiling())
    assert "128" in q4.unsupported(8, 4096 + 64, 4096, q4.Tiling())


@pytest.mark.parametrize("M", [1, 64])
def test_lowers_for_cuda(M):
    """Every tiling offered for the Llama-3-8B linears exports through Mosaic GPU's lowering (the
    int4 -> bf16 conversion into wgmma's register operand included)."""
    for Kx, Nx in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        w = q4.Int4NK(jax.ShapeDtypeStruct((Nx, Kx), jnp.int4),
                      jax.ShapeDtypeStruct((Kx // 128, Nx), jnp.float32),
                      jax.ShapeDtypeStruct((Kx // 128, Nx), jnp.float32))
        for t in q4.tilings_for(M, Kx, Nx):
            f = jax.jit(lambda x, w, t=t: q4.int4_matmul(x, w, t))
            text = f.trace(jax.ShapeDtypeStruct((M, Kx), jnp.bfloat16), w).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "mosaic" in text.lower()
