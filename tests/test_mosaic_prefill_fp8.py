"""The Mosaic GPU prefill/mixed kernel on fp8 (and int8 / int4) pages (kernels/mosaic_prefill.py):
in Mosaic GPU's CPU interpreter with its race detector against the reference on the same pages
(ragged: a prefill chunk over a cached prefix, a decode row, padding), and lowered for the cuda
platform (the compiled path, which converts the tiles to f16: Hopper has no fp8 -> bf16
conversion; int pages: the decode kernel's byte copies and dequantization, mosaic_kv_quant.py).
The interpreter costs about a second per CTA: few tokens, D = 64. Int pages' own rules and
routing: tests/test_mosaic_prefill_int.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_kernels import make_batch, rel_err
from test_kv_quant import quantized_pages

from jaxllm.kernels import ref

# (format, requests [(context, new)], kv heads, GQA group, page size, block keys, how far the
# result must be from the reference on the unquantized data):
# e4m3: G 4 (32 tokens a block), a 40-token chunk over 110 cached tokens (a full block and a
# partial one, 3 steps of 64 keys: unmasked and masked) and a decode row;
# e5m2: G 2 (64 tokens a block), pages of 8, two kv heads, the default 128-key block;
# int8 as e4m3 (pages of 16: 4 a 64-key block); int4 as e5m2 (pages of 8: 8 a block).
CASES = [
    ("fp8", [(150, 40), (40, 1)], 1, 4, 16, 64, 2e-2),
    ("fp8_e5m2", [(70, 13), (33, 1)], 2, 2, 8, None, 2e-2),
    ("int8", [(150, 40), (40, 1)], 1, 4, 16, None, 5e-3),
    ("int4", [(70, 13), (33, 1)], 2, 2, 8, None, 5e-2),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,reqs,kv_heads,group,page_size,block_keys,apart", CASES)
def test_mosaic_prefill_on_quantized_pages_matches_reference(name, reqs, kv_heads, group,
                                                             page_size, block_keys, apart):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_prefill

    rng = np.random.default_rng(5)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=kv_heads, group=group,
                           head_dim=64, pad_reqs=1, pad_tokens=2, dtype=jnp.bfloat16)
    pages = quantized_pages(kv, name)
    assert pages.dtype.itemsize == 1 and pages.shape[:-1] == kv.shape[:-1]
    got = mosaic_prefill.ragged_prefill_attention(q, pages, jnp.int32(1), md, sm_scale=0.3,
                                                  block_keys=block_keys, num_stages=2,
                                                  interpret=True)
    assert got.dtype == q.dtype and got.shape == q.shape
    got = np.asarray(got, np.float32)
    n = sum(new for _, new in reqs)
    want = np.asarray(ref.ragged_paged_attention(q, pages, jnp.int32(1), md, sm_scale=0.3),
                      np.float32)
    assert rel_err(got[:n], want[:n]) < 5e-3  # measured 1.4e-3 (fp8), 1.7e-3 / 1.4e-3 (int8 / int4)
    # `apart` separates the stored pages from the bf16 data they were made from (the reference
    # on those differs by 5e-2 / 1e-1 fp8, 1.1e-2 int8, 1.6e-1 int4): the kernel read the
    # stored values (int pages: with their scales and minimums).
    unquantized = np.asarray(ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.3),
                             np.float32)
    assert rel_err(got[:n], unquantized[:n]) > apart
    assert not got[n:].any()  # the padding tokens
    assert not ipc.get_races().races_found


@pytest.mark.parametrize("name,group,page_size,head_dim,block_keys", [
    ("fp8", 4, 16, 128, None), ("fp8_e5m2", 8, 16, 64, None), ("fp8", 1, 128, 128, 64),
    ("fp8", 2, 32, 128, 128), ("int8", 4, 16, 128, None), ("int4", 4, 16, 128, None),
    ("int8", 8, 8, 64, None), ("int4", 1, 32, 128, None), ("int4", 2, 64, 64, None)])
def test_mosaic_prefill_on_quantized_pages_lowers_for_cuda(name, group, page_size, head_dim,
                                                           block_keys):
    """The compiled path (no interpreter), lowered for cuda on the CPU: lowering to the Mosaic
    GPU dialect runs every layout and conversion rule (an fp8 -> bf16 cast fails here, as it
    did on the H200; the decode kernel's int path failed its layout inference here under jax
    0.11.2 until session 21's fix). Ragged batch, T not a multiple of 8; pages larger than the
    block too; int4 at D = 64 (32-column tiles: q takes the K tiles' swizzle)."""
    from jaxllm.kernels import mosaic_prefill

    rng = np.random.default_rng(group)
    q, kv, md = make_batch(rng, [(300, 45), (20, 1), (9, 9)], page_size=page_size,
                           num_kv_heads=2, group=group, head_dim=head_dim, num_layers=1,
                           pad_tokens=2, dtype=jnp.bfloat16)
    pages = quantized_pages(kv, name)
    f = jax.jit(lambda q, kv, md: mosaic_prefill.ragged_prefill_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.1, block_keys=block_keys))
    text = f.trace(q, pages, md).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@mosaic_gpu_v2") == 1  # one kernel call site


def test_mosaic_prefill_fp8_shape_rules():
    """D = 256 fp8 tiles do not fit SMEM (module docstring); int pages:
    tests/test_mosaic_prefill_int.py."""
    from jaxllm.kernels import mosaic_prefill

    assert mosaic_prefill.supported(32, 8, 128, 16, 64, fp8=True)
    assert not mosaic_prefill.supported(32, 8, 256, 16, 64, fp8=True)
    assert mosaic_prefill.supported(32, 8, 256, 16, 64)
    assert mosaic_prefill.default_block_keys(128, fp8=True) == 64
    assert mosaic_prefill.default_block_keys(64, fp8=True) == 128
    assert mosaic_prefill.default_block_keys(128, fp8=False) == 128


@pytest.mark.parametrize("name,kernel", [
    ("auto", "mosaic"), ("fp8", "mosaic"), ("fp8_e5m2", "mosaic"), ("int8", "pallas"),
    ("int4", "pallas")])
def test_gpu_prefill_path_routes_fp8_pages_to_the_mosaic_kernel(monkeypatch, name, kernel):
    """Where the choice picks the Mosaic kernel, bf16 and fp8 pages go to it, int8 / int4 pages
    (read by the kernel, but not routed to it before a GPU check: mosaic_prefill.INT_FORMATS)
    to the Pallas kernel; the choice sees the page dtype (fp8 is probed and
    measured on fp8 pages, its own key)."""
    import jaxllm.kernels as kernels
    from jaxllm.kernels import mosaic_prefill, prefill_choice

    calls, keys = [], []
    monkeypatch.setattr(prefill_choice, "prefill_kernel",
                        lambda q, kv: keys.append(jnp.dtype(kv.dtype).name) or "mosaic")
    monkeypatch.setattr(mosaic_prefill, "ragged_prefill_attention",
                        lambda q, *a, **k: calls.append("mosaic") or q)
    monkeypatch.setattr(kernels, "_pallas_fn", lambda: lambda q, *a, **k: calls.append("pallas") or q)
    rng = np.random.default_rng(7)
    q, kv, md = make_batch(rng, [(40, 5), (9, 1)], page_size=8, num_kv_heads=2, group=4,
                           head_dim=64, dtype=jnp.bfloat16)
    pages = kv if name == "auto" else quantized_pages(kv, name)
    kernels.gpu_prefill_attention(q, pages, jnp.int32(0), md, sm_scale=0.1)
    assert calls == [kernel]
    assert keys == ([] if kernel == "pallas" else [jnp.dtype(pages.dtype).name])


def test_choice_probes_and_measures_fp8_pages_as_such(monkeypatch):
    """"auto" on Hopper with fp8 pages: the probe and the measurement get the page dtype (a key
    of their own), the probe runs the kernel on fp8 pages against the reference on them (here a
    stand-in kernel, CPU), and D = 256 fp8 is refused before any probe."""
    from jaxllm.kernels import prefill_choice

    monkeypatch.setattr(prefill_choice, "is_hopper", lambda: True)
    monkeypatch.setenv("JAXLLM_PREFILL_KERNEL", "auto")
    monkeypatch.setenv("JAXLLM_MOSAIC_MIN_TOKENS", "0")
    seen = []
    monkeypatch.setattr(prefill_choice, "mosaic_prefill_ok",
                        lambda *key: seen.append(("probe",) + key) or (True, "probe ok"))
    monkeypatch.setattr(prefill_choice, "measured_choice",
                        lambda T, *key: seen.append(("measure", T) + key) or ("mosaic", "fast"))
    kv = jnp.zeros((1, 2, 2, 4, 16, 64), jnp.float8_e5m2)
    q = jax.ShapeDtypeStruct((64, 8, 64), jnp.bfloat16)
    assert prefill_choice.prefill_kernel(q, kv) == "mosaic"
    key = (8, 2, 64, 16, "bfloat16", "float8_e5m2")
    assert seen == [("probe",) + key, ("measure", 64) + key]
    monkeypatch.undo()

    monkeypatch.setattr(prefill_choice, "is_hopper", lambda: True)
    probes = []
    monkeypatch.setattr(prefill_choice, "run_probe", lambda *a, **k: probes.append(k) or (True, "ok"))
    prefill_choice.mosaic_prefill_ok.cache_clear()
    assert prefill_choice.mosaic_prefill_ok(32, 8, 128, 16, "bfloat16", "float8_e4m3fn")[0]
    assert probes == [{"page_dtype_name": "float8_e4m3fn"}]
    ok, why = prefill_choice.mosaic_prefill_ok(32, 8, 256, 16, "bfloat16", "float8_e4m3fn")
    assert not ok and "D=256" in why and len(probes) == 1
    ok, why = prefill_choice.mosaic_prefill_ok(32, 8, 128, 16, "bfloat16", "uint8")
    assert not ok and "uint8" in why
    prefill_choice.mosaic_prefill_ok.cache_clear()
    monkeypatch.undo()

    probe_with_a_stand_in(monkeypatch, "float8_e4m3fn",
                          lambda kv: kv.dtype == jnp.float8_e4m3fn)


def probe_with_a_stand_in(monkeypatch, page_name: str, pages_ok) -> None:
    """The probe on `page_name` pages (`pages_ok(kv)` checks what the kernel is handed) with a
    stand-in kernel, CPU: the reference on the same pages passes, a wrong kernel is caught."""
    from jaxllm.kernels import mosaic_prefill, prefill_choice

    def stand_in(q, kv, layer, md, *, sm_scale, block_keys, interpret):
        assert pages_ok(kv) and block_keys == 64 and interpret
        return ref.ragged_paged_attention(q, kv, layer, md, sm_scale=sm_scale)

    monkeypatch.setattr(mosaic_prefill, "ragged_prefill_attention", stand_in)
    ok, why = prefill_choice.run_probe(8, 2, 64, 16, "bfloat16", interpret=True,
                                       page_dtype_name=page_name)
    assert ok, why
    monkeypatch.setattr(mosaic_prefill, "ragged_prefill_attention",
                        lambda *a, **k: stand_in(*a, **k) * 1.1)  # a wrong kernel is caught
    ok, why = prefill_choice.run_probe(8, 2, 64, 16, "bfloat16", interpret=True,
                                       page_dtype_name=page_name)
    assert not ok and "mismatch" in why
