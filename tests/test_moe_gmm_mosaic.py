"""The Hopper decode grouped matmul (kernels/moe_gmm_mosaic.py) in Mosaic GPU's CPU interpreter
(simulated TMA, barriers, wgmma; race detection) against jax.lax.ragged_dot, and its lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import moe_gmm_mosaic as mm
from jaxllm.models import gmm as gmm_impls

TILING = mm.MosaicTiling(block_n=64, block_k=64, max_concurrent_steps=2)


def _inputs(M: int, G: int = 8, K: int = 128, N: int = 128, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.bfloat16) for _ in range(2)]
    return x, ws


def _check(got, x, w, sizes):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

    assert not ipc.get_races().races_found
    n = int(sizes.sum())
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), jnp.asarray(sizes))
    got, want = np.asarray(got, np.float32)[:n], np.asarray(want)[:n]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3  # bf16 inputs and output


def test_one_expert_takes_every_row():
    sizes = np.zeros(8, np.int32)
    sizes[5] = 70  # two row blocks, the second partly filled
    x, (w, _) = _inputs(70)
    got = jax.jit(lambda *a: mm.grouped_matmul(*a, TILING, interpret=True, num_sms=4))(x, w, jnp.asarray(sizes))
    _check(got, x, w, sizes)


def test_pair_with_empty_experts_and_padding_rows():
    rng = np.random.default_rng(1)
    M = 40
    sizes = np.bincount(rng.choice([0, 2, 3, 7], M - 7), minlength=8).astype(np.int32)  # 7 padding rows
    x, (w1, w2) = _inputs(M, seed=2)  # the last 7 rows: no group covers them
    pair = jax.jit(lambda *a: mm.grouped_matmul_pair(*a, TILING, interpret=True, num_sms=4))
    y1, y2 = pair(x, w1, w2, jnp.asarray(sizes))
    _check(y1, x, w1, sizes)
    _check(y2, x, w2, sizes)


def test_slots_list_only_blocks_that_hold_rows():
    for sizes in ([0, 3, 0, 0, 70, 1, 0, 6], [8] * 8, [0] * 7 + [64]):
        sizes = np.asarray(sizes, np.int32)
        M = int(sizes.sum())
        sched, row_slot = map(np.asarray, mm.slots(jnp.asarray(sizes), M))
        g, block, live = sched
        start = np.cumsum(sizes) - sizes
        want = [(e, b) for e in range(8) if sizes[e]
                for b in range(start[e] // 64, (start[e] + sizes[e] - 1) // 64 + 1)]
        assert list(zip(g[live > 0], block[live > 0])) == want and live.sum() == len(want)
        assert sched.shape[1] == mm.num_slots(M, 8) and (live[: len(want)] > 0).all()
        for r in range(M):  # each row is read back from its own expert's tile of its block
            e = np.searchsorted(np.cumsum(sizes), r, side="right")
            assert (g[row_slot[r]], block[row_slot[r]]) == (e, r // 64)


@pytest.mark.parametrize("tiling", mm.TILINGS, ids=lambda t: t.name)
def test_lowers_to_mosaic_gpu(tiling):
    args = (jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((128,), jnp.int32))
    pair = jax.jit(lambda x, w, s: mm.grouped_matmul_pair(x, w, w, s, tiling))
    assert "mosaic" in pair.trace(*args).lower(lowering_platforms=("cuda",)).as_text().lower()
    assert tiling.name in gmm_impls.candidates(64, 128, 2048, 768, "gpu")
