"""The decode grouped-matmul kernel (kernels/moe_gmm.py) against jax.lax.ragged_dot, in Pallas'
interpreter on the CPU: random routings, empty experts, all rows to one expert, padding rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import moe_gmm
from jaxllm.models import gmm as gmm_impls, moe

SMALL = (moe_gmm.Tiling(block_m=16, block_n=32, block_k=32),
         moe_gmm.Tiling(block_m=16, block_n=64, block_k=32, k_splits=2))


def _sizes(case: str, M: int, G: int, rng) -> np.ndarray:
    if case == "one_expert":
        s = np.zeros(G, np.int64)
        s[G // 2] = M  # 40 rows: three row blocks of one expert
    elif case == "empty":
        s = np.bincount(rng.choice([1, 4, 6], M), minlength=G)
    elif case == "padding":  # the last 7 rows belong to no group (padding tokens, other devices)
        s = np.bincount(rng.integers(0, G, M - 7), minlength=G)
    else:
        s = np.bincount(rng.integers(0, G, M), minlength=G)
    return s.astype(np.int32)


def _matches_ragged_dot(case: str, tiling, M: int, G: int, K: int, N: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = _sizes(case, M, G, rng)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.float32)
    got = jax.jit(lambda x, w, s: moe_gmm.grouped_matmul(x, w, s, tiling, interpret=True))(
        x, w, jnp.asarray(sizes))
    want = jax.lax.ragged_dot(x, w, jnp.asarray(sizes))
    covered = int(sizes.sum())
    np.testing.assert_allclose(np.asarray(got)[:covered], np.asarray(want)[:covered], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tiling", SMALL, ids=lambda t: t.name)
@pytest.mark.parametrize("case", ["random", "one_expert", "empty", "padding"])
def test_kernel_matches_ragged_dot(case, tiling):
    _matches_ragged_dot(case, tiling, M=40, G=8, K=64, N=128,
                        seed=len(case) * 7 + tiling.block_n + tiling.k_splits)


@pytest.mark.parametrize("tiling", moe_gmm.PREFILL_TILINGS, ids=lambda t: t.name)
@pytest.mark.parametrize("case", ["random", "one_expert", "padding"])
def test_prefill_tilings_match_ragged_dot(case, tiling):
    """Row blocks of 64 / 128 (several an expert, partial ones, padding rows past every group)."""
    _matches_ragged_dot(case, tiling, M=300, G=4, K=128, N=128, seed=len(case) + tiling.block_m)


def test_pair_is_two_matmuls_in_one_launch():
    rng = np.random.default_rng(5)
    M, G, K, N = 24, 4, 64, 64
    sizes = jnp.asarray(np.bincount(rng.integers(0, G - 1, M - 3), minlength=G).astype(np.int32))
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w1, w2 = (jnp.asarray(rng.standard_normal((G, K, N)) / 8, jnp.float32) for _ in range(2))
    tiling = moe_gmm.Tiling(block_m=16, block_n=32, block_k=32, k_splits=2)
    y1, y2 = jax.jit(lambda *a: moe_gmm.grouped_matmul_pair(*a, tiling, interpret=True))(x, w1, w2, sizes)
    n = int(sizes.sum())
    for got, w in ((y1, w1), (y2, w2)):
        np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(jax.lax.ragged_dot(x, w, sizes))[:n],
                                   rtol=2e-5, atol=2e-5)
    assert "pair" in dir(gmm_impls.DecodeGmm(tiling)) and hasattr(gmm_impls.Chooser(), "pair")


def test_slots_cover_each_row_once_within_the_static_bound():
    rng = np.random.default_rng(0)
    slots = jax.jit(moe_gmm.slots, static_argnums=(1, 2))
    for M, G, bm in ((8, 128, 16), (512, 128, 16), (40, 8, 16), (33, 4, 8)):
        for _ in range(4):
            sizes = np.bincount(rng.integers(0, rng.integers(1, G + 1), M), minlength=G).astype(np.int32)
            if rng.random() < 0.3:  # one expert takes everything: many blocks of one group
                sizes = np.zeros(G, np.int32)
                sizes[rng.integers(G)] = M
            e, first, count = np.asarray(slots(jnp.asarray(sizes), M, bm))
            assert e.shape == (moe_gmm.num_slots(M, G, bm),)
            live = count > 0
            assert live.sum() == sum(-(-int(n) // bm) for n in sizes)  # only real row blocks
            assert (np.diff(np.flatnonzero(live)) == 1).all() and (not live.any() or live[0])
            rows = np.concatenate([np.arange(f, f + c) for f, c in zip(first[live], count[live])])
            np.testing.assert_array_equal(rows, np.arange(M))  # every row once, in order
            np.testing.assert_array_equal(e[live], np.repeat(np.arange(G), -(-sizes // bm)))


def _expert_block(rng, T: int, k: int, E: int, H: int, F: int):
    """Random (x [T, H], gate / up [E, H, F], down [E, F, H], router weights [T, k]) in float32."""
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((E, H, F)) / 8, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, H)) / 6, jnp.float32)
    return x, wg, wu, wd, jnp.asarray(rng.random((T, k)), jnp.float32)


def test_expert_block_with_the_kernel_matches_the_reference():
    """moe.experts with the kernel as its gmm (padding tokens, experts with no rows) = ragged_dot."""
    rng = np.random.default_rng(3)
    T, k, E, H, F = 12, 2, 8, 64, 32
    x, wg, wu, wd, weights = _expert_block(rng, T, k, E, H, F)
    ids = jnp.asarray(np.stack([rng.choice([0, 2, 3, 5], k, replace=False) for _ in range(T)]), jnp.int32)
    valid = jnp.arange(T) < 9
    tiling = moe_gmm.Tiling(block_m=16, block_n=32, block_k=32)

    class Kernel:  # as gmm.DecodeGmm, in the interpreter: gate and up in one launch
        __call__ = staticmethod(lambda a, b, s: moe_gmm.grouped_matmul(a, b, s, tiling, interpret=True))
        pair = staticmethod(lambda a, b, c, s: moe_gmm.grouped_matmul_pair(a, b, c, s, tiling, interpret=True))

    got = jax.jit(lambda *a: moe.experts(*a, valid=valid, gmm=Kernel()))(x, weights, ids, wg, wu, wd)
    want = moe.experts(x, weights, ids, wg, wu, wd, valid=valid)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_chooser_offers_the_kernel_on_gpu_only():
    assert not any(n.startswith("decode_") for n in gmm_impls.candidates(8, 128, 2048, 768, "cpu"))
    gpu = gmm_impls.candidates(8, 128, 2048, 768, "gpu")
    assert {t.name for t in moe_gmm.TILINGS if not t.ctas and t.block_m > 1} <= set(gpu)
    # persistent ones and one-row slots: direct only
    assert {"direct_" + t.name for t in moe_gmm.TILINGS} <= set(gpu)
    assert not any((t.ctas or t.block_m == 1) and t.name in gpu for t in moe_gmm.TILINGS)
    big = gmm_impls.candidates(8192, 128, 2048, 768, "gpu")
    assert not any(n.startswith("decode_") for n in big)
    assert {t.name for t in moe_gmm.PREFILL_TILINGS} <= set(big)  # prefill-sized: the row-block tilings
    assert not any(n.startswith("tiles") for n in gpu)
    engine = gmm_impls.candidates(8, 128, 2048, 768, "gpu", engine=True)  # warm-up's subset
    assert {n.removeprefix("direct_") for n in engine if n.startswith(("decode_", "mosaic_", "direct_", "row_"))} \
        == set(gmm_impls.ENGINE_DECODE_TILINGS)


def test_chooser_never_picks_a_wrong_kernel(monkeypatch):
    """Warm-up measurement checks each candidate against ragged_dot before timing it."""
    fast_wrong = lambda x, w, s: jnp.zeros((x.shape[0], w.shape[2]), x.dtype)
    right = lambda x, w, s: jnp.einsum("mk,mkn->mn", x, w[jnp.repeat(jnp.arange(w.shape[0]), s,
                                                                      total_repeat_length=x.shape[0])])
    cands = {"ragged_dot": gmm_impls.ragged_dot_ref, "wrong": fast_wrong, "right": right}
    monkeypatch.setattr(gmm_impls, "candidates", lambda *a, **k: cands)
    chooser = gmm_impls.Chooser()
    chooser.measure([16], E=4, H=64, F=32, dtype=jnp.float32, reps=2)
    assert "wrong" not in chooser.timings[16] and chooser.choice[16] != "wrong"
    assert {"ragged_dot", "right"} <= set(chooser.timings[16])


def test_chooser_reference_survives_a_failing_ragged_dot(monkeypatch):
    """At prefill sizes the ragged_dot candidate runs out of memory on the GPU (32 GiB at 65,536
    rows): the check's reference is ragged_dot on the first REF_TOKENS tokens alone, so the first
    candidate that runs does not become the reference (a wrong one listed first was chosen, and
    the right ones dropped as "wrong", when it did)."""
    def out_of_memory(x, w, s):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
    fast_wrong = lambda x, w, s: jnp.zeros((x.shape[0], w.shape[2]), x.dtype)
    right = lambda x, w, s: jax.lax.ragged_dot(x, w, s) * 1.0
    monkeypatch.setattr(gmm_impls, "candidates", lambda *a, **k: {
        "ragged_dot": out_of_memory, "wrong": fast_wrong, "right": right})
    chooser = gmm_impls.Chooser()
    M = 4 * gmm_impls.REF_TOKENS
    chooser.measure([M], E=4, H=64, F=32, dtype=jnp.float32, reps=1)
    assert set(chooser.timings[M]) == {"right"} and chooser.choice[M] == "right"


def test_chooser_skips_ragged_dot_at_prefill_sizes(monkeypatch):
    """Above DECODE_MAX_ROWS rows XLA's ragged_dot is not timed beside the kernels (117 ms and
    32 GiB at 65,536 rows on an H200); below, it is."""
    timed = []
    right = lambda x, w, s: jax.lax.ragged_dot(x, w, s) * 1.0
    ragged = lambda x, w, s: timed.append(x.shape[0]) or gmm_impls.ragged_dot_ref(x, w, s)
    monkeypatch.setattr(gmm_impls, "candidates", lambda M, *a, **k: {
        "ragged_dot": ragged, "right": right})
    chooser = gmm_impls.Chooser()
    M = 2 * gmm_impls.DECODE_MAX_ROWS
    chooser.measure([16, M], E=4, H=64, F=32, dtype=jnp.float32, reps=1)
    assert set(chooser.timings[M]) == {"right"} and set(chooser.timings[16]) == {"ragged_dot", "right"}
    assert timed and all(m == 16 for m in timed)  # traced only for the 16-row bucket


def test_chooser_times_decode_rows_over_routings_in_turn(monkeypatch):
    """Decode-sized rows are timed over `timing.turns` routings in turn (other experts each, so
    weights come from HBM as in a step; a GPU's count, faked here), sized by the experts one
    token touches; the check is against the last routing; prefill-sized rows take one."""
    from jaxllm.kernels import timing
    asked, sets = [], []
    real = timing.time_checked

    def spy(fns, args, *a, more=(), **kw):
        sets.append([args[2], *(m[1] for m in more)])
        return real(fns, args, *a, more=more, **kw)
    monkeypatch.setattr(timing, "turns", lambda n: asked.append(n) or 3)
    monkeypatch.setattr(timing, "time_checked", spy)
    right = lambda x, w, s: jax.lax.ragged_dot(x, w, s) * 1.0
    monkeypatch.setattr(gmm_impls, "candidates", lambda M, *a, **k: {"ragged_dot": right, "right": right})
    chooser = gmm_impls.Chooser()
    chooser.measure([16], E=8, H=64, F=32, dtype=jnp.float32, reps=1, top_k=2)
    assert asked == [2 * 3 * 64 * 32 * 4] and set(chooser.timings[16]) == {"ragged_dot", "right"}
    assert len(sets) == 2 and all(len(s) == 3 for s in sets)  # and the batch of one, in turn too
    assert not all(np.array_equal(sets[0][0], i) for i in sets[0][1:])
    assert all((np.asarray(i[1:]) == 8).all() and (np.asarray(i[0]) < 8).all() for i in sets[1])


@pytest.mark.parametrize("tiling", [t for t in moe_gmm.TILINGS if not t.ctas and t.block_m > 1]
                         + list(moe_gmm.PREFILL_TILINGS),
                         ids=lambda t: t.name)
def test_kernel_lowers_to_triton(tiling):
    """The GPU path: every shipped tiling of the sorted path lowers through Pallas' Triton
    backend (on this CPU); persistent ones and one-row slots are the direct path's
    (`test_direct_kernel_lowers_to_triton`)."""
    f = jax.jit(lambda x, w, s: moe_gmm.grouped_matmul(x, w, s, tiling, interpret=False))
    args = (jax.ShapeDtypeStruct((8 if tiling.block_m == 16 else 8192, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((128,), jnp.int32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxllm_moe_decode_gmm" in text
    pair = jax.jit(lambda x, w, s: moe_gmm.grouped_matmul_pair(x, w, w, s, tiling, interpret=False))
    assert "jaxllm_moe_decode_gmm" in pair.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.slow
@pytest.mark.parametrize("direct,router", [(False, None), (True, None), ("row", None), (True, "kernel"),
                                           (True, "split")],
                         ids=["sorted", "direct_decode", "direct_row", "direct_router", "direct_router_split"])
def test_model_with_the_kernel_keeps_greedy_ids(monkeypatch, direct, router):
    """The whole engine (layer scan, padding tokens, prefill and decode rows) with the kernel's
    gate/up pair and down as the expert matmuls gives HF's greedy ids; `direct`: steps of up to
    16 rows take the unsorted-rows path (`DirectGmm`), larger ones the sorted one; `router`:
    steps of up to 64 tokens routed by kernels/moe_router.py (padding tokens given id E, so the
    experts get no `valid`: the direct kernel and the sorted path skip those ids themselves);
    "split": steps of up to 2 tokens, the weight read by two programs of 32 rows each and a
    second launch routing; larger steps XLA's router. "row": the direct path with each slot's one
    row on the CUDA cores (`Tiling(block_m=1)`)."""
    import functools

    from hf_tiny import hf_greedy, make, make_llm, random_prompts

    from jaxllm import SamplingParams
    from jaxllm.kernels import moe_router
    from jaxllm.models import moe_model

    tiling = moe_gmm.Tiling(block_m=16, block_n=32, block_k=16, k_splits=2)  # H 64, F 32

    traced = []

    class Kernel:
        __call__ = staticmethod(lambda a, b, s: moe_gmm.grouped_matmul(a, b, s, tiling, interpret=True))

        @staticmethod
        def pair(a, b, c, s):
            traced.append(a.shape)
            return moe_gmm.grouped_matmul_pair(a, b, c, s, tiling, interpret=True)

        @staticmethod
        def direct_mlp(rows):
            if not direct or rows > 16:
                return None
            traced.append(("direct", rows))
            t = moe_gmm.Tiling(block_m=1, block_n=32, block_k=16, k_splits=2) if direct == "row" else tiling
            return gmm_impls.DirectGmm(t, interpret=True).direct_mlp(rows)

    routed = []
    if router:
        monkeypatch.setenv("JAXLLM_MOE_ROUTER", router)
        monkeypatch.setattr(moe_router, "default_splits", lambda H, E: 2)

    def route_small(h, *a):
        out = moe_router.route_small(h, *a)
        routed.append((h.shape[0], out is not None))
        return out

    init = moe_model.MoeLlama.__init__
    monkeypatch.setattr(moe_model.MoeLlama, "__init__", lambda self, *a, **kw: init(
        self, *a, **{**kw, "experts_fn": functools.partial(moe.experts, gmm=Kernel()),
                     **({"router_fn": route_small} if router else {})}))
    model, cfg, sd = make("qwen3_moe")
    buckets = dict(token_buckets=(8, 64) if direct else (64,))
    if router == "split":  # steps of up to SPLIT_TOKENS (2) tokens: a bucket of 2 for one request
        buckets = dict(token_buckets=(2, 8, 64), seq_buckets=(2, 8))
    llm = make_llm((cfg, sd), max_model_len=128, **buckets)
    prompts = random_prompts(2, cfg["vocab_size"], 3, 70, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for p, o in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(model, p, 6)
    assert traced  # the step was traced through the kernel
    assert any(t[0] == "direct" for t in traced) == bool(direct)
    if router == "kernel":  # the 8-token bucket through the kernel, the 64-token one too (<= MAX_TOKENS)
        assert (8, True) in routed and (64, True) in routed
    if router == "split":  # the 2-token bucket through the split kernels, larger ones XLA's router
        assert (2, True) in routed and (8, False) in routed and (64, False) in routed


def test_chooser_offers_decode_kernels_per_row_count(monkeypatch):
    """A large prefill bucket must not hide the decode kernels from the small buckets."""
    small = lambda x, w, s: jax.lax.ragged_dot(x, w, s) * 1.0
    monkeypatch.setattr(gmm_impls, "candidates", lambda M, *a, **k: {
        "ragged_dot": gmm_impls.ragged_dot_ref, **({"decode_x": small} if M <= 64 else {})})
    chooser = gmm_impls.Chooser()
    chooser.measure([16, 512], E=4, H=64, F=32, dtype=jnp.float32, reps=1)
    assert "decode_x" in chooser.timings[16] and set(chooser.timings[512]) == {"ragged_dot"}


def test_direct_rows_need_no_sort():
    """`direct_matmul(_pair)`: rows in any order, each times its own group's weight; repeated
    experts, rows of group G (padding, another device's expert: undefined, not checked)."""
    rng = np.random.default_rng(8)
    M, G, K, N = 21, 6, 64, 64
    groups = rng.integers(0, G, M)
    groups[[3, 10]] = G  # no expert
    groups[[0, 1, 2]] = 4  # one expert, three rows
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w1, w2 = (jnp.asarray(rng.standard_normal((G, K, N)) / 8, jnp.float32) for _ in range(2))
    sched = np.asarray(moe_gmm.row_slots(jnp.asarray(groups), G))
    np.testing.assert_array_equal(sched[2], groups < G)
    np.testing.assert_array_equal(sched[1], np.arange(M))
    g = jnp.asarray(groups, jnp.int32)
    live = groups < G
    # a 16-row tile a slot, and the slot's one row on the CUDA cores
    for tiling in (moe_gmm.Tiling(block_m=16, block_n=32, block_k=32, k_splits=2),
                   moe_gmm.Tiling(block_m=1, block_n=32, block_k=32, k_splits=2)):
        y1, y2 = jax.jit(lambda *a: moe_gmm.direct_matmul_pair(*a, tiling, interpret=True))(x, w1, w2, g)
        y = jax.jit(lambda *a: moe_gmm.direct_matmul(*a, tiling, interpret=True))(x, w1, g)
        for got, w in ((y1, w1), (y2, w2), (y, w1)):
            want = np.einsum("mk,mkn->mn", np.asarray(x), np.asarray(w)[np.minimum(groups, G - 1)])
            np.testing.assert_allclose(np.asarray(got)[live], want[live], rtol=2e-5, atol=2e-5)


def test_expert_block_through_the_direct_path_matches_the_reference():
    """moe.experts with a `direct_mlp` gmm (unsorted rows; padding tokens; an expert-parallel
    slice, rows of other devices' experts) = the sorted ragged_dot path; a gmm without one or
    a Chooser that picked a sorted implementation still sorts."""
    rng = np.random.default_rng(9)
    T, k, E, H, F = 5, 3, 8, 64, 32
    x, wg, wu, wd, weights = _expert_block(rng, T, k, E, H, F)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
    valid = jnp.arange(T) < 4
    direct = gmm_impls.DirectGmm(moe_gmm.Tiling(block_m=16, block_n=32, block_k=32), interpret=True)
    for first, El in ((0, E), (4, 4)):  # the whole layer; experts 4..7 of an EP slice
        sl = slice(first, first + El)
        args = (x, weights, ids, wg[sl], wu[sl], wd[sl])
        got = jax.jit(lambda *a: moe.experts(*a, valid=valid, first_expert=first, gmm=direct))(*args)
        want = moe.experts(*args, valid=valid, first_expert=first)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    chooser = gmm_impls.Chooser()
    chooser.impls.update(direct=direct, sorted=gmm_impls.DecodeGmm(direct.tiling, interpret=True))
    chooser.choice.update({T * k: "direct", 2 * T * k: "sorted"})
    assert chooser.direct_mlp(T * k) == direct._mlp
    assert chooser.direct_mlp(2 * T * k) is None and chooser.direct_mlp(7) is None  # sorted, ragged_dot


def test_chooser_offers_direct_rows_for_small_batches_and_times_the_whole_block(monkeypatch):
    """Direct (unsorted) candidates up to DIRECT_MAX_ROWS rows; the measurement times
    `moe.experts` end to end (sorting included), tokens = rows / top_k with distinct experts,
    with every token real and with one real token (the rest padding, id E)."""
    gpu = gmm_impls.candidates(8, 128, 2048, 768, "gpu", engine=True)
    assert {n for n in gpu if n.startswith("direct_")} == {
        "direct_" + n for n in gmm_impls.ENGINE_DECODE_TILINGS if n.startswith(("decode_", "row_"))}
    assert not any(n.startswith("direct_") for n in gmm_impls.candidates(
        gmm_impls.DIRECT_MAX_ROWS + 8, 128, 2048, 768, "gpu"))
    seen, live = [], set()

    class Direct:  # a direct implementation that records what it is called with
        def __call__(self, x, w, s):
            return jax.lax.ragged_dot(x, w, s)

        def direct_mlp(self, rows):
            def mlp(x, a, u, b, groups):
                seen.append((x.shape, groups.shape))
                jax.debug.callback(lambda g: live.add(int((np.asarray(g) < 8).sum())), groups)
                xr = jnp.repeat(x, groups.shape[0] // x.shape[0], axis=0)
                gi = jnp.minimum(groups, a.shape[0] - 1)
                h = jax.nn.silu(jnp.einsum("mh,mhf->mf", xr, a[gi])) * jnp.einsum("mh,mhf->mf", xr, u[gi])
                return jnp.einsum("mf,mfh->mh", h, b[gi])
            return mlp

    monkeypatch.setattr(gmm_impls, "candidates", lambda *a, **k: {
        "ragged_dot": gmm_impls.ragged_dot_ref, "direct_x": Direct()})
    chooser = gmm_impls.Chooser()
    chooser.measure([16], E=8, H=64, F=32, dtype=jnp.float32, reps=1, top_k=4)
    assert set(chooser.timings[16]) == {"ragged_dot", "direct_x"}
    assert seen and all(s == ((4, 64), (16,)) for s in seen)  # 4 tokens x top 4 = 16 rows
    assert live == {16, 4}  # rows of live experts: all 4 tokens', then the first token's


@pytest.mark.parametrize("tiling,padding", [
    (moe_gmm.Tiling(block_m=16, block_n=32, block_k=16), False),
    (moe_gmm.Tiling(block_m=16, block_n=32, block_k=16, k_splits=2), False),
    # persistent CTAs: fewer than the items (each walks several), and more
    (moe_gmm.Tiling(block_m=16, block_n=32, block_k=16, k_splits=2, ctas=5), False),
    (moe_gmm.Tiling(block_m=16, block_n=32, block_k=16, k_splits=2, ctas=5), True),
    (moe_gmm.Tiling(block_m=16, block_n=32, block_k=16, ctas=64), True),
    # one-row slots on the CUDA cores: unsplit, K split (partials into down), persistent
    (moe_gmm.Tiling(block_m=1, block_n=32, block_k=16), False),
    (moe_gmm.Tiling(block_m=1, block_n=16, block_k=16, k_splits=2), True),
    (moe_gmm.Tiling(block_m=1, block_n=32, block_k=16, k_splits=2, ctas=5), True)],
    ids=lambda a: a.name if isinstance(a, moe_gmm.Tiling) else ("padding" if a else "full"))
def test_direct_swiglu_is_the_expert_mlp(tiling, padding):
    """`direct_swiglu`: x read per token (k rows a token), the down launch summing the gate/up
    K-split partials and applying silu(gate) * up itself = the per-row expert MLP; rows of
    group E or -1 (padding, other devices' experts) are not checked. `padding`: the last token
    is padding (id E, as `moe_router` gives it), so persistent CTAs stop at the row before."""
    rng = np.random.default_rng(11)
    T, k, E, H, F = 3, 4, 6, 64, 32
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((E, H, F)) / 8, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, H)) / 6, jnp.float32)
    groups = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).reshape(-1)
    groups[5], groups[2] = E, -1
    if padding:
        groups[-k:] = E
    got = jax.jit(lambda *a: moe_gmm.direct_swiglu(*a, tiling, interpret=True))(
        x, wg, wu, wd, jnp.asarray(groups, jnp.int32))
    xr, gi = np.repeat(np.asarray(x), k, axis=0), np.minimum(groups, E - 1)
    h = np.einsum("mh,mhf->mf", xr, np.asarray(wg)[gi])
    h = h / (1 + np.exp(-h)) * np.einsum("mh,mhf->mf", xr, np.asarray(wu)[gi])
    want = np.einsum("mf,mfh->mh", h, np.asarray(wd)[gi])
    live = (groups >= 0) & (groups < E)
    assert got.shape == (T * k, H)
    np.testing.assert_allclose(np.asarray(got)[live], want[live], rtol=2e-5, atol=2e-5)


