"""The Hopper fp8 W8A8 decode matmul (kernels/qmatmul_mosaic.py) in Mosaic GPU's CPU interpreter
(simulated TMA, barriers and wgmma; race detection) against the plain product and against the
XLA W8A8 path it stands in for; its tilings; its lowering for cuda; the warm-up's choice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import qmatmul_mosaic as qm
from jaxllm.quantization import choice, kernels
from jaxllm.quantization.quantize import quantize_fp8

K, N = 512, 256


def _races() -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    return ipc.get_races().races_found


def _fp8(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 8, jnp.float8_e4m3fn)


@pytest.mark.parametrize("M,tiling,sms", [
    (1, qm.Tiling(64, 128, 2, 1), 0), (5, qm.Tiling(64, 128, 3, 2), 0), (16, qm.Tiling(128, 256, 2, 2), 0),
    (5, qm.Tiling(64, 128, 2, 2, persistent=True), 4),  # 8 units: 4 CTAs x 2
    (3, qm.Tiling(64, 128, 3, 4, persistent=True), 3),  # 16 units over 2 CTAs (3 does not divide 16)
    (9, qm.Tiling(128, 128, 2, 1, persistent=True), 2)],  # one unit a CTA
    ids=lambda a: a.name if isinstance(a, qm.Tiling) else str(a))
def test_matches_the_product_in_the_interpreter(M, tiling, sms):
    """Every K split's partial lands in its own slot (a wrong split index or a reused pipeline
    slot would double or drop a block of K); padding columns stay zero. Persistent: each CTA's
    units, their pipeline running on across a unit's end, each stored once as its own sum."""
    x, w = _fp8((M, K), 1), _fp8((N, K), 2)
    if tiling.persistent:
        units = N // tiling.block_n * tiling.k_splits
        assert units % qm.persistent_ctas(N, tiling, sms) == 0 and qm.persistent_ctas(N, tiling, sms) <= sms
    got = np.asarray(jax.jit(lambda a, b: qm.fp8_matmul(a, b, tiling, interpret=True, num_sms=sms or 132))(x, w))
    want = np.asarray(w, np.float32) @ np.asarray(x, np.float32).T  # fp8 products: exact in f32 sums
    assert got.shape == (N, qm.padded_rows(M)) and not _races()
    np.testing.assert_allclose(got[:, :M], want, rtol=1e-5, atol=1e-3 * np.abs(want).max())
    assert not got[:, M:].any()


def test_w8a8_path_equals_the_xla_path():
    """Through `kernels.matmul(path="mosaic/...")`: x rounded per token as the XLA path rounds it,
    the scales applied after, so the two agree to float32 summation order (and both are within
    W8A8's few percent of x @ the dequantized weight)."""
    rng = np.random.default_rng(3)
    w = jax.tree.map(jnp.asarray, quantize_fp8((rng.standard_normal((K, N)) * 0.05).astype(np.float32), search=1))
    assert qm.takes(w)
    x = jnp.asarray(rng.standard_normal((2, 3, K)), jnp.bfloat16)  # leading axes kept
    t = qm.Tiling(64, 256, 2, 2)
    got = jax.jit(lambda x, w: kernels.matmul(x, w, f"mosaic/{t.name}"))(x, w)
    want = kernels.fp8_w8a8(x, w, upcast=True)
    assert got.shape == (2, 3, N) and got.dtype == jnp.bfloat16
    # x quantized by the op that made it (`act.Fp8Rows`, padded after quantizing): the same
    from jaxllm.kernels.act_quant import quantize_ref
    from jaxllm.quantization.act import Fp8Rows
    rows = jax.jit(lambda r, w: kernels.matmul(r, w, f"mosaic/{t.name}"))(Fp8Rows(*quantize_ref(x), x.dtype), w)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(got, np.float32))
    g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 1e-2  # bf16 outputs
    ref = np.asarray(x, np.float32) @ np.asarray(w.dequantize(jnp.float32))
    assert np.linalg.norm(g - ref) / np.linalg.norm(ref) < 5e-2


