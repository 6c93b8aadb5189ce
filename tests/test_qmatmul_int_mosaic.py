"""The Hopper W4A16 / W8A16 decode matmul (kernels/qmatmul_int_mosaic.py) in Mosaic GPU's CPU
interpreter (simulated TMA, barriers and wgmma; race detection) against x @ the dequantized
weight; its [N, K] layouts; its tilings; its lowering for cuda; the warm-up's choice and the
re-layout; an engine through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import qmatmul_int_mosaic as q4
from jaxllm.quantization.quantize import quantize_fp8_blocks, quantize_int4, quantize_int8

K, N = 512, 128


def _races() -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    return ipc.get_races().races_found


def _weight(seed: int = 0, offset: float = 0.0, kind: str = "int4"):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * 0.05 + offset).astype(np.float32)
    if kind == "fp8":  # HF FP8's layout: values [N, K], `weight_scale_inv` per 128 x 128 block
        return quantize_fp8_blocks(w, 128, 128)
    if kind == "fp8_tensor":
        return quantize_fp8_blocks(w, N, K)
    return quantize_int4(w, group=128, search=False) if kind == "int4" else quantize_int8(w)


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8", "fp8_tensor"])
def test_layout_is_the_same_weight(kind):
    """`to_nk`: int4 as signed nibbles q - 8 in jnp.int4 [N, K] (scales and offsets as stored),
    int8 as int8 [N, K]: the same float weight, from numpy (load) or jax (device) arrays."""
    w = _weight(offset=0.3, kind=kind)  # int4 offsets far from 0
    for src in (w, jax.tree.map(jnp.asarray, w)):
        nk = q4.to_nk(src)
        assert nk.values.dtype == {"int4": jnp.int4, "int8": jnp.int8}.get(kind, jnp.float8_e4m3fn)
        assert nk.values.shape == (N, K) and nk.shape == (K, N) and nk.kind == kind.partition("_")[0]
        if kind == "int4":
            v = np.asarray(nk.values, np.int8)
            assert v.min() >= -8 and v.max() <= 7
        np.testing.assert_allclose(np.asarray(nk.dequantize()), np.asarray(w.dequantize(np.float32)),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 128"):
        q4.to_nk(quantize_int4(np.ones((K, N), np.float32), group=64, search=False))


@pytest.mark.parametrize("kind,M,tiling", [("int4", 1, q4.Tiling(64, 2, 1)), ("int4", 5, q4.Tiling(64, 3, 2)),
                                           ("int4", 16, q4.Tiling(128, 2, 4)), ("int8", 3, q4.Tiling(64, 2, 2)),
                                           ("fp8", 2, q4.Tiling(64, 2, 2)), ("fp8_tensor", 9, q4.Tiling(128, 3, 1))],
                         ids=lambda a: getattr(a, "name", str(a)))
def test_matches_the_dequantized_product_in_the_interpreter(kind, M, tiling):
    """Each group's scale and offset on its own partial (a wrong group index, split or reused
    slot shows), int8's per-channel scale after, the padding rows dropped; bf16 rows and output."""
    w = _weight(seed=M, offset=0.1, kind=kind)
    nk = jax.tree.map(jnp.asarray, q4.to_nk(w))
    x = jnp.asarray(np.random.default_rng(M + 1).standard_normal((M, K)), jnp.bfloat16)
    got = jax.jit(lambda x, w: q4.int_matmul(x, w, tiling, interpret=True))(x, nk)
    want = np.asarray(x, np.float32) @ np.asarray(w.dequantize(np.float32))
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16 and not _races()
    g = np.asarray(got, np.float32)
    assert np.linalg.norm(g - want) / np.linalg.norm(want) < 5e-3  # bf16 output rounding


