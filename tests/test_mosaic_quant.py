"""The Mosaic GPU decode kernel on fp8, int8 and int4 pages (kernels/mosaic_decode.py,
mosaic_kv_quant.py): in Mosaic GPU's CPU interpreter with its race detector against the
reference on the same pages, lowered for the cuda platform (the compiled path, which converts
every format through f16: the H200 has no fp8 -> bf16 conversion), and the engine's routing
of each page format on decode steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels import make_batch, rel_err
from test_kv_quant import quantized_pages

from jaxllm.kernels import ref

# (format, splits, requests [(context, new)], kv heads, GQA group, early V conversion):
# ragged contexts (1 to 9 pages of 8, so one or two 64-key steps, tails masked), padding rows
# and a padding token.
FP8_CASES = [
    ("fp8", 1, [(27, 1), (70, 1), (3, 1)], 2, 4, False),
    ("fp8_e5m2", 2, [(70, 1), (9, 1)], 1, 8, True),
]


@pytest.mark.parametrize("name,splits,reqs,kv_heads,group,early", FP8_CASES)
def test_mosaic_decode_on_fp8_pages_matches_reference(name, splits, reqs, kv_heads, group,
                                                      early):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(21)
    q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=kv_heads, group=group,
                           head_dim=64, pad_reqs=1, pad_tokens=1, dtype=jnp.bfloat16)
    pages = quantized_pages(kv, name)
    assert pages.dtype.itemsize == 1
    got = mosaic_decode.paged_decode_attention(q, pages, jnp.int32(1), md, sm_scale=0.3,
                                               num_splits=splits, num_stages=2, interpret=True,
                                               early_v_convert=early)
    got = np.asarray(got, np.float32)
    n = len(reqs)
    want = np.asarray(ref.ragged_paged_attention(q, pages, jnp.int32(1), md, sm_scale=0.3),
                      np.float32)
    assert rel_err(got[:n], want[:n]) < 5e-3  # measured 7e-4 / 8e-4
    # The tolerance separates the fp8 pages from the bf16 data they were made from (the
    # reference on those differs by 4e-2 / 9e-2): the kernel read the fp8 values.
    unquantized = np.asarray(ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.3),
                             np.float32)
    assert rel_err(want[:n], unquantized[:n]) > 2e-2
    assert not got[n:].any()  # the padding token
    assert not ipc.get_races().races_found


@pytest.mark.parametrize("name,splits,early", [
    ("fp8", 1, False), ("fp8_e5m2", 1, False), ("fp8", 4, False), ("fp8", 1, True)])
def test_mosaic_decode_on_fp8_pages_lowers_for_cuda(name, splits, early):
    """The compiled path (no interpreter), lowered for cuda on the CPU: lowering to the
    Mosaic GPU dialect runs every layout and conversion rule, so the fp8 -> bf16 cast the
    H200 refused (only fp8 -> f16 exists on Hopper) fails here too. B=4, Llama-3 heads."""
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(23)
    q, kv, md = make_batch(rng, [(300, 1), (20, 1), (77, 1)], page_size=16, num_kv_heads=8,
                           group=4, head_dim=128, num_layers=1, pad_reqs=0, pad_tokens=1,
                           dtype=jnp.bfloat16)
    pages = quantized_pages(kv, name)
    f = jax.jit(lambda q, kv, md: mosaic_decode.paged_decode_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.1, num_splits=splits, early_v_convert=early))
    text = f.trace(q, pages, md).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# int8 / int4 pages (split layout): (format, splits, requests, kv heads, GQA group, page size,
# head dim, early V conversion). Rows of very different magnitudes, so every key's own scale
# (and int4 minimum) matters; one and several pages a 64-key tile, one and two tiles a split.
INT_CASES = [
    ("int8", 1, [(27, 1), (70, 1), (3, 1)], 2, 4, 8, 64, False),
    ("int8", 2, [(70, 1), (9, 1)], 1, 8, 16, 128, True),
    ("int8", 1, [(70, 1), (9, 1)], 1, 4, 32, 128, False),  # one copy of 256 rows a page
    ("int4", 1, [(27, 1), (70, 1), (3, 1)], 2, 4, 8, 64, True),
    ("int4", 3, [(130, 1), (9, 1)], 1, 4, 16, 128, False),
]


@pytest.mark.parametrize("name,splits,reqs,kv_heads,group,page_size,head_dim,early", INT_CASES)
def test_mosaic_decode_on_int_pages_matches_reference(name, splits, reqs, kv_heads, group,
                                                      page_size, head_dim, early):
    """The kernel reads int8 / int4 pages as stored (values and scale bytes copied),
    dequantizes each tile in registers into its f16 staging tile and matches the reference on
    the same pages; in the interpreter with its race detector."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(31)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=kv_heads, group=group,
                           head_dim=head_dim, pad_reqs=1, pad_tokens=1, dtype=jnp.bfloat16)
    kv = kv * jnp.asarray(np.exp(rng.uniform(-2, 2, kv.shape[:-1] + (1,))), kv.dtype)
    pages = quantized_pages(kv, name)
    assert pages.dtype == jnp.uint8
    got = mosaic_decode.paged_decode_attention(q, pages, jnp.int32(1), md, sm_scale=0.3,
                                               num_splits=splits, num_stages=2, interpret=True,
                                               early_v_convert=early)
    got = np.asarray(got, np.float32)
    n = len(reqs)
    want = np.asarray(ref.ragged_paged_attention(q, pages, jnp.int32(1), md, sm_scale=0.3),
                      np.float32)
    assert rel_err(got[:n], want[:n]) < 3e-3  # f16 staging, bf16 output: measured 7e-4 to 1.5e-3
    unquantized = np.asarray(ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.3),
                             np.float32)
    # The tolerance is below the formats' own error (int8 6e-3 / 9e-3, int4 0.2 / 0.25): the
    # kernel read the quantized values with their scales.
    assert rel_err(want[:n], unquantized[:n]) > 6e-3
    assert not got[n:].any()  # the padding token
    assert not ipc.get_races().races_found


