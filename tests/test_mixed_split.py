"""Mixed steps with the decode rows on the decode kernel (kernels/mixed_split.py), on CPU:
the composition against the reference and the textbook definition, with the Pallas and Mosaic
kernels in their interpreters."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import mixed_split, ref
from test_kernels import dense_outputs, make_batch, rel_err

MIXED = [
    # (requests [(context, new tokens)], page size, kv heads, GQA group)
    ([(37, 37), (20, 1), (5, 1), (50, 9)], 8, 2, 1),  # prefill, decode rows, a chunk
    ([(23, 11), (9, 1), (40, 40), (64, 1), (1, 1)], 4, 2, 4),  # chunk over a prefix, tiny pages
    ([(33, 1), (17, 1)], 8, 1, 8),  # decode rows only (the split must still be exact)
    ([(30, 30)], 8, 2, 2),  # no decode row at all
]


@pytest.mark.parametrize("reqs,page_size,num_kv_heads,group", MIXED)
def test_split_with_reference_kernels_equals_the_reference(reqs, page_size, num_kv_heads, group):
    rng = np.random.default_rng(len(reqs) * 7 + group)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=num_kv_heads, group=group)
    want = ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.25)
    got = mixed_split.split_decode_rows(q, kv, jnp.int32(1), md, sm_scale=0.25,
                                        decode_fn=ref.ragged_paged_attention,
                                        prefill_fn=ref.ragged_paged_attention)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    dense = dense_outputs(q, kv, 1, md, reqs, page_size, 0.25)
    assert rel_err(got, dense) < 1e-4
    n = int(md.query_start_loc[-1])
    assert not np.asarray(got[n:]).any()  # padding tokens stay 0


def test_decode_row_mask_marks_one_token_rows_only() -> None:
    rng = np.random.default_rng(3)
    _, _, md = make_batch(rng, [(37, 37), (20, 1), (50, 9), (1, 1)], page_size=8, num_kv_heads=1,
                          group=1, pad_reqs=2)
    assert np.asarray(mixed_split.decode_row_mask(md)).tolist() == [False, True, False, True, False, False]


def test_split_on_the_hopper_kernels_in_their_interpreters() -> None:
    """The GPU composition: Mosaic decode kernel (GPU interpreter, race detector on) for the decode
    rows, the Pallas kernel (interpret mode) for the rest, against the textbook attention."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode, pallas_ragged
    reqs = [(27, 1), (40, 13), (9, 1), (16, 16)]
    rng = np.random.default_rng(5)
    q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=1, group=4, head_dim=64,
                           pad_reqs=1, pad_tokens=2, dtype=jnp.bfloat16)
    decode = functools.partial(mosaic_decode.paged_decode_attention, num_stages=2, interpret=True,
                               num_sms=4)
    prefill = functools.partial(pallas_ragged.ragged_paged_attention, interpret=True)
    got = mixed_split.split_decode_rows(q, kv, jnp.int32(1), md, sm_scale=0.3, decode_fn=decode,
                                        prefill_fn=prefill)
    dense = dense_outputs(q, kv, 1, md, reqs, 8, 0.3)
    assert rel_err(np.asarray(got, np.float32), dense) < 1e-2
    assert not np.asarray(got[int(md.query_start_loc[-1]):], np.float32).any()
    assert not ipc.get_races().races_found


def test_mode_is_opt_in_and_checked(monkeypatch) -> None:
    monkeypatch.delenv("JAXLLM_MIXED_DECODE_ROWS", raising=False)
    assert mixed_split.mode() == "prefill"
    monkeypatch.setenv("JAXLLM_MIXED_DECODE_ROWS", "decode")
    assert mixed_split.mode() == "decode"
    monkeypatch.setenv("JAXLLM_MIXED_DECODE_ROWS", "both")
    with pytest.raises(ValueError, match="JAXLLM_MIXED_DECODE_ROWS"):
        mixed_split.mode()
