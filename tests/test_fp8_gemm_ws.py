"""The warp-specialized Hopper fp8 W8A8 GEMM (kernels/fp8_gemm_ws.py) in Mosaic GPU's CPU
interpreter (simulated TMA, barriers, wgmma, three warpgroups; race detection) against the
plain scaled product, the QArray wrapper against the engine's XLA fp8 path, and its lowering
for cuda at Llama-3-8B's prefill shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import fp8_gemm_ws as fg


def _races() -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    return ipc.get_races().races_found


def _operands(M: int, K: int, N: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    xq = jnp.asarray(rng.standard_normal((M, K)) * 8, jnp.float8_e4m3fn)
    w = jnp.asarray(rng.standard_normal((N, K)) * 8, jnp.float8_e4m3fn)
    sx = jnp.asarray(rng.uniform(0.5, 2.0, M) / 64, jnp.float32)  # distinct per row and column:
    sw = jnp.asarray(rng.uniform(0.5, 2.0, N) / 64, jnp.float32)  # a swapped or shifted one shows
    return xq, sx, w, sw


def _want(xq, sx, w, sw):
    y = np.asarray(xq, np.float32) @ np.asarray(w, np.float32).T
    return y * np.asarray(sx)[:, None] * np.asarray(sw)[None, :]


@pytest.mark.parametrize("M,tiling,num_sms", [
    (200, fg.GemmTiling(block_n=128, block_k=128, stages=2, band=2), 3),  # 2 row blocks x 3 strips
    (64, fg.GemmTiling(block_n=128, block_k=128, stages=3, band=8), 2),  # padded rows, a wrapped ring
    (200, fg.GemmTiling(block_n=128, block_k=128, stages=2, band=2, chained=True), 2),  # 3 tiles a CTA
    (200, fg.GemmTiling(block_n=128, block_k=128, stages=4, band=1, chained=True), 4),  # one-tile CTAs
], ids=["pad_rows_band2", "one_tile_idle_sm", "chained", "chained_one_tile_ctas"])  # (block_n 256: minutes of interpreter compile)
def test_matches_the_scaled_product_in_the_interpreter(M, tiling, num_sms):
    """Each row's and column's own scale, the rows past M dropped, tiles walked in planar-snake
    order by fewer CTAs than tiles (each CTA several tiles: the pipeline and the scale barrier
    reused), K of 4 steps."""
    N = 3 * tiling.block_n if M > 128 else tiling.block_n
    xq, sx, w, sw = _operands(M, 512, N)
    got = jax.jit(lambda *a: fg.fp8_gemm(*a, tiling, interpret=True, num_sms=num_sms))(xq, sx, w, sw)
    assert not _races()
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16
    want = _want(xq, sx, w, sw)
    err = np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max()
    assert err < 1e-2, err


def test_the_wrapper_matches_the_engine_fp8_path():
    """`fp8_w8a8` on a W8A8 QArray (x quantized per token, the per-channel scale) gives what
    `quantization.kernels.fp8_w8a8` gives through XLA (float32 GEMM of the fp8 values here)."""
    from jaxllm.quantization.kernels import fp8_w8a8
    from jaxllm.quantization.quantize import quantize_fp8

    rng = np.random.default_rng(3)
    q = jax.tree.map(jnp.asarray, quantize_fp8(rng.standard_normal((256, 128)).astype(np.float32) * 0.05))
    x = jnp.asarray(rng.standard_normal((2, 70, 256)), jnp.bfloat16)
    t = fg.GemmTiling(block_n=128, block_k=128, stages=2, band=1)
    got = jax.jit(lambda x, q: fg.fp8_w8a8(x, q, t, interpret=True, num_sms=1))(x, q)
    want = fp8_w8a8(x, q, upcast=True)
    assert got.shape == (2, 70, 128) and got.dtype == x.dtype
    from jaxllm.kernels.act_quant import quantize_ref
    from jaxllm.quantization.act import Fp8Rows
    rows = jax.jit(lambda r, q: fg.fp8_w8a8(r, q, t, interpret=True, num_sms=1))(Fp8Rows(*quantize_ref(x), x.dtype), q)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(got, np.float32))  # x quantized before
    err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()
                / jnp.abs(want.astype(jnp.float32)).max())
    assert err < 1e-2, err


def test_refuses_what_it_cannot_tile():
    xq, sx, w, sw = _operands(8, 192, 128)
    with pytest.raises(ValueError, match="block_k"):
        fg.fp8_gemm(xq, sx, w, sw, fg.GemmTiling(block_n=128))
    with pytest.raises(ValueError, match="e4m3"):
        fg.fp8_gemm(xq.astype(jnp.bfloat16), sx, w, sw)
    assert "shared memory" in fg.GemmTiling(block_n=256, stages=4).unsupported(128, 4096, 4096)
    assert "chained" in fg.GemmTiling(stages=3, chained=True).unsupported(128, 4096, 4096)  # 32 steps
    assert all(t.unsupported(8192, K, 4096) is None for t in fg.CHAINED for K in (4096, 14336))


@pytest.mark.parametrize("tiling", fg.TILINGS + fg.CHAINED, ids=lambda t: t.name)
def test_lowers_for_cuda_at_llama3_prefill_shapes(tiling):
    """Compiled path (no interpreter): Mosaic's lowering, shared-memory check included, for the
    four Llama-3-8B linears at 8,192 tokens."""
    sds = jax.ShapeDtypeStruct
    f = jax.jit(lambda *a: fg.fp8_gemm(*a, tiling))
    for K, N in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        args = (sds((8192, K), jnp.float8_e4m3fn), sds((8192,), jnp.float32),
                sds((N, K), jnp.float8_e4m3fn), sds((N,), jnp.float32))
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert fg.KERNEL_NAME in text


@pytest.mark.parametrize("m,n,band", [(3, 24, 8), (5, 7, 4), (1, 1, 8), (4, 6, 16), (2, 112, 8)])
def test_snake_visits_every_tile_once(m, n, band):
    """The tile order: a permutation of all (row block, strip) pairs, bands of strips walked
    row block by row block (consecutive tiles share a row block or a strip band)."""
    order = [tuple(int(v) for v in fg._snake(jnp.int32(i), m, n, band)) for i in range(m * n)]
    assert sorted(order) == [(a, b) for a in range(m) for b in range(n)]
    w = max(d for d in range(1, min(band, n) + 1) if n % d == 0)
    assert all(b // w == i // (w * m) for i, (_, b) in enumerate(order))


@pytest.mark.parametrize("wins, start", [
    ({256: True, 2048: True, 16384: True}, 256),  # faster everywhere: every prefill-sized step
    ({256: False, 2048: True, 16384: True}, 257),  # rows up to the next measured count follow it
    ({256: True, 2048: False, 16384: True}, 2049),  # only above the largest loss
    ({256: True, 2048: True, 16384: False}, None),  # slower at the largest count: XLA throughout
])
def test_measured_routing_of_prefill_sized_fp8_steps(monkeypatch, wins, start):
    """Unset JAXLLM_FP8_GEMM, on Hopper: the warm-up times XLA's fp8 GEMM against the kernel at
    the smallest, a middle and the largest prefill-sized bucket, and `fp8_gemm_path` takes the
    kernel from the fewest rows at which it won there and at every larger count measured (fake
    timings here; decode-sized buckets are the decode kernels' and not timed for it);
    JAXLLM_FP8_GEMM=xla turns the measurement off."""
    from jaxllm.kernels import prefill_choice
    from jaxllm.quantization import choice
    from jaxllm.quantization import kernels as qk
    from jaxllm.quantization.quantize import quantize_fp8

    rng = np.random.default_rng(6)
    q = jax.tree.map(jnp.asarray, quantize_fp8(rng.standard_normal((256, 256)).astype(np.float32) * 0.05))
    tiling = "ws/" + fg.TILINGS[0].name
    timed = []

    def fake_times(x, w, paths, reps, chain, ref_rows, compiler_options, unroll):
        assert paths == ["xla", tiling]
        assert ref_rows == 64 and compiler_options == {"xla_gpu_autotune_level": 0}  # start-up time
        assert unroll == 1  # prefill-sized GEMMs: milliseconds, the loop's cost is nothing beside them
        timed.append(x.shape[0])
        return {"xla": 1.0, tiling: 0.5 if wins[x.shape[0]] else 2.0}

    monkeypatch.setattr(prefill_choice, "is_hopper", lambda: True)
    monkeypatch.setattr(choice, "time_paths", fake_times)
    choice.clear()
    try:
        choice.measure_gemm(q, [8, 64, 256, 1024, 2048, 4096, 16384], jnp.bfloat16)
        assert timed == [256, 2048, 16384]
        for rows in (65, 256, 257, 1024, 2048, 2049, 4096, 16384):
            want = None if start is None or rows < start else tiling
            assert qk.fp8_gemm_path((rows, 256), q) == want, rows
        assert qk.fp8_gemm_path((64, 256), q) is None
        monkeypatch.setenv("JAXLLM_FP8_GEMM", "xla")
        assert qk.fp8_gemm_path((16384, 256), q) is None
        choice.clear()
        timed.clear()
        choice.measure_gemm(q, [8, 256, 16384], jnp.bfloat16)
        assert timed == [] and not choice.GEMM_FROM
    finally:
        choice.clear()


def test_opt_in_routing_of_prefill_sized_fp8_steps(monkeypatch):
    """JAXLLM_FP8_GEMM names a tiling: prefill-sized steps (> 64 rows) of a 2-D fp8 W8A8 weight
    whose shape it takes go to "ws/<tiling>", decode-sized ones and other weights do not; unset,
    nothing does; a bad name is refused naming the variable. `matmul` on that path gives the
    XLA path's product (interpreter)."""
    from jaxllm.quantization import kernels as qk
    from jaxllm.quantization.quantize import quantize_fp8, quantize_int8

    rng = np.random.default_rng(5)
    q = jax.tree.map(jnp.asarray, quantize_fp8(rng.standard_normal((256, 128)).astype(np.float32) * 0.05))
    name = "fg_128x128x128s5b8"
    assert qk.fp8_gemm_path((200, 256), q) is None  # unset: off
    monkeypatch.setenv("JAXLLM_FP8_GEMM", name)
    assert qk.fp8_gemm_path((200, 256), q) == "ws/" + name
    assert qk.fp8_gemm_path((2, 100, 256), q) == "ws/" + name
    assert qk.fp8_gemm_path((64, 256), q) is None  # decode-sized: the decode kernels' rows
    assert qk.fp8_gemm_path((200, 256), quantize_int8(np.ones((256, 128), np.float32))) is None
    monkeypatch.setenv("JAXLLM_FP8_GEMM", "fg_128x256x128s3b8")  # N = 128: not a whole strip
    assert qk.fp8_gemm_path((200, 256), q) is None
    monkeypatch.setenv("JAXLLM_FP8_GEMM", "xla")
    assert qk.fp8_gemm_path((200, 256), q) is None
    monkeypatch.setenv("JAXLLM_FP8_GEMM", "fast")
    with pytest.raises(ValueError, match="JAXLLM_FP8_GEMM"):
        qk.fp8_gemm_path((200, 256), q)
    x = jnp.asarray(rng.standard_normal((130, 256)), jnp.bfloat16)
    got = qk.matmul(x, q, path="ws/" + name)
    want = qk.fp8_w8a8(x, q, upcast=True)
    err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()
                / jnp.abs(want.astype(jnp.float32)).max())
    assert err < 1e-2, err
