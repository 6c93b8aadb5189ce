"""The Mosaic GPU decode kernel on fp8 pages (kernels/mosaic_decode.py), in Mosaic GPU's CPU
interpreter with its race detector, against the reference on the same fp8 pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels import make_batch, rel_err
from test_kv_quant import quantized_pages

from jaxllm.kernels import ref


@pytest.mark.parametrize("name,splits", [("fp8", 1), ("fp8_e5m2", 2)])
def test_mosaic_decode_on_fp8_pages_matches_reference(name, splits):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(21)
    reqs = [(27, 1)]
    q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=1, group=4, head_dim=64,
                           pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    pages = quantized_pages(kv, name)
    assert pages.dtype.itemsize == 1
    got = mosaic_decode.paged_decode_attention(q, pages, jnp.int32(1), md, sm_scale=0.3,
                                               num_splits=splits, num_stages=2, interpret=True)
    want = ref.ragged_paged_attention(q, pages, jnp.int32(1), md, sm_scale=0.3)
    assert rel_err(np.asarray(got[:1], np.float32), np.asarray(want[:1], np.float32)) < 1e-2
    assert not np.asarray(got[1:], np.float32).any()
    assert not ipc.get_races().races_found
    # The same pages in bf16 (dequantized) give the same result: the kernel read them as fp8.
    deq = mosaic_decode.paged_decode_attention(q, pages.astype(jnp.bfloat16), jnp.int32(1), md,
                                               sm_scale=0.3, num_splits=splits, num_stages=2,
                                               interpret=True)
    assert rel_err(np.asarray(got, np.float32), np.asarray(deq, np.float32)) < 1e-3


def test_mosaic_decode_refuses_int_pages():
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(22)
    q, kv, md = make_batch(rng, [(9, 1)], page_size=8, num_kv_heads=1, group=4, head_dim=64,
                           pad_reqs=0, pad_tokens=1, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="Pallas kernel"):
        mosaic_decode.paged_decode_attention(q, quantized_pages(kv, "int8"), jnp.int32(1), md,
                                             sm_scale=0.3, interpret=True)
