"""The decode kernel's split partials merged in one kernel (kernels/split_combine.py) against
its reference (`decode_schedule.combine`), in Pallas' interpreter: splits and tokens past the
ones in use hold garbage the merge must ignore, padding tokens give zeros, and the engine's
decode kernel takes it (or XLA's merge, JAXLLM_DECODE_COMBINE=xla) for split grids."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import decode_schedule, split_combine


@pytest.mark.parametrize("n,tokens,heads,rows,dim,active", [
    (16, 8, 8, 4, 128, (16, 1)),  # a batch of 1 padded to 8, split 16 ways (Llama-3-8B heads)
    (8, 5, 2, 4, 64, (3, 4)),  # fewer splits and tokens in use than the grid has
    (2, 3, 1, 16, 64, (2, 3)),  # every partial real
    (4, 2, 2, 8, 64, (4, 0)),  # no real token
    (32, 2, 4, 8, 128, (32, 1)),  # batch 1 in a bucket of 2, 4 KV heads split 32 ways: row chunks
    (8, 2, 2, 32, 32, (5, 2)),  # verification items of many rows: cut into chunks of rows
])
def test_matches_reference_and_ignores_unwritten_partials(n, tokens, heads, rows, dim, active):
    rng = np.random.default_rng(n + tokens)
    o = rng.standard_normal((n, tokens, heads, rows, dim)).astype(np.float32)
    lse = (rng.standard_normal((n, tokens, heads, 64)) * 4).astype(np.float32)
    act = jnp.asarray(active, jnp.int32)
    valid = (np.arange(n)[:, None] < active[0]) & (np.arange(tokens) < active[1])[None, :]
    o[~valid] = np.nan  # what a CTA that never ran leaves: must weigh nothing
    lse[~valid] = np.inf
    want = decode_schedule.combine(jnp.asarray(o), jnp.asarray(lse), rows, jnp.float32,
                                   jnp.asarray(valid))
    got = split_combine.combine(jnp.asarray(o), jnp.asarray(lse), act, jnp.float32,
                                interpret=True)
    assert got.shape == (tokens, heads * rows, dim)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert not np.asarray(got)[active[1]:].any()  # padding tokens: zeros
    assert np.isfinite(np.asarray(got)).all()


def test_only_power_of_two_blocks_fit():
    assert split_combine.fits(jnp.zeros((16, 8, 8, 4, 128)))
    assert not split_combine.fits(jnp.zeros((16, 8, 8, 5, 128)))  # k + 1 = 5 verified rows
    assert not split_combine.fits(jnp.zeros((16, 8, 8, 4, 96)))
    assert split_combine.fits(jnp.zeros((16, 8, 4, 8, 128)))  # Qwen3-30B-A3B's G 8
    assert split_combine.fits(jnp.zeros((16, 1, 8, 64, 128)))  # 8 verified tokens of G 8: chunks
    assert split_combine.fits(jnp.zeros((32, 2, 4, 8, 128)))
    assert not split_combine.fits(jnp.zeros((256, 1, 1, 1, 128)))  # one row's partials too many


def test_rows_are_cut_into_chunks_of_bounded_partials():
    assert split_combine.chunk_rows(16, 8, 128) == 2  # 16 x 2 x 128 = 4,096 partials a program
    assert split_combine.chunk_rows(32, 8, 128) == 1
    assert split_combine.chunk_rows(2, 16, 64) == 16  # few partials: one program a (token, head)
    assert split_combine.chunk_rows(128, 4, 128) == 1  # never below one row


def test_decode_kernel_merges_through_it_unless_told_not_to(monkeypatch):
    """A split grid's partials reach `split_combine.combine` by default and XLA's merge with
    JAXLLM_DECODE_COMBINE=xla (checked by tracing the decode kernel for cuda); a bad value
    is an error naming the variable."""
    import jax

    from test_kernels import make_batch
    from jaxllm.kernels import mosaic_decode

    calls = []
    real = split_combine.combine
    monkeypatch.setattr(split_combine, "combine", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(5)
    q, kv, md = make_batch(rng, [(300, 1)], page_size=16, num_kv_heads=8, group=4, head_dim=128,
                           num_layers=1, pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)

    def lower() -> str:  # a new jit each time: the variable is read when the step is traced
        f = jax.jit(lambda q, kv, md: mosaic_decode.paged_decode_attention(
            q, kv, jnp.int32(0), md, sm_scale=0.1, num_splits=4))
        return f.trace(q, kv, md).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxllm_split_combine" in lower() and calls == [1]
    monkeypatch.setenv("JAXLLM_DECODE_COMBINE", "xla")
    assert "jaxllm_split_combine" not in lower() and calls == [1]
    monkeypatch.setenv("JAXLLM_DECODE_COMBINE", "fused")
    with pytest.raises(ValueError, match="JAXLLM_DECODE_COMBINE"):
        lower()
