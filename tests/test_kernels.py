"""CPU tests of the attention kernels (Pallas interpret mode) against ref.py.

Shapes are tiny so the whole file runs in well under two minutes on 2 cores;
every case draws fresh random data, shuffles the page pool and mixes prefill
chunks, decode rows, padding rows and padding tokens.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxllm.kernels import ref
from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.kernels import pallas_ragged

jax.config.update("jax_enable_x64", False)


def make_batch(rng: np.random.Generator, reqs: list[tuple[int, int]], *, page_size: int,
               num_kv_heads: int, group: int, head_dim: int = 16, num_layers: int = 2,
               pad_reqs: int = 1, pad_tokens: int = 3, spare_pages: int = 5,
               dtype=jnp.float32):
    """Random q, shuffled kv_pages and metadata for requests [(context_len, new_tokens)].

    Every slot of the pool holds random data, so a kernel that reads a wrong page
    or a masked slot gets a visibly wrong answer.
    """
    n_pages = [-(-ctx // page_size) for ctx, _ in reqs]
    num_pages = sum(n_pages) + spare_pages
    perm = rng.permutation(num_pages)
    max_blocks = max(n_pages) + 2
    num_reqs = len(reqs) + pad_reqs
    block_tables = np.zeros((num_reqs, max_blocks), np.int32)
    positions, token_req, slots, qsl = [], [], [], [0]
    used = 0
    for r, (ctx, new) in enumerate(reqs):
        block_tables[r, :n_pages[r]] = perm[used:used + n_pages[r]]
        used += n_pages[r]
        pos = np.arange(ctx - new, ctx)
        positions += list(pos)
        token_req += [r] * new
        slots += list(block_tables[r, pos // page_size] * page_size + pos % page_size)
        qsl.append(qsl[-1] + new)
    positions += [-1] * pad_tokens
    token_req += [0] * pad_tokens
    slots += [-1] * pad_tokens
    qsl += [qsl[-1]] * pad_reqs
    seq_lens = [ctx for ctx, _ in reqs] + [0] * pad_reqs
    num_tokens = len(positions)
    md = AttentionMetadata(
        positions=jnp.array(positions, jnp.int32), token_req=jnp.array(token_req, jnp.int32),
        slot_mapping=jnp.array(slots, jnp.int32), block_tables=jnp.array(block_tables),
        seq_lens=jnp.array(seq_lens, jnp.int32), query_start_loc=jnp.array(qsl, jnp.int32),
        num_seqs=jnp.array([len(reqs)], jnp.int32))
    num_heads = num_kv_heads * group
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, head_dim)), dtype)
    kv = jnp.asarray(rng.standard_normal(
        (num_layers, 2, num_kv_heads, num_pages, page_size, head_dim)), dtype)
    return q, kv, md


def dense_outputs(q, kv, layer, md, reqs, page_size, sm_scale):
    """Per-request textbook attention (ref.dense_reference) laid out like q.

    Contexts and query chunks are padded to one shape so a single vmapped jit
    serves every request (eager per-shape dispatch would dominate the test time);
    padded keys sit past every real position and are masked by dense_reference.
    """
    qsl, tables = np.asarray(md.query_start_loc), np.asarray(md.block_tables)
    kv_l = np.asarray(kv[layer], np.float32)  # [2, K, P, S, D]
    max_new = max(new for _, new in reqs)
    ks, vs, qs, ps = [], [], [], []
    for r in range(len(reqs)):
        pages = tables[r]  # all columns: unused ones point at page 0, masked
        ks.append(kv_l[0][:, pages].reshape(kv.shape[2], -1, kv.shape[-1]).swapaxes(0, 1))
        vs.append(kv_l[1][:, pages].reshape(kv.shape[2], -1, kv.shape[-1]).swapaxes(0, 1))
        qr = np.zeros((max_new,) + q.shape[1:], np.float32)
        pr = np.full((max_new,), 10**6, np.int32)
        n = qsl[r + 1] - qsl[r]
        qr[:n] = np.asarray(q[qsl[r]:qsl[r + 1]], np.float32)
        pr[:n] = np.asarray(md.positions[qsl[r]:qsl[r + 1]])
        qs.append(qr)
        ps.append(pr)
    fn = jax.jit(jax.vmap(ref.dense_reference, in_axes=(0, 0, 0, 0, None)), static_argnums=4)
    dense = np.asarray(fn(np.stack(qs), np.stack(ks), np.stack(vs), np.stack(ps), sm_scale))
    out = np.zeros(q.shape, np.float32)
    for r in range(len(reqs)):
        out[qsl[r]:qsl[r + 1]] = dense[r, :qsl[r + 1] - qsl[r]]
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CASES = [
    # (requests [(context, new tokens)], page size, kv heads, GQA group)
    ([(37, 37), (20, 1), (5, 1), (50, 9)], 8, 2, 1),   # prefill + decode + chunk
    ([(33, 1), (17, 1), (1, 1), (64, 1)], 16, 1, 4),   # decode only
    ([(23, 11), (9, 1), (40, 40)], 4, 2, 8),           # chunked prefill, tiny pages
]


@pytest.mark.parametrize("reqs,page_size,num_kv_heads,group", CASES)
def test_pallas_matches_reference_and_dense(reqs, page_size, num_kv_heads, group):
    rng = np.random.default_rng(hash((page_size, group)) % 2**32)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=num_kv_heads,
                           group=group)
    layer, scale = jnp.int32(1), 0.25
    want = jax.jit(ref.ragged_paged_attention, static_argnames="sm_scale")(
        q, kv, layer, md, sm_scale=scale)
    got = jax.jit(lambda q, kv, layer, md: pallas_ragged.ragged_paged_attention(
        q, kv, layer, md, sm_scale=scale, block_rows=16, block_keys=16))(q, kv, layer, md)
    dense = dense_outputs(q, kv, 1, md, reqs, page_size, scale)
    assert np.isfinite(np.asarray(got)).all()  # interpret mode starts outputs as NaN
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, dense) < 1e-5
    n_real = int(md.query_start_loc[len(reqs)])
    assert not np.asarray(got[n_real:]).any()  # padding tokens -> exactly 0


def test_pallas_bf16_and_layer_choice():
    """bf16 pages: error within bf16 rounding; a different layer gives a different answer."""
    rng = np.random.default_rng(7)
    reqs = [(45, 6), (30, 1), (12, 1)]
    q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=2, group=4, dtype=jnp.bfloat16)
    fn = jax.jit(lambda q, kv, layer, md: pallas_ragged.ragged_paged_attention(
        q, kv, layer, md, sm_scale=0.25, block_rows=16, block_keys=16))
    got = fn(q, kv, jnp.int32(0), md)
    dense0 = dense_outputs(q, kv, 0, md, reqs, 8, 0.25)
    assert rel_err(got.astype(jnp.float32), dense0) < 1e-2
    got1 = fn(q, kv, jnp.int32(1), md)
    assert rel_err(got1.astype(jnp.float32), dense0) > 0.1


def test_block_schedule_covers_every_token_once():
    """Each token, padding tail included, belongs to exactly one block of its own segment."""
    qsl = jnp.array([0, 5, 6, 6, 13, 13], jnp.int32)  # rows of 5, 1, 0, 7 tokens, 1 pad row
    num_tokens, bq = 16, 4
    sched = np.asarray(pallas_ragged.block_schedule(qsl, num_tokens, bq))
    owner = np.full(num_tokens, -1)
    for b, (req, t0, t1) in enumerate(sched.T):
        assert t1 - t0 <= bq
        for t in range(t0, t1):
            assert owner[t] == -1
            owner[t] = b
            if t < 13:
                assert np.searchsorted(np.asarray(qsl), t, side="right") - 1 == req
    assert (owner >= 0).all()


def test_write_kv_writes_exactly_the_new_slots():
    rng = np.random.default_rng(3)
    reqs = [(13, 5), (9, 1), (20, 2)]
    _, kv, md = make_batch(rng, reqs, page_size=4, num_kv_heads=2, group=1, num_layers=3)
    num_tokens = md.positions.shape[0]
    k = jnp.asarray(rng.standard_normal((num_tokens, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_tokens, 2, 16)), jnp.float32)
    new = jax.jit(ref.write_kv)(kv, jnp.int32(2), k, v, md.slot_mapping)
    new, old = np.asarray(new), np.asarray(kv)
    touched = np.zeros(old.shape, bool)
    for t, slot in enumerate(np.asarray(md.slot_mapping)):
        if slot < 0:
            continue
        page, off = divmod(int(slot), 4)
        np.testing.assert_array_equal(new[2, 0, :, page, off], k[t])
        np.testing.assert_array_equal(new[2, 1, :, page, off], v[t])
        touched[2, :, :, page, off] = True
    np.testing.assert_array_equal(new[~touched], old[~touched])
    assert touched.sum() == 2 * 2 * 16 * 8  # 8 real tokens, padding dropped


def test_backend_selection_on_cpu():
    from jaxllm.kernels import get_attention_fn
    assert get_attention_fn(None, "cpu") is ref.ragged_paged_attention
    assert get_attention_fn("reference", "cpu") is ref.ragged_paged_attention
    assert get_attention_fn("pallas", "cpu").keywords["interpret"] is True
    with pytest.raises(ValueError):
        get_attention_fn("mosaic", "cpu")
    with pytest.raises(ValueError):
        get_attention_fn("flash", "gpu")


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_mosaic_decode_in_cpu_interpreter(splits):
    """The Hopper kernel's logic (TMA ring, barriers, split-K, combine) in the GPU interpreter,
    with its race detector; only wgmma's A/B operand staging differs from the GPU path. 8 splits
    of 4 pages: splits with no page (the default cap of 32 gives a short context many)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode
    rng = np.random.default_rng(11)
    reqs = [(27, 1)]
    q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=1, group=4, head_dim=64,
                           pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    got = mosaic_decode.paged_decode_attention(q, kv, jnp.int32(1), md, sm_scale=0.3,
                                               num_splits=splits, num_stages=2, interpret=True)
    dense = dense_outputs(q, kv, 1, md, reqs, 8, 0.3)
    assert rel_err(np.asarray(got, np.float32), dense) < 1e-2
    assert not np.asarray(got[1:], np.float32).any()
    assert not ipc.get_races().races_found