# The producer converts (`deq_stages` d > 0): (format, splits, requests, kv heads, group, page
# size, head dim, pipeline stages, d). Steps past both rings (9 pages of 8 at 64 keys a step
# with 2 stages wrap twice), one step only, and a split.
PRODUCER_CASES = [
    ("fp8", 1, [(27, 1), (130, 1), (3, 1)], 2, 4, 8, 64, 2, 2),
    ("fp8_e5m2", 2, [(200, 1), (9, 1)], 1, 8, 16, 128, 3, 1),
    ("int8", 1, [(70, 1), (300, 1)], 1, 4, 16, 128, 3, 2),
    ("int4", 1, [(27, 1), (200, 1), (3, 1)], 2, 4, 8, 64, 2, 3),
]


@pytest.mark.parametrize("name,splits,reqs,kv_heads,group,page_size,head_dim,stages,dst",
                         PRODUCER_CASES)
def test_mosaic_decode_with_producer_conversion_matches_reference(
        name, splits, reqs, kv_heads, group, page_size, head_dim, stages, dst):
    """deq_stages > 0: the producer warpgroup converts each tile into a ring of f16 staging
    tiles behind its copies and the consumer only waits for them; in the interpreter with its
    race detector (every barrier phase and staging slot reuse checked) against the reference
    on the same quantized pages."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(41)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=kv_heads, group=group,
                           head_dim=head_dim, pad_reqs=1, pad_tokens=1, dtype=jnp.bfloat16)
    kv = kv * jnp.asarray(np.exp(rng.uniform(-2, 2, kv.shape[:-1] + (1,))), kv.dtype)
    pages = quantized_pages(kv, name)
    got = mosaic_decode.paged_decode_attention(q, pages, jnp.int32(1), md, sm_scale=0.3,
                                               num_splits=splits, num_stages=stages,
                                               interpret=True, deq_stages=dst)
    got = np.asarray(got, np.float32)
    n = len(reqs)
    want = np.asarray(ref.ragged_paged_attention(q, pages, jnp.int32(1), md, sm_scale=0.3),
                      np.float32)
    assert rel_err(got[:n], want[:n]) < 3e-3
    unquantized = np.asarray(ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.3),
                             np.float32)
    assert rel_err(want[:n], unquantized[:n]) > 6e-3  # the kernel read the quantized values
    assert not got[n:].any()  # the padding token
    assert not ipc.get_races().races_found


@pytest.mark.parametrize("name,splits,page_size,stages,dst", [
    ("fp8", 1, 16, 2, 2), ("fp8", 4, 16, 3, 2), ("fp8_e5m2", 1, 16, 4, 1), ("int8", 1, 16, 2, 2),
    ("int4", 2, 16, 3, 2)])
def test_mosaic_decode_with_producer_conversion_lowers_for_cuda(name, splits, page_size, stages,
                                                                 dst):
    """The producer-converts schedule's compiled path (staging rings, the three barrier rings),
    lowered for cuda on the CPU at Llama-3 heads (D 128)."""
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(23)
    q, kv, md = make_batch(rng, [(300, 1), (20, 1), (77, 1)], page_size=page_size, num_kv_heads=8,
                           group=4, head_dim=128, num_layers=1, pad_reqs=0, pad_tokens=1,
                           dtype=jnp.bfloat16)
    f = jax.jit(lambda q, kv, md: mosaic_decode.paged_decode_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.1, num_splits=splits, num_stages=stages,
        deq_stages=dst))
    text = f.trace(q, quantized_pages(kv, name), md).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("name,splits,page_size,head_dim,early", [
    ("int8", 1, 16, 128, False), ("int8", 4, 16, 128, True), ("int8", 1, 32, 128, True),
    ("int8", 2, 8, 64, True), ("int4", 1, 16, 128, True), ("int4", 4, 32, 128, False),
    ("int4", 2, 8, 64, True)])
def test_mosaic_decode_on_int_pages_lowers_for_cuda(name, splits, page_size, head_dim, early):
    """The compiled path (bulk copies, `plgpu.load` of the linear value tile and of the scale
    bytes in the rows' layout, the int4 half-tile stores), lowered for cuda on the CPU."""
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(23)
    q, kv, md = make_batch(rng, [(300, 1), (20, 1), (77, 1)], page_size=page_size, num_kv_heads=8,
                           group=4, head_dim=head_dim, num_layers=1, pad_reqs=0, pad_tokens=1,
                           dtype=jnp.bfloat16)
    f = jax.jit(lambda q, kv, md: mosaic_decode.paged_decode_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.1, num_splits=splits, early_v_convert=early))
    text = f.trace(q, quantized_pages(kv, name), md).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("name,decode_kernel", [
    ("auto", True), ("fp8", True), ("fp8_e5m2", True), ("int8", False), ("int4", True)])
