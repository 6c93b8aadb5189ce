"""Models whose G query heads per KV head are no power of two (SmolLM2: 9 q / 3 kv heads) run
the Mosaic decode kernel padded to the next power of two (zero query heads, outputs dropped):
in the CPU interpreter against dense attention, and the routing (decode steps padded, prefill
steps to the reference, JAXLLM_PAD_GROUP=0 back to the reference)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from test_kernels import dense_outputs, make_batch, rel_err


def test_padded_group_matches_dense_attention():
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode, padded_group
    rng = np.random.default_rng(31)
    reqs = [(27, 1)]
    q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=1, group=3, head_dim=64,
                           pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    fn = functools.partial(mosaic_decode.paged_decode_attention, num_splits=1, num_stages=2,
                           interpret=True)
    got = padded_group(fn, q, kv, jnp.int32(1), md, sm_scale=0.3)
    assert got.shape == q.shape
    dense = dense_outputs(q, kv, 1, md, reqs, 8, 0.3)
    assert rel_err(np.asarray(got[:1], np.float32), dense[:1]) < 1e-2
    assert not np.asarray(got[1:], np.float32).any()
    assert not ipc.get_races().races_found


def test_non_power_of_two_groups_route(monkeypatch):
    from jaxllm.kernels import mosaic_attention, mosaic_decode, ref

    calls = []
    monkeypatch.setattr(mosaic_decode, "paged_decode_attention",
                        lambda q, *a, **k: calls.append(("decode", q.shape[1])) or q)
    monkeypatch.setattr(ref, "ragged_paged_attention",
                        lambda q, *a, **k: calls.append(("ref", q.shape[1])) or q)
    rng = np.random.default_rng(32)
    for reqs, pad_reqs in (([(40, 1), (9, 1)], 1), ([(40, 5)], 0)):  # decode, then prefill
        q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=3, group=3, head_dim=64,
                               pad_reqs=pad_reqs, pad_tokens=1, dtype=jnp.bfloat16)
        out = mosaic_attention(q, kv, jnp.int32(0), md, sm_scale=0.1)
        assert out.shape == q.shape
    assert calls == [("decode", 12), ("ref", 9)]  # 3 kv heads x 4 (padded), then as it is
    calls.clear()
    monkeypatch.setenv("JAXLLM_PAD_GROUP", "0")
    q, kv, md = make_batch(rng, [(40, 1)], page_size=8, num_kv_heads=3, group=3, head_dim=64,
                           pad_reqs=1, pad_tokens=1, dtype=jnp.bfloat16)
    mosaic_attention(q, kv, jnp.int32(0), md, sm_scale=0.1)
    assert calls == [("ref", 9)]