def test_split_cap_lets_few_kv_heads_fill_the_sms(monkeypatch):
    """The default cap (32): one real token of a model with 4 KV heads splits 32 ways on 132 SMs
    (128 CTAs), with 8 KV heads 16 (the wave rule); JAXLLM_DECODE_MAX_SPLITS=16 caps it there;
    a bad value is an error naming the variable."""
    from jaxllm.kernels import decode_schedule as ds
    pos = jnp.asarray([700, -1], jnp.int32)
    monkeypatch.setenv("JAXLLM_DECODE_MAX_SPLITS", "16")
    assert ds.default_config(1, 4) == (16, 5)
    monkeypatch.delenv("JAXLLM_DECODE_MAX_SPLITS")
    assert ds.default_config(1, 4) == (32, 5) and int(ds.active_splits(pos, 4, 32)[0]) == 32
    assert ds.default_config(1, 8)[0] == 16 and int(ds.active_splits(pos, 8, 16)[0]) == 16
    assert int(ds.active_splits(jnp.asarray([700, 9], jnp.int32), 4, 32)[0]) == 16  # two real
    for bad in ("24", "x", "0"):
        monkeypatch.setenv("JAXLLM_DECODE_MAX_SPLITS", bad)
        with pytest.raises(ValueError, match="JAXLLM_DECODE_MAX_SPLITS"):
            ds.default_config(1, 4)


