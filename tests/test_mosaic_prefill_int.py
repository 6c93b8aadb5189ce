"""The Mosaic GPU prefill/mixed kernel on int8 / int4 pages (kernels/mosaic_prefill.py, the
byte copies and register dequantization of kernels/mosaic_kv_quant.py that the decode kernel
uses): the shapes it refuses, and how the engine routes, probes and measures such pages. Its
results against the reference (interpreter) and its lowering for cuda:
tests/test_mosaic_prefill_fp8.py, beside the fp8 cases."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels import make_batch
from test_kv_quant import quantized_pages
from test_mosaic_prefill_fp8 import probe_with_a_stand_in


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

    probe_with_a_stand_in(monkeypatch, "int4",  # int4's split layout
                          lambda kv: kv.dtype == jnp.uint8 and kv.shape[-1] == 64 // 2 + 4)
