"""Grouped matmul implementations for the MoE layer, and the pick by measurement.

`gmm(x [M, K] rows sorted by group, w [G, K, N], group_sizes [G]) -> [M, N]`:

- "ragged_dot": `jax.lax.ragged_dot`, the reference and the CPU path.
- "decode_<bn>x<bk>k<splits>": jaxllm's own decode kernel (`kernels/moe_gmm.py`, Triton via
  Pallas), which reads only the routed experts' weights, each spread over many CTAs; offered
  for decode-sized row counts (M <= DECODE_MAX_ROWS).
- "tiles<bm>_<bn>x<bk>w<warps>s<stages>": the same kernel with 64- or 128-row blocks
  (`moe_gmm.PREFILL_TILINGS`), offered for prefill-sized row counts (M > DECODE_MAX_ROWS).
- "direct_decode_<bn>x<bk>k<splits>": the decode kernel over unsorted rows, one slot a row
  (`moe_gmm.direct_swiglu`), offered up to DIRECT_MAX_ROWS rows: `moe.experts` then skips
  sorting and unsorting the rows (an expert two rows share is read twice). With a suffix
  "c<n>": n persistent CTAs walking the rows up to the last live one, so a batch-1 step in a
  bucket of 8 launches n CTAs, not one per item of all 8 tokens' rows. "direct_row_...": each
  slot's one row on the CUDA cores (no 16-row tensor-core tile gathering 15 rows to mask). "+down_<tiling>": the
  measured best of these with its down launch under an unsplit tiling of its own
  (`down_variants`, timed after the others).
- "mosaic_<bn>x<bk>s<stages>": its Hopper twin (`kernels/moe_gmm_mosaic.py`, Mosaic GPU:
  the bundled kernel's TMA/wgmma schedule over only the row blocks that hold rows).
- "ws<bm>_<bn>x<bk>s<stages>": a warp-specialized Hopper kernel (`kernels/moe_gmm_ws.py`: the
  twin's slot schedule over bm-row slots, a memory warpgroup and two compute warpgroups), offered
  for prefill-sized row counts; gate and up in one launch, and for the engine's 128-row tilings
  also as two ("..._split", `WsSplitGmm`).
- "wsglu<bm>_<bn>x<bk>s<stages>": the same kernel reading gate's and up's strips of the same
  columns in one tile and storing silu(gate) * up (`moe_gmm_ws.swiglu`, `WsGluGmm`); down
  through the one-weight kernel of the same slots (`WsTiling.down`; "d256": a 256-column strip;
  "c": chained tiles), reading the slot-major gate/up output as it is
  (`moe_gmm_ws.mlp`: the whole MLP and the unsort, one gather in row order).
- "mgpu_<bm>x<bn>": JAX's bundled Mosaic GPU kernel
  (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`) at one tiling. It needs the
  group sizes to cover every row, so the rows no group covers (padding, other
  devices' experts) are given to the last group here; `moe.experts` zeroes them.

On a GPU, `Chooser.measure` times every available implementation on the
model's real expert shapes for each row count the token buckets give (tokens x
top_k) during warm-up, and the step's trace takes the fastest for its row count:
the choice is static per compiled bucket, so it never costs a recompile.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.envs import env_choice
from jaxllm.models.gmm_kernels import (DecodeGmm, DirectGmm, GroupedMatmul, MosaicGmm,  # noqa: F401
                                       WsGluGmm, WsGmm, WsSplitGmm, _mgpu, down_variants)

log = logging.getLogger("jaxllm")

DECODE_MAX_ROWS = 1024  # the decode kernel re-reads an expert per 16-row block: decode only
REF_TOKENS = 64  # tokens the warm-up's ragged_dot reference computes (`Chooser.measure`)
PREFILL_CALLS = (1, 5)  # prefill-sized row counts: the marginal cost of a call between these counts
DIRECT_MAX_ROWS = 64  # unsorted rows (one slot a row) for batches up to 64 / top_k tokens
# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
MGPU_TILINGS = ((64, 128, 64, 4, 1), (128, 128, 64, 4, 2), (128, 256, 64, 3, 1))


def ragged_dot_ref(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, group_sizes)


# The decode tilings the engine measures at warm-up (each costs a compile per row count);
# scripts/gpu_moe.sh times all of them, so this list follows its figures.
ENGINE_DECODE_TILINGS = ("decode_64x256k1", "decode_128x64k4", "decode_128x64k4c528", "mosaic_128x64s4",
                         "mosaic_64x64s6", "row_64x64k4", "row_64x64k4c528")


def candidates(M: int, E: int, H: int, F: int, platform: str | None = None,
               engine: bool = False) -> dict[str, GroupedMatmul]:
    """Implementations that can run this layer shape here (all of them shape-checked);
    `engine`: only ENGINE_DECODE_TILINGS of the decode kernels (start-up compiles)."""
    platform = platform or jax.devices()[0].platform
    out: dict[str, GroupedMatmul] = {"ragged_dot": ragged_dot_ref}
    if platform != "gpu":
        return out
    if M <= DECODE_MAX_ROWS:
        from jaxllm.kernels import moe_gmm

        for t in moe_gmm.TILINGS:  # each projection's (K, N): gate/up (H, F or 2F), down (F, H)
            if t.fits(H, F) and t.fits(F, H):
                if not t.ctas and t.block_m > 1:  # persistent CTAs, one-row slots: the direct path only
                    out[t.name] = DecodeGmm(t)
                if M <= DIRECT_MAX_ROWS:
                    out["direct_" + t.name] = DirectGmm(t)
        try:
            from jaxllm.kernels import moe_gmm_mosaic

            for t in moe_gmm_mosaic.TILINGS:
                if t.fits(H, F) and t.fits(F, H):
                    out[t.name] = MosaicGmm(t)
        except Exception as e:  # a jax without Mosaic GPU
            log.info("Mosaic decode kernel unavailable: %s", e)
        if engine:
            out = {k: v for k, v in out.items() if not isinstance(v, DecodeGmm)
                   or k.removeprefix("direct_") in ENGINE_DECODE_TILINGS}
    else:
        from jaxllm.kernels import moe_gmm

        for t in moe_gmm.PREFILL_TILINGS:
            if t.fits(H, F) and t.fits(F, H):
                out[t.name] = DecodeGmm(t)
        try:
            from jaxllm.kernels import moe_gmm_ws

            # CHAINED: the bench's; the engine measures their best (an H100: 1,538 against
            # 1,639 us for the unchained twin at 65,536 rows, its lone-tile path correct there),
            # unless JAXLLM_GMM_CHAINED=0 (session 35's comparison)
            chained = moe_gmm_ws.CHAINED if not engine else (
                moe_gmm_ws.CHAINED[-1:] if env_choice("JAXLLM_GMM_CHAINED", "1", ("0", "1")) == "1" else ())
            for t in moe_gmm_ws.TILINGS + moe_gmm_ws.GLU + chained:
                if t.fits(H, F) and t.down.fits(F, H):
                    out[t.name] = WsGluGmm(t) if t.glu else WsGmm(t)
                    if engine and t.block_m == 2 * moe_gmm_ws.WG_ROWS:  # the bench times `_split` itself
                        out[t.name + "_split"] = WsSplitGmm(t)
        except Exception as e:  # a jax without Mosaic GPU's warp-specialized pipeline
            log.info("warp-specialized grouped matmul unavailable: %s", e)
    try:
        for t in MGPU_TILINGS:
            bm, bn, bk, _, gbn = t
            if H % bk or F % bk or (2 * F) % (bn * gbn) or H % (bn * gbn) or F % (bn * gbn):
                continue
            out[f"mgpu_{bm}x{bn}"] = _mgpu(t)
    except Exception as e:  # an older / newer jax without the kernel
        log.info("ragged_dot_mgpu unavailable: %s", e)
    return out


def swiglu(x, w_gu, w_d, sizes, gmm: GroupedMatmul):
    """The benchmark's fused gate/up layout: w_gu [E, H, 2F] (gate first), w_d [E, F, H]."""
    g, u = jnp.split(gmm(x, w_gu, sizes), 2, axis=-1)
    return gmm(jax.nn.silu(g) * u, w_d, sizes)