def test_direct_kernel_lowers_to_triton():
    t = moe_gmm.TILINGS[0]
    f = jax.jit(lambda x, a, b, g: moe_gmm.direct_matmul_pair(x, a, b, g, t, interpret=False))
    args = (jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32))
    assert "jaxllm_moe_decode_gmm" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    persistent = next(t for t in moe_gmm.TILINGS if t.ctas)
    rows = [t for t in moe_gmm.TILINGS if t.block_m == 1]  # one-row slots on the CUDA cores
    assert {t.k_splits for t in rows} == {1, 2, 4}
    # K splits 1 and 4; persistent; gate/up split 4 ways with down unsplit (`down_variants`);
    # one-row slots, and a split one's down under an unsplit one
    for t, d in ((moe_gmm.TILINGS[0], None), (moe_gmm.TILINGS[2], None), (persistent, None),
                 (moe_gmm.TILINGS[2], moe_gmm.TILINGS[1]), *((r, None) for r in rows),
                 (rows[0], next(r for r in rows if r.k_splits == 1))):
        mlp = jax.jit(lambda x, a, b, c, g, t=t, d=d: moe_gmm.direct_swiglu(x, a, b, c, g, t, interpret=False,
                                                                          down_tiling=d))
        text = mlp.trace(jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16), args[1], args[2],
                         jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16),
                         jax.ShapeDtypeStruct((8,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("jaxllm_moe_decode_gmm") >= 2


def test_persistent_tilings_take_the_direct_path_only():
    t = next(t for t in moe_gmm.TILINGS if t.ctas)
    x = jnp.zeros((8, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16)
    with pytest.raises(ValueError, match="persistent"):
        jax.eval_shape(lambda x, w: moe_gmm.grouped_matmul(x, w, jnp.full((128,), 0, jnp.int32), t,
                                                           interpret=False), x, w)


@pytest.mark.parametrize("gate_up,down", [
    (moe_gmm.Tiling(block_m=16, block_n=32, block_k=16, k_splits=2), moe_gmm.Tiling(block_m=16, block_n=16, block_k=32)),
    (moe_gmm.Tiling(block_m=16, block_n=16, block_k=32), moe_gmm.Tiling(block_m=16, block_n=32, block_k=8, k_splits=2))],
    ids=["split-then-whole", "whole-then-split"])
def test_direct_swiglu_with_its_own_down_tiling(gate_up, down):
    """The down launch under a tiling of its own (`down_tiling`) reads the gate/up launch's raw
    output as the shared tiling does: the same expert MLP."""
    rng = np.random.default_rng(5)
    T, k, E, H, F = 3, 2, 4, 64, 32
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((E, H, F)) / 8, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, H)) / 6, jnp.float32)
    groups = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).reshape(-1), jnp.int32)
    mlp = lambda t, d: jax.jit(lambda *a: moe_gmm.direct_swiglu(*a, t, interpret=True, down_tiling=d))  # noqa: E731
    want = mlp(gate_up, None)(x, wg, wu, wd, groups)
    got = mlp(gate_up, down)(x, wg, wu, wd, groups)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    impl = gmm_impls.DirectGmm(gate_up, interpret=True, down=down)
    np.testing.assert_allclose(np.asarray(jax.jit(impl.direct_mlp(T * k))(x, wg, wu, wd, groups)),
                               np.asarray(want), rtol=2e-5, atol=2e-5)