def test_mosaic_decode_splits_follow_the_real_tokens():
    """Auto splits: the grid is sized for one real token (4 splits on a 4-SM toy), two real
    tokens use 2 of them; the skipped CTAs write nothing and `combine` ignores their slots."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import decode_schedule, mosaic_decode
    rng = np.random.default_rng(12)
    reqs = [(27, 1), (35, 1)]
    q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=1, group=4, head_dim=64,
                           pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    assert decode_schedule.default_config(1, 1, num_sms=4)[0] == 4
    assert int(decode_schedule.active_splits(md.positions, 1, 4, num_sms=4)[0]) == 2
    o_part, lse = mosaic_decode.paged_decode_attention(
        q, kv, jnp.int32(1), md, sm_scale=0.3, num_stages=2, interpret=True, num_sms=4,
        return_partials=True)
    assert o_part.shape[0] == 4
    got = mosaic_decode.paged_decode_attention(q, kv, jnp.int32(1), md, sm_scale=0.3,
                                               num_stages=2, interpret=True, num_sms=4)
    dense = dense_outputs(q, kv, 1, md, reqs, 8, 0.3)
    assert rel_err(np.asarray(got, np.float32), dense) < 1e-2
    assert not np.asarray(got[2:], np.float32).any()
    assert not ipc.get_races().races_found
