"""Quantized KV pages (kernels/kv_quant.py): round-trip error bounds, and the kernels on
quantized pages against the reference on the same pages (Pallas in interpret mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels import dense_outputs, make_batch, rel_err

from jaxllm.kernels import kv_quant, pallas_ragged, ref

FORMATS = ["fp8", "fp8_e5m2", "int8", "int4"]


def quantized_pages(kv: jax.Array, name: str) -> jax.Array:
    dtype, width = kv_quant.page_layout(name, kv.dtype, kv.shape[-1])
    return kv_quant.encode(kv, dtype, width)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_bounds(name):
    rng = np.random.default_rng(0)
    D = 64
    # Rows of very different magnitudes: per-row scales must follow each row.
    x = rng.standard_normal((512, D)) * np.exp(rng.uniform(-4, 3, (512, 1)))
    x = jnp.asarray(x, jnp.float32)
    dtype, width = kv_quant.page_layout(name, jnp.float32, D)
    rows = kv_quant.encode(x, dtype, width)
    assert rows.shape == (512, width) and rows.dtype == dtype
    assert kv_quant.page_format(dtype, width, D) == ("fp8" if "fp8" in name else name)
    y = np.asarray(kv_quant.decode(rows, D))
    x = np.asarray(x)
    err = np.abs(y - x)
    if name.startswith("fp8"):
        mant = 3 if name == "fp8" else 2  # e4m3 / e5m2 mantissa bits
        tiny = 2.0 ** (-6 if name == "fp8" else -14)  # below: subnormal, absolute error
        bound = np.maximum(np.abs(x) * 2.0 ** -(mant + 1), tiny * 2.0 ** -mant)
        assert (err <= bound * 1.0001).all()
    elif name == "int8":
        step = np.abs(x).max(-1, keepdims=True) / 127 * (1 + 2 ** -8)  # scale stored as bfloat16
        assert (err <= step / 2 * 1.0001).all()
        assert (np.sign(y) * np.sign(x) >= 0).all()
    else:  # asymmetric: x = q * s + min, s and min stored as bfloat16
        lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
        step = (hi - lo) / 15 * (1 + 2 ** -8)
        assert (err <= step / 2 + np.abs(lo) * 2 ** -8 + 1e-6).all()
    assert (err > 0).any()  # it is lossy: the check can fail


def test_bytes_per_token_and_page_formats():
    assert kv_quant.bytes_per_token("auto", jnp.bfloat16, 128) == 256
    assert kv_quant.bytes_per_token("fp8", jnp.bfloat16, 128) == 128
    assert kv_quant.bytes_per_token("int8", jnp.bfloat16, 128) == 130
    assert kv_quant.bytes_per_token("int4", jnp.bfloat16, 128) == 68
    with pytest.raises(ValueError, match="int3"):
        kv_quant.page_layout("int3", jnp.bfloat16, 128)
    with pytest.raises(ValueError, match="match no KV format"):
        kv_quant.page_format(jnp.uint8, 50, 64)


CASES = [
    # (requests [(context, new tokens)], page size, kv heads, GQA group)
    ([(37, 37), (20, 1), (5, 1), (50, 9)], 8, 2, 1),  # prefill + decode + chunk
    ([(33, 1), (17, 1), (1, 1), (64, 1)], 16, 1, 4),  # decode only
]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("reqs,page_size,num_kv_heads,group", CASES)
def test_pallas_on_quantized_pages_matches_reference(name, reqs, page_size, num_kv_heads, group):
    rng = np.random.default_rng(page_size + group)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=num_kv_heads, group=group)
    pages = quantized_pages(kv, name)
    layer, scale = jnp.int32(1), 0.25
    want = jax.jit(ref.ragged_paged_attention, static_argnames="sm_scale")(
        q, pages, layer, md, sm_scale=scale)
    got = jax.jit(lambda q, kv, layer, md: pallas_ragged.ragged_paged_attention(
        q, kv, layer, md, sm_scale=scale, block_rows=16, block_keys=16))(q, pages, layer, md)
    assert np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) < 1e-5
    # The reference on quantized pages is textbook attention over the dequantized cache.
    dense = dense_outputs(q, kv_quant.decode(pages, kv.shape[-1]), 1, md, reqs, page_size, scale)
    assert rel_err(want, dense) < 1e-5
    # ... and close to attention over the unquantized cache, as the format allows.
    exact = dense_outputs(q, kv, 1, md, reqs, page_size, scale)
    assert rel_err(want, exact) < {"fp8": 0.06, "fp8_e5m2": 0.12, "int8": 0.01, "int4": 0.1}[name]
    n_real = int(md.query_start_loc[len(reqs)])
    assert not np.asarray(got[n_real:]).any()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_pallas_quantized_pages_bf16_queries(name):
    rng = np.random.default_rng(5)
    reqs = [(45, 6), (30, 1), (12, 1)]
    q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=2, group=4, dtype=jnp.bfloat16)
    pages = quantized_pages(kv, name)
    want = ref.ragged_paged_attention(q, pages, jnp.int32(0), md, sm_scale=0.25)
    got = pallas_ragged.ragged_paged_attention(q, pages, jnp.int32(0), md, sm_scale=0.25,
                                               block_rows=16, block_keys=16)
    assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("name", FORMATS)
def test_write_kv_encodes_new_rows(name):
    rng = np.random.default_rng(3)
    reqs = [(13, 5), (9, 1)]
    _, kv, md = make_batch(rng, reqs, page_size=4, num_kv_heads=2, group=1, num_layers=2)
    pages = quantized_pages(kv, name)
    T = md.positions.shape[0]
    k = jnp.asarray(rng.standard_normal((T, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((T, 2, 16)), jnp.float32)
    new = np.asarray(jax.jit(ref.write_kv)(pages, jnp.int32(1), k, v, md.slot_mapping))
    old = np.asarray(pages)
    width = pages.shape[-1]
    fmt = kv_quant.page_format(pages.dtype, width, 16)
    want = {0: np.asarray(kv_quant.encode_rows(k, pages.dtype, width)),
            1: np.asarray(kv_quant.encode_rows(v, pages.dtype, width))}
    if fmt in ("plain", "fp8"):
        where = np.arange(4 * width).reshape(4, width)  # slot s's row: its W elements
    else:
        where = kv_quant.record_index(fmt, 4, width)
    flat_new = new.reshape(new.shape[:4] + (-1,))
    touched = np.zeros(flat_new.shape, bool)
    for t, slot in enumerate(np.asarray(md.slot_mapping)):
        if slot >= 0:
            page, off = divmod(int(slot), 4)
            for which in (0, 1):
                np.testing.assert_array_equal(flat_new[1, which][:, page, where[off]],
                                              want[which][t])
            touched[1, :, :, page, where[off]] = True
    np.testing.assert_array_equal(flat_new[~touched], old.reshape(flat_new.shape)[~touched])
    # Decoded, the written slots hold the new rows as the format allows.
    got = np.asarray(kv_quant.decode(jnp.asarray(new[1, 0]), 16))  # [K, P, S, D]
    exp = np.asarray(kv_quant.decode_rows(jnp.asarray(want[0]), 16))  # [T, K, D]
    for t, slot in enumerate(np.asarray(md.slot_mapping)):
        if slot >= 0:
            np.testing.assert_array_equal(got[:, slot // 4, slot % 4], exp[t])


@pytest.mark.parametrize("name,page_size,head_dim", [
    ("int8", 16, 128), ("int8", 8, 64), ("int4", 16, 128), ("int4", 8, 64)])
def test_int_pages_are_page_major(name, page_size, head_dim):
    """int8 / int4 pages in the split layout: a page's values are one contiguous [S, Dv] block
    (what a TMA box of the page viewed [S * W / 16, 16] copies into shared memory as linear
    bytes), then its S bfloat16 scales, then (int4) its S bfloat16 minimums, each field planar:
    the S low bytes, then the S high bytes (contiguous runs, which the Mosaic kernel loads)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, page_size, head_dim)), jnp.float32)  # 3 pages
    dtype, width = kv_quant.page_layout(name, jnp.float32, head_dim)
    pages = np.asarray(kv_quant.encode(x, dtype, width))
    assert pages.shape == (3, page_size, width)
    records = np.asarray(kv_quant.encode_rows(x, dtype, width))  # [3, S, W]: values, scale, min
    dv = head_dim if name == "int8" else head_dim // 2
    assert (page_size * width) % 16 == 0 and (page_size * dv) % 16 == 0
    boxes = pages.reshape(3, page_size * width // 16, 16)  # the TMA view of the page array

    def field(p: int, f: int) -> np.ndarray:  # [S] float32 from the field's planar bytes
        at = page_size * dv + 2 * page_size * f
        lo, hi = (pages[p].reshape(-1)[at + b * page_size:at + (b + 1) * page_size]
                  for b in (0, 1))
        np.testing.assert_array_equal(np.stack([lo, hi], -1),
                                      records[p, :, dv + 2 * f:dv + 2 * f + 2])
        return ((lo.astype(np.uint32) << 16) | (hi.astype(np.uint32) << 24)).view(np.float32)

    for p in range(3):
        vals = boxes[p, :page_size * dv // 16].reshape(page_size, dv)  # the values' box
        np.testing.assert_array_equal(vals, records[p, :, :dv])
        if name == "int4":
            field(p, 0)  # the scales' bytes (their values: the decode check below)
            np.testing.assert_allclose(field(p, 1), np.asarray(x[p]).min(-1), rtol=2 ** -8)
        else:
            np.testing.assert_allclose(field(p, 0), np.abs(np.asarray(x[p])).max(-1) / 127,
                                       rtol=2 ** -8)
    # a record's bytes land where record_index says, and decode inverts encode
    idx = kv_quant.record_index(name, page_size, width)
    assert sorted(idx.ravel().tolist()) == list(range(page_size * width))
    np.testing.assert_array_equal(pages.reshape(3, -1)[:, idx], records)
    np.testing.assert_array_equal(np.asarray(kv_quant.decode(jnp.asarray(pages), head_dim)),
                                  np.asarray(kv_quant.decode_rows(jnp.asarray(records), head_dim)))


def test_offload_fingerprint_names_the_int_page_layout(monkeypatch):
    """Stored KV blocks (disk tier, transfer) are keyed by the connector fingerprint: int8 / int4
    pages add kv_quant.LAYOUT_VERSION, so blocks of another byte layout never match."""
    from types import SimpleNamespace

    from jaxllm.kv_transfer.factory import fingerprint

    eng = SimpleNamespace(block_size=16, model="m", seed=0)
    model = SimpleNamespace(head_dim=64)
    shape = {"int8": (2, 2, 1, 16, 66), "int4": (2, 2, 1, 16, 36), "auto": (2, 2, 1, 16, 64)}
    dtype = {"int8": np.uint8, "int4": np.uint8, "auto": np.float32}
    before = {k: fingerprint(eng, model, shape[k], np.dtype(dtype[k]), False) for k in shape}
    monkeypatch.setitem(kv_quant.LAYOUT_VERSION, "int8", "other")
    after = {k: fingerprint(eng, model, shape[k], np.dtype(dtype[k]), False) for k in shape}
    assert before["int8"] != after["int8"]
    assert before["int4"] == after["int4"] and before["auto"] == after["auto"]
