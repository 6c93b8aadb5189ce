"""The warp-specialized Hopper grouped matmul for MoE prefill (kernels/moe_gmm_ws.py) in Mosaic
GPU's CPU interpreter (simulated TMA, barriers, wgmma, three warpgroups; race detection) against
jax.lax.ragged_dot, and its lowering for cuda at Qwen3-30B-A3B's expert shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_moe_gmm_mosaic import _check  # interpreter races, then ragged_dot on the covered rows

from jaxllm.kernels import moe_gmm_ws as ws
from jaxllm.models import gmm as gmm_impls

TILING = ws.WsTiling(block_m=64, block_n=128, block_k=64, stages=2)


def _inputs(M: int, G: int, K: int, N: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w1, w2 = (jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.bfloat16) for _ in range(2))
    return x, w1, w2


def test_groups_across_row_blocks_with_an_empty_expert():
    """Groups that start and end inside 64-row blocks (a block computed for two experts), an
    empty expert, 3 CTAs walking 2 strips x 6 slots (dead slots return at once)."""
    sizes = np.array([70, 0, 50, 20], np.int32)
    x, w, _ = _inputs(150, 4, 128, 256)
    got = jax.jit(lambda *a: ws.grouped_matmul(*a, TILING, interpret=True, num_sms=3))(
        x, w, jnp.asarray(sizes))
    _check(got, x, w, sizes)


def test_pair_with_padding_rows_and_a_deeper_ring():
    """Gate and up in one launch; the rows no group covers (padding) are left undefined; K of
    4 steps through a 3-deep ring; 128-row slots, the warpgroups splitting the rows."""
    sizes = np.array([5, 0, 0, 100, 3, 0], np.int32)
    x, w1, w2 = _inputs(120, 6, 256, 256, seed=1)
    t = ws.WsTiling(block_m=128, block_n=128, block_k=64, stages=3)
    g, u = jax.jit(lambda *a: ws.grouped_matmul_pair(*a, t, interpret=True, num_sms=2))(
        x, w1, w2, jnp.asarray(sizes))
    _check(g, x, w1, sizes)
    _check(u, x, w2, sizes)


@pytest.mark.parametrize("bm, stages, sms", [(64, 2, 3), (128, 4, 2), (64, 4, 1)])
def test_chained_tiles_as_one_pipeline_of_pipelines(bm, stages, sms):
    """`chained` tilings: each CTA's live tiles run as START / STEADY... / STOP pipelines sharing
    one ring (gate and up in one launch, both branches chained; empty experts; dead slots after
    the live ones; a CTA with one live tile; one CTA taking every tile); the interpreter's race
    detector runs."""
    sizes = np.array([70, 0, 50, 20, 0, 9], np.int32)
    x, w1, w2 = _inputs(160, 6, 256, 256, seed=3)
    t = ws.WsTiling(block_m=bm, block_n=128, block_k=64, stages=stages, chained=True)
    assert t.fits(256, 256) and t.name.endswith("c")
    g, u = jax.jit(lambda *a: ws.grouped_matmul_pair(*a, t, interpret=True, num_sms=sms))(
        x, w1, w2, jnp.asarray(sizes))
    _check(g, x, w1, sizes)
    _check(u, x, w2, sizes)


def test_chained_tilings_need_whole_rings():
    t = ws.WsTiling(block_m=128, block_n=256, block_k=64, stages=3, chained=True)
    assert not t.fits(2048, 768) and ws.WsTiling(128, 256, 64, 3).fits(2048, 768)  # 32 steps, ring of 3
    assert all(c.fits(2048, 768) and c.fits(768, 2048) for c in ws.CHAINED)  # Qwen3-30B-A3B's experts
    assert all(c.smem_bytes() <= 227 * 1024 for c in ws.CHAINED)


def test_split_pair_is_two_launches_of_the_one_weight_kernel(monkeypatch):
    """`WsSplitGmm.pair` (the engine's "_split" candidate): gate and up each through the one-weight
    kernel, each equal to ragged_dot on the rows groups cover."""
    sizes = np.array([30, 0, 41], np.int32)
    x, w1, w2 = _inputs(80, 3, 128, 128, seed=2)
    t = ws.WsTiling(block_m=128, block_n=128, block_k=64, stages=2)
    impl = gmm_impls.WsSplitGmm(t, interpret=True)
    launches = []
    one = ws.grouped_matmul
    monkeypatch.setattr(ws, "grouped_matmul",
                        lambda *a, **k: launches.append(a[1].shape) or one(*a, **k, num_sms=2))
    g, u = impl.pair(x, w1, w2, jnp.asarray(sizes))
    assert len(launches) == 2
    _check(g, x, w1, sizes)
    _check(u, x, w2, sizes)


def _check_glu(got, x, w1, w2, sizes):
    """silu(x @ w1) * (x @ w2) on the covered rows, from float32 products of the bf16 inputs."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

    assert not ipc.get_races().races_found
    n = int(sizes.sum())
    f32, s = jnp.float32, jnp.asarray(sizes)
    g, u = (jax.lax.ragged_dot(x.astype(f32), w.astype(f32), s) for w in (w1, w2))
    want = np.asarray(jax.nn.silu(g) * u)[:n]
    got = np.asarray(got, np.float32)[:n]
    assert got.shape == want.shape and np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3


@pytest.mark.parametrize("bm, stages, sms, chained", [(128, 3, 2, False), (64, 2, 3, False),
                                                      (128, 2, 2, True)])
def test_glu_tile_stores_silu_gate_times_up(bm, stages, sms, chained):
    """`glu` tilings: gate and up strips of the same columns through one ring, both accumulators
    in each compute warpgroup, silu(gate) * up stored [M, N] (not [M, 2N]); groups across row
    blocks, empty experts, padding rows, dead slots; chained too; the race detector runs."""
    sizes = np.array([70, 0, 50, 20, 0, 9], np.int32)
    x, w1, w2 = _inputs(160, 6, 256, 256, seed=4)
    t = ws.WsTiling(block_m=bm, block_n=128, block_k=64, stages=stages, chained=chained, glu=True)
    assert t.name.startswith("wsglu")
    h = jax.jit(lambda *a: ws.swiglu(*a, t, interpret=True, num_sms=sms))(x, w1, w2, jnp.asarray(sizes))
    assert h.shape == (160, 256)
    _check_glu(h, x, w1, w2, sizes)


def test_glu_candidate_runs_gate_up_and_down_through_expert_mlp(monkeypatch):
    """The engine's `wsglu` candidate (`WsGluGmm`) in `moe.expert_mlp`, directly and through the
    `Chooser`: its `swiglu` for gate/up (one launch), the one-weight kernel of the same tiling
    for down; equal to ragged_dot's SwiGLU on the covered rows."""
    from jaxllm.models import moe

    sizes = np.array([30, 0, 41], np.int32)
    x, w1, w2 = _inputs(80, 3, 128, 128, seed=5)
    wd = _inputs(80, 3, 128, 128, seed=6)[1]
    t = ws.WsTiling(block_m=128, block_n=128, block_k=64, stages=2, glu=True)
    calls = []
    for name in ("swiglu", "grouped_matmul"):
        one = getattr(ws, name)
        monkeypatch.setattr(ws, name, lambda *a, one=one, name=name, **k: calls.append(name) or one(
            *a, **k, num_sms=2))
    impl = gmm_impls.WsGluGmm(t, interpret=True)
    chooser = gmm_impls.Chooser()
    chooser.impls[t.name], chooser.choice[80] = impl, t.name
    f32, s = jnp.float32, jnp.asarray(sizes)
    want = np.asarray(moe.expert_mlp(*(a.astype(f32) for a in (x, w1, w2, wd)), s))
    n = int(sizes.sum())
    for gmm in (impl, chooser):
        calls.clear()
        got = np.asarray(jax.jit(lambda *a: moe.expert_mlp(*a, gmm=gmm))(x, w1, w2, wd, s), np.float32)
        assert calls == ["swiglu", "grouped_matmul"]
        assert np.linalg.norm(got[:n] - want[:n]) / np.linalg.norm(want[:n]) < 1e-2


@pytest.mark.parametrize("bm, down_n, H, chained", [(128, 0, 128, False), (64, 0, 128, False),
                                                     (128, 256, 256, False), (128, 256, 256, True)])
def test_mlp_in_slot_space_with_the_unsort_in_its_gather(bm, down_n, H, chained):
    """`mlp`: glu into slot-major [S, bm, F], down reading each slot's rows from there (rows of
    other experts in a block computed and never gathered), one gather by `rows` (a permutation,
    as `moe.experts`' unsort); groups across row blocks, empty experts, padding rows."""
    from jaxllm.models import moe

    sizes = np.array([70, 0, 50, 20, 0, 9], np.int32)
    M = 160  # 11 padding rows
    x, w1, w2 = _inputs(M, 6, H, 256, seed=7)
    wd = _inputs(M, 6, 256, H, seed=8)[1]
    t = ws.WsTiling(block_m=bm, block_n=128, block_k=64, stages=2, chained=chained, glu=True,
                    down_n=down_n)
    assert t.down.block_n == (down_n or 128) and t.down.block_m == bm and not t.down.glu
    assert t.down.chained == chained  # chained: both kernels' tiles as pipelines of pipelines
    rows = jnp.asarray(np.random.default_rng(0).permutation(M), jnp.int32)
    got = jax.jit(lambda *a: ws.mlp(*a, t, rows=rows, interpret=True, num_sms=3))(
        x, w1, w2, wd, jnp.asarray(sizes))
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    assert not ipc.get_races().races_found
    f32 = jnp.float32
    want = np.asarray(moe.expert_mlp(*(a.astype(f32) for a in (x, w1, w2, wd)), jnp.asarray(sizes)))
    covered = np.asarray(rows) < int(sizes.sum())
    got, want = np.asarray(got, np.float32)[covered], want[np.asarray(rows)][covered]
    assert got.shape == (149, H) and np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_experts_takes_the_whole_mlp_of_a_sorted_mlp_impl(monkeypatch):
    """`moe.experts` with an implementation offering `sorted_mlp` (the chooser having picked a
    wsglu tiling): one call of `moe_gmm_ws.mlp` given the unsort, equal to ragged_dot's experts."""
    from jaxllm.models import moe

    rng = np.random.default_rng(9)
    T, k, E, H, F = 24, 2, 4, 128, 128
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    wg, wu = (jnp.asarray(rng.standard_normal((E, H, F)) / np.sqrt(H), jnp.bfloat16) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, H)) / np.sqrt(F), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :k], jnp.int32)
    wts = jnp.asarray(rng.random((T, k)), jnp.float32)
    valid = jnp.arange(T) < 20  # 4 padding tokens
    t = ws.WsTiling(block_m=64, block_n=128, block_k=64, stages=2, glu=True)
    calls = []
    one = ws.mlp
    monkeypatch.setattr(ws, "mlp", lambda *a, **kw: calls.append(kw["rows"].shape) or one(*a, **kw, num_sms=2))
    chooser = gmm_impls.Chooser()
    chooser.impls[t.name], chooser.choice[T * k] = gmm_impls.WsGluGmm(t, interpret=True), t.name
    got = jax.jit(lambda *a: moe.experts(*a, valid=valid, gmm=chooser))(x, wts, ids, wg, wu, wd)
    assert calls == [(T * k,)]
    f32 = jnp.float32
    want = moe.experts(x.astype(f32), wts, ids, wg.astype(f32), wu.astype(f32), wd.astype(f32), valid=valid)
    got, want = np.asarray(got, np.float32), np.asarray(want)
    assert not got[20:].any()  # padding tokens: nothing
    assert np.linalg.norm(got[:20] - want[:20]) / np.linalg.norm(want[:20]) < 1e-2