def test_chooser_retiles_the_best_direct_down_launch(monkeypatch):
    """After the whole-block timings, the best direct implementation is timed again with each
    unsplit decode tiling and each two-way split one-row tiling for its down launch
    (`down_variants`; not a tile tiling split two ways), and the fastest kept."""
    small = (moe_gmm.Tiling(block_m=16, block_n=32, block_k=16, k_splits=2),
             moe_gmm.Tiling(block_m=16, block_n=16, block_k=32), moe_gmm.Tiling(block_m=16, block_n=32, block_k=32),
             moe_gmm.Tiling(block_m=1, block_n=32, block_k=16, k_splits=2))
    monkeypatch.setattr(moe_gmm, "TILINGS", small)
    best = gmm_impls.DirectGmm(small[0], interpret=True)
    variants = gmm_impls.down_variants("direct_a", best, H=64, F=32)
    assert set(variants) == {f"direct_a+down_{t.name}" for t in small[1:]}
    assert all(v.tiling is small[0] and v.down in small[1:] for v in variants.values())
    assert gmm_impls.down_variants("x", gmm_impls.DecodeGmm(small[0]), 64, 32) == {}  # sorted rows: none
    assert gmm_impls.down_variants("x", variants["direct_a+down_" + small[1].name], 64, 32) == {}
    pair = {"direct_a": best, "direct_b": gmm_impls.DirectGmm(small[1], interpret=True)}
    monkeypatch.setattr(gmm_impls, "candidates", lambda *a, **k: dict(pair))
    chooser = gmm_impls.Chooser()
    chooser.measure([8], E=4, H=64, F=32, dtype=jnp.float32, reps=1, top_k=2)
    times = chooser.timings[8]
    first = min(pair, key=times.get)  # the best of the first round, then its down launch retiled
    assert set(times) == {*pair, *gmm_impls.down_variants(first, pair[first], H=64, F=32)}
    assert any("+down_" in name for name in times)
    assert chooser.choice[8] == min(times, key=times.get) and chooser.choice[8] in chooser.impls
