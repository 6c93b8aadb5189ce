"""The Mosaic decode kernel at the head shapes small models bring: head dim 64 (Llama-3.2-1B,
SmolLM2), where q is read from SMEM again for every 64-key block (`reload_q`: on an H200 the
QK wgmma of later blocks read p's registers instead of q's, scripts/diag_decode_d64.py), and
groups that are no power of two (SmolLM2: 9 q / 3 kv heads) padded with zero query heads. In
the Mosaic GPU CPU interpreter with its race detector against dense attention, the CUDA
lowering exported on the CPU, and the routing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels import dense_outputs, make_batch, rel_err

# contexts of three and two 64-key blocks (one split: a CTA walks all of them), one token each
REQS = [(150, 1), (70, 1)]


@pytest.mark.parametrize("group", [4, 3])
def test_head_dim_64_over_several_blocks_matches_dense_attention(group):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode, padded_group
    rng = np.random.default_rng(31 + group)
    q, kv, md = make_batch(rng, REQS, page_size=16, num_kv_heads=1, group=group, head_dim=64,
                           pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    fn = functools.partial(mosaic_decode.paged_decode_attention, num_splits=1, num_stages=2,
                           interpret=True)
    got = fn(q, kv, jnp.int32(1), md, sm_scale=0.3) if group == 4 else \
        padded_group(fn, q, kv, jnp.int32(1), md, sm_scale=0.3)
    assert got.shape == q.shape
    dense = dense_outputs(q, kv, 1, md, REQS, 16, 0.3)
    for t in range(len(REQS)):
        assert rel_err(np.asarray(got[t], np.float32), dense[t]) < 1e-2, t
    assert not np.asarray(got[len(REQS):], np.float32).any()  # the padding token
    assert not ipc.get_races().races_found


@pytest.mark.parametrize("pages", ["bf16", "fp8"])
def test_head_dim_64_lowers_for_cuda(pages):
    """Compiled for cuda on the CPU (no interpreter): the per-block q read from SMEM (and, on fp8
    pages, the scaled f16 copy of q it reads) goes through every Mosaic GPU lowering rule. That
    it is what makes the kernel right on an H200 is scripts/diag_decode_d64.py's to show."""
    from jaxllm.kernels import mosaic_decode
    rng = np.random.default_rng(33)
    q, kv, md = make_batch(rng, [(300, 1), (20, 1)], page_size=16, num_kv_heads=8, group=4,
                           head_dim=64, num_layers=1, pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    if pages == "fp8":
        kv = kv.astype(jnp.float8_e4m3fn)
    f = jax.jit(lambda q, kv, md: mosaic_decode.paged_decode_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.1, num_splits=1))
    assert "mosaic_gpu" in jax.export.export(f, platforms=["cuda"])(q, kv, md).mlir_module()


def test_small_heads_route(monkeypatch):
    """Decode steps at D = 64 and 128 take the decode kernel (bf16 and fp8 pages), at D = 256
    the prefill/mixed path's kernel (unchecked on a GPU); a group of 3 goes in padded to 4 query
    heads a KV head, its prefill steps to the reference."""
    from jaxllm.kernels import mosaic_attention, mosaic_decode, ref

    calls = []
    monkeypatch.setattr(mosaic_decode, "paged_decode_attention",
                        lambda q, *a, **k: calls.append(("decode", q.shape[1])) or q)
    monkeypatch.setattr(ref, "ragged_paged_attention",
                        lambda q, *a, **k: calls.append(("ref", q.shape[1])) or q)
    prefill = lambda q, *a, **k: calls.append(("prefill", q.shape[1])) or q  # noqa: E731
    rng = np.random.default_rng(35)
    cases = [([(40, 1), (9, 1)], 1, 4, 64, jnp.bfloat16),   # decode, D 64
             ([(40, 1), (9, 1)], 1, 4, 64, jnp.float8_e4m3fn),  # decode, D 64, fp8 pages
             ([(40, 1), (9, 1)], 1, 4, 256, jnp.bfloat16),  # decode, D 256
             ([(40, 1), (9, 1)], 1, 4, 128, jnp.float8_e4m3fn),  # decode, D 128, fp8 pages
             ([(40, 1), (9, 1)], 1, 3, 64, jnp.bfloat16),   # decode, G 3: padded to 4
             ([(40, 5)], 0, 3, 64, jnp.bfloat16),           # prefill, G 3
             ([(40, 5)], 0, 4, 64, jnp.bfloat16)]           # prefill, G 4
    for reqs, pad_reqs, group, head_dim, dtype in cases:
        q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=3, group=group,
                               head_dim=head_dim, pad_reqs=pad_reqs, pad_tokens=1,
                               dtype=jnp.bfloat16)
        out = mosaic_attention(q, kv.astype(dtype), jnp.int32(0), md, sm_scale=0.1,
                               prefill_fn=prefill)
        assert out.shape == q.shape
    assert calls == [("decode", 12), ("decode", 12), ("prefill", 12), ("decode", 12),
                     ("decode", 12), ("ref", 9), ("prefill", 12)]