def test_tilings_fill_the_sms_and_respect_shared_memory():
    for M, Kx, Nx in ((1, 4096, 6144), (8, 4096, 28672), (64, 14336, 4096), (1, 4096, 1024)):
        ts = qm.tilings_for(M, Kx, Nx, num_sms=132)
        for t in (t for t in ts if t.persistent):  # >= 90% of the SMs, >= 2 units a CTA, even split
            ctas = qm.persistent_ctas(Nx, t, 132)
            units = Nx // t.block_n * t.k_splits
            assert ctas >= 0.9 * 132 and units % ctas == 0 and units // ctas >= 2
        ts = [t for t in ts if not t.persistent]
        assert ts and all(qm.unsupported(M, Kx, Nx, t) is None for t in ts)
        assert all(qm.Tiling.parse(t.name) == t for t in ts)
        for t in ts:  # each shape at its fewest splits for one CTA an SM, unless K runs out
            fewest = min(u.k_splits for u in ts if u.block_n == t.block_n and u.block_k == t.block_k)
            if fewest > 1:
                assert (Nx // t.block_n) * fewest // 2 < 132
            assert t.smem_bytes(M) <= qm.SMEM_LIMIT
    big = qm.Tiling(128, 256, 6, 1)  # 6 x (128 + 64) x 256 bytes
    assert qm.unsupported(64, 4096, 4096, big) == "294912 bytes of shared memory at 64 rows"
    assert qm.unsupported(8, 4096, 4096, big) is None
    assert "rows" in qm.unsupported(65, 4096, 4096, qm.Tiling())
    assert "block_k" in qm.unsupported(8, 4096 + 128, 4096, qm.Tiling(128, 256, 4, 1))
    with pytest.raises(ValueError, match="e4m3"):
        qm.fp8_matmul(jnp.zeros((4, K), jnp.bfloat16), _fp8((N, K), 0), qm.Tiling())


@pytest.mark.parametrize("M", [1, 64])
def test_lowers_for_cuda(M):
    """Every tiling offered for the Llama-3-8B linears (qkv, o, gate/up, down) exports through
    Mosaic GPU's lowering (wgmma on a transposed fp8 view included)."""
    for Kx, Nx in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        for t in qm.tilings_for(M, Kx, Nx):
            f = jax.jit(lambda a, b, t=t: qm.fp8_matmul(a, b, t))
            args = (jax.ShapeDtypeStruct((M, Kx), jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((Nx, Kx), jnp.float8_e4m3fn))
            assert "mosaic" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text().lower()


def test_the_warm_up_offers_and_measures_the_kernel_on_hopper(monkeypatch):
    """On Hopper, per-channel fp8 W8A8 gets "mosaic/<tiling>" candidates (all at the fewest rows,
    the fastest at the others; every fitting one where that one does not fit), other layouts
    none; the choice is read back by `kernels.matmul`."""
    from jaxllm.kernels import prefill_choice

    monkeypatch.setattr(prefill_choice, "is_hopper", lambda: True)
    rng = np.random.default_rng(4)
    w = jax.tree.map(jnp.asarray, quantize_fp8((rng.standard_normal((K, N)) * 0.05).astype(np.float32), search=1))
    offered = [p for p in choice.candidates((1, K), w) if p.startswith("mosaic/")]
    assert offered == [f"mosaic/{t.name}" for t in qm.tilings_for(1, K, N, choice.num_sms())] and offered
    first = offered[-1].partition("/")[2]
    assert [p for p in choice.candidates((4, K), w, [first]) if p.startswith("mosaic/")] == [offered[-1]]
    assert [p for p in choice.candidates((4, K), w, ["mq_64x64s1k1"]) if p.startswith("mosaic/")] == [
        f"mosaic/{t.name}" for t in qm.tilings_for(4, K, N, choice.num_sms())]
    blocks = jax.tree.map(jnp.asarray, quantize_fp8(np.ones((K, N), np.float32), search=1))
    blocks = type(blocks)(blocks.values, blocks.scale, None, kind="fp8", act="none")  # weight-only
    assert not any(p.startswith("mosaic/") for p in choice.candidates((1, K), blocks))

    seen = []

    def fake(x, w, paths, reps=5):  # fake clocks: the last Mosaic tiling is fastest
        seen.append((x.shape[0], list(paths)))
        mosaic = [p for p in paths if p.startswith("mosaic/")]
        return {p: (1e-6 if p == mosaic[-1] else 5e-6) for p in paths}

    monkeypatch.setattr(choice, "time_paths", fake)
    monkeypatch.setattr(choice, "loop_floor", lambda x, reps, unroll=1: 1e-6)
    choice.clear()
    try:
        choice.measure([w], [1, 8], jnp.bfloat16)
        (m1, paths1), (m8, paths8) = seen
        assert [p for p in paths8 if p.startswith("mosaic/")] == [offered[-1]]
        assert choice.measured_path((8, K), w) == offered[-1]
    finally:
        choice.clear()