def test_glu_tilings_fit_shared_memory_and_are_engine_candidates():
    E, H, F, M = 128, 2048, 768, 65536
    for t in ws.GLU:
        assert t.fits(H, F) and t.down.fits(F, H)
        assert t.smem_bytes(weights=2) <= ws.SMEM and t.down.smem_bytes() <= ws.SMEM
        assert t.name in gmm_impls.candidates(M, E, H, F, "gpu", engine=True)
        assert t.name not in gmm_impls.candidates(64, E, H, F, "gpu")


@pytest.mark.parametrize("tiling", ws.GLU, ids=lambda t: t.name)
def test_glu_lowers_for_cuda_at_qwen3_moe_shapes(tiling):
    E, H, F, M = 128, 2048, 768, 65536
    sds = jax.ShapeDtypeStruct
    w, wd = sds((E, H, F), jnp.bfloat16), sds((E, F, H), jnp.bfloat16)
    glu = jax.jit(lambda x, a, b, s: ws.swiglu(x, a, b, s, tiling))
    text = glu.trace(sds((M, H), jnp.bfloat16), w, w, sds((E,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text.lower()
    mlp = jax.jit(lambda x, a, b, c, s: ws.mlp(x, a, b, c, s, tiling))  # down: x_slotted
    text = mlp.trace(sds((M, H), jnp.bfloat16), w, w, wd, sds((E,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.lower().count("mosaic_gpu") >= 2


@pytest.mark.parametrize("tiling", ws.TILINGS + ws.CHAINED, ids=lambda t: t.name)
def test_lowers_for_cuda_at_qwen3_moe_shapes(tiling):
    """Compiled path (no interpreter): Mosaic's lowering, shared-memory check included, at
    65,536 routed rows (8,192 tokens x top-8) for gate/up (2048 -> 2 x 768) and down."""
    E, H, F, M = 128, 2048, 768, 65536
    sds = jax.ShapeDtypeStruct
    pair = jax.jit(lambda x, w, s: ws.grouped_matmul_pair(x, w, w, s, tiling))
    down = jax.jit(lambda x, w, s: ws.grouped_matmul(x, w, s, tiling))
    for f, args in ((pair, (sds((M, H), jnp.bfloat16), sds((E, H, F), jnp.bfloat16))),
                    (down, (sds((M, F), jnp.bfloat16), sds((E, F, H), jnp.bfloat16)))):
        text = f.trace(*args, sds((E,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text.lower()
    assert tiling.smem_bytes() <= 227 * 1024
    assert tiling.name in gmm_impls.candidates(M, E, H, F, "gpu")
    assert tiling.name not in gmm_impls.candidates(64, E, H, F, "gpu")  # prefill-sized rows only
    if tiling.chained:  # the engine measures the best chained tiling only (start-up compiles)
        engine = gmm_impls.candidates(M, E, H, F, "gpu", engine=True)
        assert (tiling.name in engine) == (tiling is ws.CHAINED[-1])
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("JAXLLM_GMM_CHAINED", "0")
            assert tiling.name not in gmm_impls.candidates(M, E, H, F, "gpu", engine=True)
        return
    split = tiling.name + "_split"  # two launches: measured by the engine for 128-row slots
    assert (split in gmm_impls.candidates(M, E, H, F, "gpu", engine=True)) == (tiling.block_m == 128)
    assert split not in gmm_impls.candidates(M, E, H, F, "gpu")


@pytest.mark.slow  # ~70 s: every warm-up and step runs the kernel in the interpreter
def test_engine_with_the_kernel_matches_ragged_dot_greedy_ids(monkeypatch):
    """The whole engine (layer scan, padding tokens and rows, prefill and decode steps) with this
    kernel's gate/up pair and down as every expert matmul, through the interpreter, gives the
    greedy ids of the same engine on ragged_dot (tiny Qwen3-MoE, H 64, F 32: 16-column halves of
    32-column strips). The tiny model runs in float32 and the kernel multiplies bf16 (wgmma), so
    both sides round the expert matmuls' inputs and outputs to bf16 alike."""
    import functools

    from hf_tiny import make, make_llm, random_prompts

    from jaxllm import SamplingParams
    from jaxllm.models import moe, moe_model

    t = ws.WsTiling(block_m=64, block_n=32, block_k=32, stages=2)
    b16, f32 = jnp.bfloat16, jnp.float32
    traced = []

    def ref(a, b, s):
        return jax.lax.ragged_dot(a, b, s, preferred_element_type=f32).astype(b16)

    def kernel(a, b, s):
        return ws.grouped_matmul(a, b, s, t, interpret=True, num_sms=4)

    def pair_of(one):
        def pair(a, b, c, s):
            return tuple(one(a.astype(b16), w.astype(b16), s).astype(f32) for w in (b, c))
        return pair

    def gmm_of(one, use_pair_kernel):
        class Gmm:
            __call__ = staticmethod(lambda a, b, s: one(a.astype(b16), b.astype(b16), s).astype(f32))
            direct_mlp = staticmethod(lambda rows: None)

            @staticmethod
            def pair(a, b, c, s):
                if not use_pair_kernel:
                    return pair_of(one)(a, b, c, s)
                traced.append(a.shape)
                g, u = ws.grouped_matmul_pair(a.astype(b16), b.astype(b16), c.astype(b16), s, t,
                                              interpret=True, num_sms=4)
                return g.astype(f32), u.astype(f32)
        return Gmm()

    model, cfg, sd = make("qwen3_moe")
    assert (cfg["hidden_size"], cfg["moe_intermediate_size"]) == (64, 32)
    prompts = random_prompts(2, cfg["vocab_size"], 3, 40, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    init = moe_model.MoeLlama.__init__
    ids = []
    for gmm in (gmm_of(ref, False), gmm_of(kernel, True)):
        monkeypatch.setattr(moe_model.MoeLlama, "__init__", lambda self, *a, gmm=gmm, **kw: init(
            self, *a, **{**kw, "experts_fn": functools.partial(moe.experts, gmm=gmm)}))
        llm = make_llm((cfg, sd), token_buckets=(64,), max_model_len=128, skip_warmup=True)  # (CI time)
        ids.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
    assert ids[0] == ids[1] and all(len(i) == 2 for i in ids[0])
    assert traced  # the kernel's engine traced its steps through the kernel