def test_mosaic_backend_routes_decode_steps_by_page_format(monkeypatch, name, decode_kernel):
    """On Hopper decode steps (T <= R), bf16, fp8 and int4 pages go to the Mosaic decode kernel,
    int8 pages (not routed: slower there than the Pallas kernel on an H200,
    mosaic_kv_quant.INT_FORMATS) to the prefill/mixed path; prefill steps (T > R) always go to
    the prefill/mixed path."""
    from jaxllm.kernels import mosaic_attention, mosaic_decode

    calls = []
    monkeypatch.setattr(mosaic_decode, "paged_decode_attention",
                        lambda q, *a, **k: calls.append("decode") or q)
    prefill = lambda q, *a, **k: calls.append("prefill") or q  # noqa: E731
    rng = np.random.default_rng(24)
    for reqs, pad_reqs in (([(40, 1), (9, 1)], 1), ([(40, 5)], 0)):  # decode, then prefill
        q, kv, md = make_batch(rng, reqs, page_size=8, num_kv_heads=2, group=4, head_dim=128,
                               pad_reqs=pad_reqs, pad_tokens=1, dtype=jnp.bfloat16)
        pages = kv if name == "auto" else quantized_pages(kv, name)
        mosaic_attention(q, pages, jnp.int32(0), md, sm_scale=0.1, prefill_fn=prefill)
    assert calls == ["decode" if decode_kernel else "prefill", "prefill"]


