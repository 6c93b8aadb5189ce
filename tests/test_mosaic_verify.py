"""The Mosaic decode kernel with several query tokens per CTA (`queries_per_item`: speculative
verification), in the Mosaic GPU CPU interpreter with its race detector, against dense
attention: requests of 1 to 7 new tokens (a request longer than an item is cut into several),
padding tokens and padding rows, one split, two, and the run-time split count."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels import dense_outputs, make_batch, rel_err

# (context after the step, new tokens): a verified row of k + 1 = 4 whose positions 62..65
# straddle two 64-key blocks (with two splits, rows 62 and 63 see no key of the second), and
# one longer than an item (items of 4 and 2 tokens). Few tokens: the interpreter's cost is
# about a second per CTA of the grid.
REQS = [(66, 4), (13, 6)]


@pytest.mark.parametrize("splits", [1, 2])
def test_items_match_dense_attention(splits):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import decode_schedule, mosaic_decode
    rng = np.random.default_rng(21)
    q, kv, md = make_batch(rng, REQS, page_size=8, num_kv_heads=1, group=4, head_dim=64,
                           pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    got = mosaic_decode.paged_decode_attention(q, kv, jnp.int32(1), md, sm_scale=0.3,
                                               num_splits=splits, num_stages=2, interpret=True,
                                               queries_per_item=4)
    dense = dense_outputs(q, kv, 1, md, REQS, 8, 0.3)
    n = sum(new for _, new in REQS)
    it = decode_schedule.items(md, 4)
    np.testing.assert_array_equal(np.asarray(it.last), [65, 10, 12] + [-1] * 8)
    assert rel_err(np.asarray(got[:n], np.float32), dense[:n]) < 1e-2
    for t in range(n):  # every token on its own, not only on average
        assert rel_err(np.asarray(got[t], np.float32), dense[t]) < 2e-2, t
    assert not np.asarray(got[n:], np.float32).any()  # padding tokens
    assert not ipc.get_races().races_found


def test_items_cut_requests_into_consecutive_groups():
    from jaxllm.kernels import decode_schedule
    rng = np.random.default_rng(22)
    reqs = [(66, 4), (35, 7), (9, 1), (20, 2)]  # 4, 7, 1 and 2 new tokens
    _, _, md = make_batch(rng, reqs, page_size=8, num_kv_heads=1, group=1, pad_tokens=2)
    it = decode_schedule.items(md, 4)
    # requests of 4, 7, 1, 2 tokens -> items (0..3), (4..7), (8..10), (11), (12..13)
    np.testing.assert_array_equal(np.asarray(it.tok0)[:5], [0, 4, 8, 11, 12])
    np.testing.assert_array_equal(np.asarray(it.req)[:5], [0, 1, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(it.first)[:6], [62, 28, 32, 8, 18, -1])
    np.testing.assert_array_equal(np.asarray(it.last)[:6], [65, 31, 34, 8, 19, -1])
    np.testing.assert_array_equal(np.asarray(it.item_of)[:14], [0] * 4 + [1] * 4 + [2] * 3 + [3] + [4] * 2)
    np.testing.assert_array_equal(np.asarray(it.offset)[:14], [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 0, 0, 1])


def test_items_refuse_more_rows_than_a_wgmma():
    from jaxllm.kernels import mosaic_decode
    rng = np.random.default_rng(23)
    q, kv, md = make_batch(rng, REQS, page_size=8, num_kv_heads=1, group=16, head_dim=64,
                           dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="queries_per_item 5"):
        mosaic_decode.paged_decode_attention(q, kv, jnp.int32(1), md, sm_scale=0.3,
                                             interpret=True, queries_per_item=5)


@pytest.mark.parametrize("splits", [1, None])
def test_items_lower_for_cuda(splits):
    """The compiled path (no interpreter), exported for cuda on the CPU: the row iota, the
    causal mask and the token-major q rows go through every Mosaic GPU lowering rule. Llama-3
    heads (G = 4), k + 1 = 5 tokens per verified request (20 of the 64 rows)."""
    import jax
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(24)
    q, kv, md = make_batch(rng, [(300, 5), (20, 5), (77, 1)], page_size=16, num_kv_heads=8,
                           group=4, head_dim=128, num_layers=1, pad_reqs=0, pad_tokens=1,
                           dtype=jnp.bfloat16)
    f = jax.jit(lambda q, kv, md: mosaic_decode.paged_decode_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.1, num_splits=splits, queries_per_item=5))
    exported = jax.export.export(f, platforms=["cuda"])(q, kv, md)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("queries,group,want", [(1, 4, 1), (5, 4, 5), (5, 16, 4)])
def test_decode_steps_take_items_of_the_speculative_width(monkeypatch, queries, group, want):
    """A speculative engine's decode-kernel steps pass k + 1 tokens per CTA, capped by the 64
    wgmma rows over the G query heads of a KV head; prefill steps are untouched."""
    from jaxllm.kernels import get_attention_fn, mosaic_decode

    calls = []
    monkeypatch.setattr(mosaic_decode, "paged_decode_attention",
                        lambda q, *a, queries_per_item, **k: calls.append(queries_per_item) or q)
    fn = get_attention_fn("mosaic", "gpu", queries)
    rng = np.random.default_rng(25)
    q, kv, md = make_batch(rng, [(40, 1), (9, 1)], page_size=8, num_kv_heads=1, group=group,
                           head_dim=128, pad_reqs=1, pad_tokens=1, dtype=jnp.bfloat16)
    fn(q, kv, jnp.int32(0), md, sm_scale=0.1)
    assert calls == [want]
