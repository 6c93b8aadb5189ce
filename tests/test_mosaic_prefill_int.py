"""The Mosaic GPU prefill/mixed kernel on int8 / int4 pages (kernels/mosaic_prefill.py, the
byte copies and register dequantization of kernels/mosaic_kv_quant.py that the decode kernel
uses): in Mosaic GPU's CPU interpreter with its race detector against the reference on the same
pages (ragged: a prefill chunk over a cached prefix, a decode row, padding), and lowered for the
cuda platform (the compiled path's buffer shapes and layouts; also under jax 0.11.2 with
scripts/jax011_lowering.sh). The interpreter costs about a second per CTA: few tokens, D = 64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels import make_batch, rel_err
from test_kv_quant import quantized_pages

from jaxllm.kernels import ref

# (format, requests [(context, new)], kv heads, GQA group, page size):
# int8: G 4 (32 tokens a block), a 40-token chunk over 110 cached tokens (a full block and a
# partial one, 3 steps of 64 keys: unmasked and masked), a decode row, pages of 16 (4 a tile);
# int4: G 2 (64 tokens a block), pages of 8 (8 a tile), two kv heads.
CASES = [
    ("int8", [(150, 40), (40, 1)], 1, 4, 16, 5e-3),
    ("int4", [(70, 13), (33, 1)], 2, 2, 8, 5e-2),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,reqs,kv_heads,group,page_size,apart", CASES)
def test_mosaic_prefill_on_int_pages_matches_reference(name, reqs, kv_heads, group, page_size,
                                                       apart):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_prefill

    rng = np.random.default_rng(5)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=kv_heads, group=group,
                           head_dim=64, pad_reqs=1, pad_tokens=2, dtype=jnp.bfloat16)
    pages = quantized_pages(kv, name)
    assert pages.dtype == jnp.uint8 and pages.shape[-1] != kv.shape[-1]
    got = mosaic_prefill.ragged_prefill_attention(q, pages, jnp.int32(1), md, sm_scale=0.3,
                                                  num_stages=2, interpret=True)
    assert got.dtype == q.dtype and got.shape == q.shape
    got = np.asarray(got, np.float32)
    n = sum(new for _, new in reqs)
    want = np.asarray(ref.ragged_paged_attention(q, pages, jnp.int32(1), md, sm_scale=0.3),
                      np.float32)
    assert rel_err(got[:n], want[:n]) < 3e-3  # measured 1.7e-3 (int8) / 1.4e-3 (int4)
    # The kernel read the quantized values (the reference on the bf16 data they were made from
    # differs by 1.1e-2 / 1.6e-1), with their scales (and minimums).
    unquantized = np.asarray(ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.3),
                             np.float32)
    assert rel_err(got[:n], unquantized[:n]) > apart
    assert not got[n:].any()  # the padding tokens
    assert not ipc.get_races().races_found


@pytest.mark.parametrize("name,group,page_size,head_dim", [
    ("int8", 4, 16, 128), ("int4", 4, 16, 128), ("int8", 8, 8, 64), ("int4", 1, 32, 128),
    ("int4", 2, 64, 64)])
def test_mosaic_prefill_on_int_pages_lowers_for_cuda(name, group, page_size, head_dim):
    """The compiled path (no interpreter), lowered for cuda on the CPU: every layout and
    conversion rule of the byte copies, the scale rows and the dequantization runs here (the
    decode kernel's int path failed exactly there under jax 0.11.2 until session 21's fix).
    Ragged batch, T not a multiple of 8."""
    from jaxllm.kernels import mosaic_prefill

    rng = np.random.default_rng(group)
    q, kv, md = make_batch(rng, [(300, 45), (20, 1), (9, 9)], page_size=page_size,
                           num_kv_heads=2, group=group, head_dim=head_dim, num_layers=1,
                           pad_tokens=2, dtype=jnp.bfloat16)
    pages = quantized_pages(kv, name)
    f = jax.jit(lambda q, kv, md: mosaic_prefill.ragged_prefill_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.1))
    text = f.trace(q, pages, md).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@mosaic_gpu_v2") == 1  # one kernel call site


def test_mosaic_prefill_int_page_rules():
    """Int pages the copies cannot move (more values than one copy: int8 pages of 64 keys at
    D = 128; pages larger than the 64-key tile) are refused by name, for the Pallas kernel; the
    block is 64 keys; the engine routes no int format to this kernel until a GPU has checked
    it (mosaic_prefill.INT_FORMATS)."""
    from jaxllm.kernels import mosaic_prefill

    assert mosaic_prefill.default_block_keys(128, True, "int8") == 64
    assert mosaic_prefill.default_block_keys(64, True, "int4") == 64
    assert mosaic_prefill.INT_FORMATS == ()
    rng = np.random.default_rng(6)
    for name, page_size, head_dim in (("int8", 64, 128), ("int4", 128, 128)):
        q, kv, md = make_batch(rng, [(9, 3)], page_size=page_size, num_kv_heads=1, group=4,
                               head_dim=head_dim, pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
        with pytest.raises(ValueError, match="Pallas kernel"):
            mosaic_prefill.ragged_prefill_attention(q, quantized_pages(kv, name), jnp.int32(1), md,
                                                    sm_scale=0.3, interpret=True)
    q, kv, md = make_batch(rng, [(9, 3)], page_size=16, num_kv_heads=1, group=4, head_dim=128,
                           pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    g = mosaic_prefill.int_pages(quantized_pages(kv, "int4"), 128)
    assert (g.fmt, g.ppb, g.keys) == ("int4", 4, 64)
    assert mosaic_prefill.int_pages(kv, 128) is None


def test_int_pages_routed_probed_and_measured_as_such(monkeypatch):
    """Once an int format is routed (mosaic_prefill.INT_FORMATS), a prefill/mixed step on its
    pages goes to the Mosaic kernel where the choice says so, and the choice's key names the
    format ("int8" / "int4", not the pages' uint8), so it is probed and measured on its own; the
    probe builds pages of that format (here a stand-in kernel, CPU) and refuses shapes the
    copies cannot move before any probe. Not routed: the Pallas kernel, unasked."""
    import jaxllm.kernels as kernels
    from jaxllm.kernels import mosaic_prefill, prefill_choice

    rng = np.random.default_rng(8)
    q, kv, md = make_batch(rng, [(40, 5), (9, 1)], page_size=16, num_kv_heads=2, group=4,
                           head_dim=64, dtype=jnp.bfloat16)
    calls, keys = [], []
    monkeypatch.setattr(prefill_choice, "prefill_kernel",
                        lambda q, kv: keys.append(prefill_choice.page_name(kv, q.shape[-1]))
                        or "mosaic")
    monkeypatch.setattr(mosaic_prefill, "ragged_prefill_attention",
                        lambda q, *a, **k: calls.append("mosaic") or q)
    monkeypatch.setattr(kernels, "_pallas_fn", lambda: lambda q, *a, **k: calls.append("pallas") or q)
    for routed, want in (((), ["pallas", "pallas"]), (("int8", "int4"), ["mosaic", "mosaic"])):
        monkeypatch.setattr(mosaic_prefill, "INT_FORMATS", routed)
        calls.clear()
        keys.clear()
        for name in ("int8", "int4"):
            kernels.gpu_prefill_attention(q, quantized_pages(kv, name), jnp.int32(0), md,
                                          sm_scale=0.1)
        assert calls == want
        assert keys == ([] if not routed else ["int8", "int4"])
    monkeypatch.undo()

    monkeypatch.setattr(prefill_choice, "is_hopper", lambda: True)
    probes = []
    monkeypatch.setattr(prefill_choice, "run_probe", lambda *a, **k: probes.append(k) or (True, "ok"))
    prefill_choice.mosaic_prefill_ok.cache_clear()
    assert prefill_choice.mosaic_prefill_ok(32, 8, 128, 16, "bfloat16", "int4")[0]
    assert probes == [{"page_dtype_name": "int4"}]
    ok, why = prefill_choice.mosaic_prefill_ok(32, 8, 128, 64, "bfloat16", "int8")
    assert not ok and "Pallas kernel" in why and len(probes) == 1  # values over one copy
    prefill_choice.mosaic_prefill_ok.cache_clear()
    monkeypatch.undo()

    def stand_in(q, kv, layer, md, *, sm_scale, block_keys, interpret):
        assert kv.dtype == jnp.uint8 and kv.shape[-1] == 64 // 2 + 4  # int4's split layout
        return ref.ragged_paged_attention(q, kv, layer, md, sm_scale=sm_scale)

    monkeypatch.setattr(mosaic_prefill, "ragged_prefill_attention", stand_in)
    ok, why = prefill_choice.run_probe(8, 2, 64, 16, "bfloat16", interpret=True,
                                       page_dtype_name="int4")
    assert ok, why
    monkeypatch.setattr(mosaic_prefill, "ragged_prefill_attention",
                        lambda *a, **k: stand_in(*a, **k) * 1.1)  # a wrong kernel is caught
    ok, why = prefill_choice.run_probe(8, 2, 64, 16, "bfloat16", interpret=True,
                                       page_dtype_name="int4")
    assert not ok and "mismatch" in why