def test_decode_deq_stages_reach_the_kernel_and_bad_values_name_the_variable(monkeypatch):
    """JAXLLM_DECODE_DEQ_STAGES is passed to the decode kernel as `deq_stages` (default 0);
    a negative or non-integer value is an error naming the variable."""
    from jaxllm.kernels import mosaic_attention, mosaic_decode

    seen = []
    monkeypatch.setattr(mosaic_decode, "paged_decode_attention",
                        lambda q, *a, **k: seen.append(k["deq_stages"]) or q)
    rng = np.random.default_rng(24)
    q, kv, md = make_batch(rng, [(40, 1), (9, 1)], page_size=8, num_kv_heads=2, group=4,
                           head_dim=128, pad_reqs=1, pad_tokens=1, dtype=jnp.bfloat16)
    pages = quantized_pages(kv, "fp8")
    for value in (None, "2"):
        if value is not None:
            monkeypatch.setenv("JAXLLM_DECODE_DEQ_STAGES", value)
        mosaic_attention(q, pages, jnp.int32(0), md, sm_scale=0.1)
    assert seen == [0, 2]
    for bad in ("-1", "two"):
        monkeypatch.setenv("JAXLLM_DECODE_DEQ_STAGES", bad)
        with pytest.raises(ValueError, match="JAXLLM_DECODE_DEQ_STAGES"):
            mosaic_attention(q, pages, jnp.int32(0), md, sm_scale=0.1)


def test_decode_qk_fp8_is_opt_in_and_only_on_e4m3_pages(monkeypatch):
    """JAXLLM_DECODE_QK_FP8=1 passes qk_fp8 to the decode kernel on e4m3 pages only (e5m2
    queries would keep two mantissa bits; the producer-converts schedule keeps its own path);
    off by default, and a value other than 0 / 1 is an error naming the variable."""
    from jaxllm.kernels import mosaic_attention, mosaic_decode

    seen = []
    monkeypatch.setattr(mosaic_decode, "paged_decode_attention",
                        lambda q, *a, **k: seen.append(k["qk_fp8"]) or q)
    rng = np.random.default_rng(25)
    q, kv, md = make_batch(rng, [(40, 1), (9, 1)], page_size=8, num_kv_heads=2, group=4,
                           head_dim=128, pad_reqs=1, pad_tokens=1, dtype=jnp.bfloat16)
    e4m3, e5m2 = quantized_pages(kv, "fp8"), quantized_pages(kv, "fp8_e5m2")
    mosaic_attention(q, e4m3, jnp.int32(0), md, sm_scale=0.1)
    monkeypatch.setenv("JAXLLM_DECODE_QK_FP8", "1")
    for pages in (e4m3, e5m2):
        mosaic_attention(q, pages, jnp.int32(0), md, sm_scale=0.1)
    monkeypatch.setenv("JAXLLM_DECODE_DEQ_STAGES", "2")
    mosaic_attention(q, e4m3, jnp.int32(0), md, sm_scale=0.1)
    assert seen == [False, True, False, False]
    monkeypatch.setenv("JAXLLM_DECODE_QK_FP8", "yes")
    with pytest.raises(ValueError, match="JAXLLM_DECODE_QK_FP8"):
        mosaic_attention(q, e4m3, jnp.int32(0), md, sm_scale=0.1)