def test_tilings():
    for M, Kx, Nx in ((1, 4096, 6144), (64, 14336, 4096), (8, 4096, 28672)):
        for kind in ("int4", "int8", "fp8"):
            ts = q4.tilings_for(M, Kx, Nx, kind=kind)
            assert ts and all(q4.unsupported(M, Kx, Nx, t, kind) is None for t in ts)
            assert all(q4.Tiling.parse(t.name) == t for t in ts)
            assert all(q4.smem_bytes(M, t, kind) <= q4.SMEM_LIMIT for t in ts)
    # fp8 at 64 rows: 6 stages of (128 x 128 fp8 + 64 x 128 f16 x + scales) do not fit (Mosaic
    # counted 232,496 bytes); fewer do
    assert "shared memory" in q4.unsupported(64, 4096, 4096, q4.Tiling(128, 6, 1), "fp8")
    assert {t.stages for t in q4.tilings_for(64, 4096, 4096, kind="fp8") if t.block_n == 128} == {5}
    assert "rows" in q4.unsupported(65, 4096, 4096, q4.Tiling())
    assert "128" in q4.unsupported(8, 4096 + 64, 4096, q4.Tiling())


@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_lowers_for_cuda(kind, M):
    """Every tiling offered for the Llama-3-8B linears exports through Mosaic GPU's lowering (the
    int4 / int8 -> bf16 conversion into wgmma's register operand included)."""
    for Kx, Nx in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        if kind == "int4":
            w = q4.Int4NK(jax.ShapeDtypeStruct((Nx, Kx), jnp.int4),
                          jax.ShapeDtypeStruct((Kx // 128, Nx), jnp.float16),
                          jax.ShapeDtypeStruct((Kx // 128, Nx), jnp.float16))
        elif kind == "fp8":
            w = q4.Fp8NK(jax.ShapeDtypeStruct((Nx, Kx), jnp.float8_e4m3fn),
                         jax.ShapeDtypeStruct((Kx // 128, Nx), jnp.float32))
        else:
            w = q4.Int8NK(jax.ShapeDtypeStruct((Nx, Kx), jnp.int8), jax.ShapeDtypeStruct((1, Nx), jnp.float32))
        for t in q4.tilings_for(M, Kx, Nx, kind=kind):
            f = jax.jit(lambda x, w, t=t: q4.int_matmul(x, w, t))
            text = f.trace(jax.ShapeDtypeStruct((M, Kx), jnp.bfloat16), w).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "mosaic" in text.lower()


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_the_warm_up_relays_out_where_the_kernel_wins(monkeypatch, kind):
    """On Hopper, int4 g128 and per-channel int8 get "mosaic_nk/<tiling>" candidates; a layout
    whose kernel time summed over the decode row counts beats the stored layout's fastest path
    goes to NK_LAYOUTS with the kernel's tiling at every row count, one that loses keeps its
    stored-layout paths; the real check passes the kernel's output (interpreter) against x @ the
    dequantized weight."""
    from jaxllm.kernels import prefill_choice
    from jaxllm.quantization import choice

    monkeypatch.setattr(prefill_choice, "is_hopper", lambda: True)
    w = jax.tree.map(jnp.asarray, _weight(kind=kind))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, K)), jnp.float32)
    offered = [p for p in choice.candidates(x.shape, w) if p.startswith("mosaic_nk/")]
    assert offered == [f"mosaic_nk/{t.name}" for t in q4.tilings_for(4, K, N, choice.num_sms(), w.kind)]
    times = choice.time_paths(x, w, ["xla", offered[0]], reps=1, chain=2)
    assert set(times) == {"xla", offered[0]}  # checked on the [N, K] layout, then timed
    with monkeypatch.context() as m:  # a layout that cannot be made: the kernel is left out, not fatal
        m.setattr(q4, "to_nk", lambda w: (_ for _ in ()).throw(ValueError("no layout")))
        assert set(choice.time_paths(x, w, ["xla", offered[0]], reps=1, chain=2)) == {"xla"}
    for kernel_s, relaid in ((1e-6, True), (9e-6, False)):
        monkeypatch.setattr(choice, "time_paths", lambda x, w, paths, reps=5: {
            p: (kernel_s if p.startswith("mosaic_nk/") else 5e-6) for p in paths})
        monkeypatch.setattr(choice, "loop_floor", lambda x, reps, unroll=1: 1e-6)
        choice.clear()
        try:
            choice.measure([w], [1, 8, 512], jnp.bfloat16)
            key = choice.layout_key((1, K), w)[:-1]
            assert (key in choice.NK_LAYOUTS) == relaid
            for M in (1, 8):
                assert choice.measured_path((M, K), w).startswith("mosaic_nk/") == relaid
            relaid_w = choice.relayout({"w": w, "other": jnp.ones(3)})
            assert isinstance(relaid_w["w"], (q4.Int4NK, q4.Int8NK, q4.Fp8NK)) == relaid
        finally:
            choice.clear()


@pytest.mark.slow
def test_engine_with_relaid_weights_keeps_the_xla_paths_ids(monkeypatch, method="int4"):
    """An engine whose int4 linears are re-laid out (`Runner.relayout_weights`, stacked layers on
    the CPU's scan) and take the kernel at both decode buckets (4 and 64 rows, the interpreter)
    gives the XLA path's greedy ids; logprobs within the kernel's bf16 rows. (int8 takes the
    same re-layout and dispatch; its kernel is checked on its own above: 14 s of CI saved.)"""
    from jaxllm import LLM, SamplingParams
    from jaxllm.quantization import choice
    from tp_worker import tiny_model

    cfg, sd = tiny_model("llama", 4, 2, hidden=256, inter=512, head_dim=64, layers=2, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    prompts = [[5, 17, 99, 3, 250, 11], list(range(40, 80))]
    kw = dict(hf_config=cfg, weights=sd, dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(4, 64), seq_buckets=(4,), skip_warmup=True,
              quantization=method)

    def run(llm):
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                np.array([[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]))

    want_ids, want_lps = run(LLM(**kw))
    llm = LLM(**kw)
    r = llm.engine.runner
    calls = []
    kernel = q4.int_matmul
    monkeypatch.setattr(q4, "int_matmul", lambda x, *a, **k: calls.append(x.shape) or kernel(x, *a, **k))
    choice.clear()
    try:
        for w in choice.quantized_leaves(r.params, r.layer_params):
            w2 = choice.two_d(w)
            for M in (4, 64):
                key = choice.layout_key((M, w2.shape[-2]), w2)
                choice._MEASURED[key] = f"mosaic_nk/{q4.tilings_for(M, *w2.shape, kind=w2.kind)[0].name}"
                choice.NK_LAYOUTS.add(key[:-1])
        r.relayout_weights()
        assert not choice.quantized_leaves(r.params, r.layer_params)  # every linear re-laid out
        got_ids, got_lps = run(llm)
    finally:
        choice.clear()
    assert {int(np.prod(s[:-1])) for s in calls} == {4, 64}
    assert got_ids == want_ids
    np.testing.assert_allclose(got_lps, want_lps, atol=2e-2)


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_every_pipelined_block_is_whole_128_byte_units(kind):
    """A TMA destination must start 128-byte aligned, and the pipeline lays its slots end to end:
    int4's [1, 8] float32 x group sums (32 bytes a slot, 1-row steps) faulted on an H100 with
    "misaligned address" (session 25). Every block at every padded row count is whole 128-byte
    units, and the dtypes counted are those `to_nk` / `int_matmul` pass."""
    nk = q4.to_nk(_weight(kind=kind))
    for bn in (64, 128):
        for Mp in range(8, q4.MAX_ROWS + 1, 8):
            blocks = q4.slot_blocks(nk.kind, bn, Mp)
            for role, shape, dtype in blocks:
                nbytes = int(np.prod(shape)) * jnp.dtype(dtype).itemsize // (2 if dtype == jnp.int4 else 1)
                assert nbytes % 128 == 0, (kind, bn, Mp, role, shape, dtype)
    assert blocks[0][2] == nk.values.dtype
    if kind == "int4":
        assert {jnp.dtype(b[2]) for b in blocks if b[0] == "row"} == {nk.scale.dtype, nk.offset.dtype}
        assert q4.slot_blocks("int4", 64, 8)[3][1] == (1, 32)  # padded from 8
    if kind == "fp8":
        assert blocks[1][2] == nk.scale.dtype