class Chooser:
    """A `gmm` that dispatches, at trace time, on the row count to the measured fastest."""

    def __init__(self):
        self.choice: dict[int, str] = {}
        self.impls: dict[str, GroupedMatmul] = {"ragged_dot": ragged_dot_ref}
        self.timings: dict[int, dict[str, float]] = {}

    def _impl(self, rows: int) -> GroupedMatmul:
        return self.impls[self.choice.get(rows, "ragged_dot")]

    def __call__(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return self._impl(x.shape[0])(x, w, group_sizes)

    def pair(self, x: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array):
        """Gate and up: in one launch where the chosen implementation can (`DecodeGmm.pair`)."""
        impl = self._impl(x.shape[0])
        if hasattr(impl, "pair"):
            return impl.pair(x, w1, w2, group_sizes)
        return impl(x, w1, group_sizes), impl(x, w2, group_sizes)

    def swiglu(self, x: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """silu(x @ w1) * (x @ w2) by the chosen implementation (`moe.swiglu`: whole where it can)."""
        from jaxllm.models.moe import swiglu
        return swiglu(x, w1, w2, group_sizes, self._impl(x.shape[0]))

    def sorted_mlp(self, rows: int):
        """The chosen implementation's whole MLP of sorted rows at this row count, or None."""
        whole = getattr(self._impl(rows), "sorted_mlp", None)
        return whole(rows) if whole is not None else None

    def direct_mlp(self, rows: int):
        """The chosen implementation's unsorted-rows MLP at this row count, or None (sorted)."""
        direct = getattr(self._impl(rows), "direct_mlp", None)
        return direct(rows) if direct is not None else None

    def measure(self, rows: list[int], E: int, H: int, F: int, dtype, reps: int = 10,
                top_k: int = 1) -> None:
        """Time each candidate's whole expert block (`moe.experts`: gate, up, down, and the sort
        and unsort around the sorted-row implementations, which the direct ones skip) on this
        expert shape at each row count: rows / top_k tokens, each routed to top_k distinct
        random experts. Each is checked first against ragged_dot on the first REF_TOKENS
        tokens; the fastest is kept.
        Every row count is timed as loops of dependent calls: a decode-sized call takes tens of
        microseconds, less than its dispatch (`timing.chained`); a prefill-sized one by its
        marginal cost, the difference between loops of PREFILL_CALLS calls (`timing.counted`),
        as a step runs the block once a layer, without the dispatch of an execution."""
        from jaxllm.kernels.timing import UNROLL, time_checked, turns
        from jaxllm.models.moe import experts

        if len(candidates(min(rows), E, H, F, engine=True)) == 1:  # no GPU kernels: ragged_dot throughout
            return
        key = jax.random.key(0)
        w_g = (jax.random.normal(key, (E, H, F), jnp.float32) / np.sqrt(H)).astype(dtype)
        w_u = (jax.random.normal(jax.random.key(1), (E, H, F), jnp.float32) / np.sqrt(H)).astype(dtype)
        w_d = (jax.random.normal(key, (E, F, H), jnp.float32) / np.sqrt(F)).astype(dtype)
        rng = np.random.default_rng(0)
        for M in sorted(set(rows)):
            cands = candidates(M, E, H, F, engine=True)  # decode kernels: decode-sized row counts only
            self.impls.update(cands)
            k = top_k if M % top_k == 0 and top_k <= E else 1
            T = M // k
            # Decode-sized rows: routings in turn whose experts exceed the L2 (`timing.turns`;
            # a batch of one token touches k experts), so weights come from HBM as in a step.
            n_sets = turns(k * 3 * H * F * jnp.dtype(dtype).itemsize) if M <= DECODE_MAX_ROWS else 1
            id_sets = [jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :k], jnp.int32)
                       for _ in range(n_sets)]
            wt_sets = [jnp.asarray(rng.random((T, k)), jnp.float32) for _ in range(n_sets)]
            x = jax.random.normal(key, (T, H), jnp.float32).astype(dtype)
            first = dict(cands)
            if M > DECODE_MAX_ROWS and len(first) > 1:  # XLA's ragged_dot expands every row against
                del first["ragged_dot"]  # every expert (H200: 117 ms, 32 GiB at 65,536 rows): never
                # chosen there, and still what an unmeasured row count falls back to
            # The reference: ragged_dot on the first REF_TOKENS tokens alone (a token's output
            # depends on no other token), against which each candidate's first rows are checked;
            # ragged_dot over all rows at prefill sizes runs out of memory (32 GiB at 65,536).
            n = min(T, REF_TOKENS)
            ref_fn = jax.jit(lambda *a: experts(*a, gmm=ragged_dot_ref))

            def timed(fns, id_sets, what):  # the check: the last set's output
                ref = ref_fn(x[:n], wt_sets[-1][:n], id_sets[-1][:n], w_g, w_u, w_d)
                sets = [(p, i, w_g, w_u, w_d) for p, i in zip(wt_sets, id_sets)]
                return time_checked(fns, (x, *sets[0]), reps, "MoE grouped matmul",
                                    f" at {M} rows{what}", tol=3e-2, catch=True, ref=ref,
                                    chain=20 if M <= DECODE_MAX_ROWS else 0, unroll=UNROLL,
                                    marginal=None if M <= DECODE_MAX_ROWS else PREFILL_CALLS,
                                    more=tuple(sets[1:]))

            def ranked(impls):  # seconds a whole expert block of each implementation
                fns = {name: (lambda x, p, i, a, u, b, impl=impl: experts(x, p, i, a, u, b, gmm=impl))
                       for name, impl in impls.items()}
                times = timed(fns, id_sets, "")
                if M <= DIRECT_MAX_ROWS and T > 1 and times:
                    # A small decode bucket also serves a batch of one: time that too (the other
                    # tokens padding, id E as the router kernel gives them) and rank by the sum.
                    one = timed(fns, [i.at[1:].set(E) for i in id_sets], ", one real token")
                    times = {name: t + one[name] for name, t in times.items() if name in one}
                return times
            times = ranked(first)
            best = min(times, key=times.get) if times else None
            more = down_variants(best, cands[best], H, F) if best else {}
            if more:  # the best direct one again, its down launch retiled
                self.impls.update(more)
                times.update(ranked(more))
            if times:
                self.choice[M] = min(times, key=times.get)
                self.timings[M] = times
        log.info("MoE grouped matmul by measurement (rows -> impl): %s", self.choice)
        log.info("MoE grouped matmul timings (rows -> impl: us per expert block): %s",
                 {M: {n: round(t * 1e6, 1) for n, t in v.items()} for M, v in self.timings.items()})