def test_mosaic_backend_routes_int_pages_by_shape(monkeypatch):
    """int8 / int4 pages go to the decode kernel only for routed formats (int4 at D = 128 by
    default: int8 measured slower there than in the Pallas kernel; D = 64 unchecked on a GPU)
    and in shapes it reads (pages dividing its 64-key tile, whose values
    and scale bytes the copies can move); others take the prefill/mixed path on decode steps
    too."""
    from jaxllm.kernels import kv_quant, mosaic_attention, mosaic_decode, mosaic_kv_quant

    def pages(name, page_size, head_dim):
        dtype, width = kv_quant.page_layout(name, jnp.bfloat16, head_dim)
        return jax.ShapeDtypeStruct((1, 2, 1, 4, page_size, width), dtype)

    kernel = mosaic_kv_quant.KERNEL_FORMATS

    def reads(*args):
        return mosaic_kv_quant.reads_pages(*args, kernel)

    assert reads(pages("int8", 16, 128), 128)
    assert reads(pages("int8", 8, 64), 64)
    assert reads(pages("int4", 16, 128), 128)
    assert reads(pages("int4", 8, 64), 64)
    assert not reads(pages("int4", 128, 128), 128)
    assert not reads(pages("int8", 128, 128), 128)  # > one 64-key tile
    assert not reads(pages("int8", 12, 128), 128)  # not 16-byte aligned
    assert reads(pages("int8", 32, 128), 128) and reads(pages("int4", 64, 128), 128)
    assert not reads(pages("int8", 64, 128), 128)  # values over one copy (512 rows of 16 bytes)
    assert not reads(pages("fp8", 16, 128), 128)  # (fp8: not an int format)
    assert not mosaic_kv_quant.reads_pages(pages("int8", 16, 128), 128)  # not routed by default
    assert mosaic_kv_quant.reads_pages(pages("int4", 16, 128), 128)  # routed by default
    assert not mosaic_kv_quant.reads_pages(pages("int4", 8, 64), 64)  # ... at D = 128 only
    assert mosaic_kv_quant.INT_FORMATS == ("int4",)
    calls = []
    monkeypatch.setattr(mosaic_decode, "paged_decode_attention",
                        lambda q, *a, **k: calls.append("decode") or q)
    prefill = lambda q, *a, **k: calls.append("prefill") or q  # noqa: E731
    for routed, expected in (((), ["prefill", "prefill"] * 2),
                             (kernel, ["decode", "prefill"] * 2)):
        monkeypatch.setattr(mosaic_kv_quant, "INT_FORMATS", routed)
        calls.clear()
        rng = np.random.default_rng(26)
        for name in ("int8", "int4"):
            for page_size in (16, 128):
                q, kv, md = make_batch(rng, [(40, 1), (9, 1)], page_size=page_size, num_kv_heads=2,
                                       group=4, head_dim=128, pad_reqs=1, pad_tokens=1,
                                       dtype=jnp.bfloat16)
                mosaic_attention(q, quantized_pages(kv, name), jnp.int32(0), md, sm_scale=0.1,
                                 prefill_fn=prefill)
        assert calls == expected, routed


def test_mosaic_backend_sends_float32_pages_to_the_prefill_path(monkeypatch):
    """A float32 engine on Hopper: the decode kernel's TMA layout is for 16/8-bit rows (it
    failed to lower on an H200), so float32 decode steps take the prefill/mixed path, and the
    Mosaic prefill kernel is not chosen for float32 either."""
    from jaxllm.kernels import mosaic_attention, mosaic_decode, prefill_choice

    calls = []
    monkeypatch.setattr(mosaic_decode, "paged_decode_attention",
                        lambda q, *a, **k: calls.append("decode") or q)
    prefill = lambda q, *a, **k: calls.append("prefill") or q  # noqa: E731
    rng = np.random.default_rng(25)
    for dtype in (jnp.bfloat16, jnp.float32):
        q, kv, md = make_batch(rng, [(40, 1), (9, 1)], page_size=8, num_kv_heads=2, group=4,
                               head_dim=128, pad_reqs=1, pad_tokens=1, dtype=dtype)
        mosaic_attention(q, kv, jnp.int32(0), md, sm_scale=0.1, prefill_fn=prefill)
    assert calls == ["decode", "prefill"]
    monkeypatch.setattr(prefill_choice, "is_hopper", lambda: True)
    ok, why = prefill_choice.mosaic_prefill_ok(32, 8, 128, 16, "float32")
    assert not ok and "float32" in why


# qk_fp8 (e4m3 pages): q rounded to e4m3 in the wrapper, the QK wgmma on the K tile as copied.
# (splits, requests, kv heads, group, page size, head dim): one and several 64-key steps, a
# split, D 64 (one 64-byte swizzled row) and 128, and a padding request and token.
QK8_CASES = [
    (1, [(27, 1), (130, 1), (3, 1)], 2, 4, 8, 64),
    (2, [(200, 1), (9, 1)], 1, 8, 16, 128),
]


@pytest.mark.parametrize("splits,reqs,kv_heads,group,page_size,head_dim", QK8_CASES)
def test_mosaic_decode_with_fp8_queries_matches_reference(splits, reqs, kv_heads, group,
                                                          page_size, head_dim):
    """qk_fp8: in the interpreter with its race detector, the kernel equals the reference run on
    the same pages with the query rounded as the kernel rounds it (`q_fp8`), far closer than to
    the reference on the unrounded query: the rounding is the only difference."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(43)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=kv_heads, group=group,
                           head_dim=head_dim, pad_reqs=1, pad_tokens=1, dtype=jnp.bfloat16)
    q = q * 3  # scores of a few units: softmax far from uniform
    pages = quantized_pages(kv, "fp8")
    got = mosaic_decode.paged_decode_attention(q, pages, jnp.int32(1), md, sm_scale=0.3,
                                               num_splits=splits, num_stages=2, interpret=True,
                                               qk_fp8=True)
    got = np.asarray(got, np.float32)
    n = len(reqs)
    q8 = mosaic_decode.q_fp8(q, 0.3).astype(jnp.float32)
    want = np.asarray(ref.ragged_paged_attention(q8, pages, jnp.int32(1), md,
                                                 sm_scale=float(np.log(2.0))), np.float32)
    exact_q = np.asarray(ref.ragged_paged_attention(q, pages, jnp.int32(1), md, sm_scale=0.3),
                         np.float32)
    err, q_err = rel_err(got[:n], want[:n]), rel_err(want[:n], exact_q[:n])
    assert err < 3e-3, (err, q_err)  # f16 p and V, bf16 output
    assert q_err > 3 * err, (err, q_err)  # the query really was rounded
    # What rounding q costs, against the unquantized K/V: about what rounding K to e4m3 costs
    # alone, so together 1.24-1.33x the fp8 pages' own error here.
    bf16 = np.asarray(ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.3), np.float32)
    assert rel_err(want[:n], bf16[:n]) < 1.6 * rel_err(exact_q[:n], bf16[:n])
    assert not got[n:].any()  # the padding token
    assert not ipc.get_races().races_found


@pytest.mark.parametrize("splits,head_dim", [(1, 128), (4, 128), (1, 64)])
def test_mosaic_decode_with_fp8_queries_lowers_for_cuda(splits, head_dim):
    """qk_fp8's compiled path (e4m3 x e4m3 wgmma, both operands K-major in SMEM), lowered for
    cuda on the CPU; other pages or schedules are refused by name."""
    from jaxllm.kernels import mosaic_decode

    rng = np.random.default_rng(23)
    q, kv, md = make_batch(rng, [(300, 1), (20, 1), (77, 1)], page_size=16, num_kv_heads=8,
                           group=4, head_dim=head_dim, num_layers=1, pad_reqs=0, pad_tokens=1,
                           dtype=jnp.bfloat16)
    f = jax.jit(lambda q, kv, md: mosaic_decode.paged_decode_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.1, num_splits=splits, qk_fp8=True))
    text = f.trace(q, quantized_pages(kv, "fp8"), md).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="qk_fp8 needs e4m3 pages"):
        f(q, quantized_pages(kv, "fp8_e5m2"), md)
