"""Decode-sized grouped matmul: only the routed experts' weights are read, each spread over SMs
(and, with larger row blocks, `PREFILL_TILINGS`, a candidate for prefill-sized steps).

`gmm(x [M, K] rows sorted by group, w [G, K, N], group_sizes [G]) -> [M, N]`, the contract of
`jax.lax.ragged_dot` (the reference, `models/moe.ragged_dot`), except that rows no group covers
are left undefined (`moe.experts` zeroes them).

Why: at decode a step routes T x top_k rows to at most that many experts, a few rows each, so
the work is reading those experts' weights once (bandwidth-bound). XLA's `ragged_dot` and the
bundled `ragged_dot_mgpu` visit all G experts; this kernel visits only row blocks that exist.

Schedule (`slots`, a few XLA ops on [G] vectors): each group's rows are cut into blocks of
`block_m`; slot s = (expert, first row, row count) of the s-th block over all groups in order.
The number of slots is bounded statically by min(G, M) + M // block_m, so the grid never
depends on the routing (no recompiles); slots past the real blocks have count 0 and return at
once. Grid (N / block_n, K splits, slot; the slot slowest, so a batch's first, real rows launch
first): every slot's expert weight [K, N] is cut into N / block_n column strips x `k_splits`
row ranges, one CTA each, so a single token's 8 experts become hundreds of CTAs streaming disjoint weight tiles (the "spread over all SMs" part). A CTA
gathers its rows of x ([block_m, block_k] per step; rows past the count are clamped copies
whose results are masked), multiplies on the tensor cores (`plt.dot`, float32 accumulation) and
stores its rows with a mask (into an output with `block_m` spare rows, so the masked lanes'
indices stay distinct and in bounds). With `k_splits > 1` each split stores a float32 partial
`[k_splits, M, N]` that one XLA sum combines (M x N x 4 bytes per split: small at decode).

`grouped_matmul_pair` runs two weights of one shape over the same rows in one launch (the
expert MLP's gate and up: the strip axis spans both), so a decode layer is two launches, not three.

`direct_matmul(_pair)` takes rows unsorted, one slot a row (`row_slots`): a small decode batch
(one token: 8 rows, 8 distinct experts) then needs none of the sort, group sizes, slot table
and unsort around the kernel, about ten small XLA kernels a layer at batch 1 (session 22's
Qwen3-30B-A3B step spent ~77 us a layer outside its matmuls). `direct_swiglu` is the whole
expert MLP that way in two launches: the gate/up one reads each row's token from x itself and
the down one applies the K-split sum and silu(gate) * up as it loads its rows. `models/gmm.py`
measures it against the sorted path per row count.

A `pallas_call`: Triton on the GPU, Pallas' interpreter on the CPU (tests/test_moe_gmm.py
checks it against `ragged_dot` there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

SCHED_FIELDS = 3  # rows of the slot table: expert, first row, row count


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_m: int = 16  # rows per slot (tensor-core minimum; 1: the direct path's row on the CUDA cores)
    block_n: int = 128  # weight columns per CTA
    block_k: int = 128  # weight rows per step
    k_splits: int = 1  # CTAs along K per strip (float32 partials summed by XLA)
    num_warps: int = 4
    num_stages: int = 3
    # direct path only: 0, a CTA an item (row, strip, K split) of the grid; n > 0, n CTAs that
    # walk the items of the rows up to the last live one (`_kernel`), so the rows of padding
    # tokens past it launch nothing
    ctas: int = 0

    @property
    def name(self) -> str:
        if self.block_m == 1:  # direct path only: a slot's one row on the CUDA cores (`_row_strip`)
            return f"row_{self.block_n}x{self.block_k}k{self.k_splits}" + (f"c{self.ctas}" if self.ctas else "")
        if self.block_m != 16:  # a prefill tiling (PREFILL_TILINGS): rows per slot named too
            return f"tiles{self.block_m}_{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
        return f"decode_{self.block_n}x{self.block_k}k{self.k_splits}" + (f"c{self.ctas}" if self.ctas else "")

    def fits(self, K: int, N: int) -> bool:
        return N % self.block_n == 0 and K % (self.block_k * self.k_splits) == 0


TILINGS = (Tiling(block_n=128, block_k=128), Tiling(block_n=64, block_k=256),
           Tiling(block_n=128, block_k=64, k_splits=4), Tiling(block_n=256, block_k=64, k_splits=4),
           # direct path only: 4 CTAs an SM of an H100 / H200 (132 SMs), persistent
           Tiling(block_n=128, block_k=64, k_splits=4, ctas=4 * 132),
           # direct path only: the slot's one row on the CUDA cores, no 16-row tensor-core tile
           Tiling(block_m=1, block_n=128, block_k=64, k_splits=4),
           Tiling(block_m=1, block_n=64, block_k=64, k_splits=4),
           Tiling(block_m=1, block_n=128, block_k=64, k_splits=1),
           Tiling(block_m=1, block_n=64, block_k=64, k_splits=2),
           Tiling(block_m=1, block_n=64, block_k=64, k_splits=4, ctas=4 * 132))
# Prefill-sized steps (many rows an expert): the same kernel with tensor-core-sized row blocks, a
# slot per 128 (64) rows of an expert, so each expert's weight tile is read once per row block
# rather than once per 16 rows. Offered beside JAX's bundled `ragged_dot_mgpu` (264 TFLOP/s at
# 8,192 tokens on an H200, torch `_grouped_mm` 433; docs/benchmarks.md, session 22) and chosen
# only by measurement (models/gmm.py); not yet timed on a GPU.
PREFILL_TILINGS = (Tiling(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
                   Tiling(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4))


def num_slots(M: int, G: int, block_m: int) -> int:
    """Static bound on the row blocks of any routing: sum_g ceil(n_g / bm) <= nonzero + M // bm."""
    return min(G, M) + M // block_m


def slots(group_sizes: jax.Array, M: int, block_m: int) -> jax.Array:
    """[3, S] int32: per slot (expert, first row, rows); slots past the real blocks have 0 rows."""
    G = group_sizes.shape[0]
    S = num_slots(M, G, block_m)
    sizes = group_sizes.astype(jnp.int32)
    blocks = (sizes + block_m - 1) // block_m
    ends = jnp.cumsum(blocks)
    s = jnp.arange(S, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(ends, s, side="right", method="compare_all").astype(jnp.int32),
                    G - 1)
    rb = s - (ends - blocks)[g]  # block index within its group
    first = (jnp.cumsum(sizes) - sizes)[g] + rb * block_m
    count = jnp.where(s < ends[-1], jnp.clip(sizes[g] - rb * block_m, 0, block_m), 0)
    return jnp.stack([g, first, count])


def _kernel(sched_ref, x_ref, *refs, t: Tiling, k_steps: int, strips: int, rows_out: int,
            row_div: int = 1, swiglu: int = 0):
    """refs = the weights (one or two, sharing x's rows and the grid's strip axis), then out.

    Output row r reads x row r // row_div (direct path: a token's k rows share its x row), or
    with `swiglu` = P > 0 the gate/up pair's raw output [P, rows, 2K] (P float32 partials of a
    K split, or P = 1): silu(sum of gate) * (sum of up), computed as the rows are loaded."""
    w_refs, o_ref = refs[:-1], refs[-1]
    G = w_refs[0].shape[0]
    if not t.ctas:  # a CTA an item; the slot axis slowest: see `_call`
        _item(pl.program_id(0), pl.program_id(1), pl.program_id(2), sched_ref, x_ref, w_refs, o_ref,
              t=t, k_steps=k_steps, strips=strips, rows_out=rows_out, row_div=row_div, swiglu=swiglu)
        return
    # persistent (direct path): the items of rows [0, last live row] in order (a decode batch's
    # real tokens come first), item i = (row, K split, column strip) in that nesting, to CTA
    # i % ctas
    M = sched_ref.shape[0]
    idx = jnp.arange(pl.next_power_of_2(M), dtype=jnp.int32)
    g = sched_ref[jnp.minimum(idx, M - 1)]
    rows_live = jnp.max(jnp.where((idx < M) & (g >= 0) & (g < G), idx + 1, 0))
    cols = len(w_refs) * strips
    items = rows_live * (t.k_splits * cols)
    c = pl.program_id(0)

    def each(n, carry):
        i = c + n * t.ctas
        s, rem = i // (t.k_splits * cols), i % (t.k_splits * cols)
        _item(rem % cols, rem // cols, s, sched_ref, x_ref, w_refs, o_ref, t=t, k_steps=k_steps,
              strips=strips, rows_out=rows_out, row_div=row_div, swiglu=swiglu)
        return carry

    jax.lax.fori_loop(0, jnp.maximum(items - c + t.ctas - 1, 0) // t.ctas, each, 0)


def _item(j, ks, s, sched_ref, x_ref, w_refs, o_ref, *, t: Tiling, k_steps: int, strips: int,
          rows_out: int, row_div: int, swiglu: int):
    """One item: column strip j (of the weights side by side), K split ks, slot s."""
    if len(sched_ref.shape) == 1:  # the direct path's groups: slot s = row s of group groups[s]
        g = sched_ref[s]
        live = (g >= 0) & (g < w_refs[0].shape[0])  # any other id: no expert here, no work
        expert, first, count = jnp.where(live, g, 0), s, live.astype(jnp.int32)
    else:
        expert, first, count = sched_ref[0, s], sched_ref[1, s], sched_ref[2, s]
    strip = _row_strip if t.block_m == 1 else _tile_strip
    for i, w_ref in enumerate(w_refs):  # strip j of weight i = grid column i * strips + j
        @pl.when((count > 0) & (j // strips == i))
        def _(w_ref=w_ref, i=i):
            strip(w_ref, j - i * strips, i * w_ref.shape[2], ks, expert, first, count, x_ref, o_ref,
                  t=t, k_steps=k_steps, rows_out=rows_out, row_div=row_div, swiglu=swiglu)


def _tile_strip(w_ref, jn, col0: int, ks, expert, first, count, x_ref, o_ref, *, t: Tiling, k_steps: int,
                rows_out: int, row_div: int, swiglu: int):
    """The slot's [block_m, block_n] of x @ w[expert] at weight columns jn * block_n (K split ks)
    on the tensor cores: rows first .. first + count of the slot, the rest masked."""
    r = jnp.arange(t.block_m, dtype=jnp.int32)
    rows = first + r  # distinct (the output has block_m spare rows): masked stores never collide
    src = jnp.minimum(rows, rows_out - 1) // row_div  # past the count: clamped copies, results masked
    k0 = ks * (k_steps * t.block_k)
    K = w_ref.shape[1]

    def load_x(kk):
        """[bm, bk] rows of the matmul's left operand at columns kk."""
        if not swiglu:
            return x_ref[src[:, None], kk[None, :]]
        g = sum(x_ref[p, src[:, None], kk[None, :]].astype(jnp.float32) for p in range(swiglu))
        u = sum(x_ref[p, src[:, None], K + kk[None, :]].astype(jnp.float32) for p in range(swiglu))
        return (jax.nn.silu(g) * u).astype(w_ref.dtype)

    def step(i, acc):
        kk = k0 + i * t.block_k + jnp.arange(t.block_k, dtype=jnp.int32)
        xs = load_x(kk)  # [bm, bk] gathered rows
        ws = w_ref[expert, pl.ds(k0 + i * t.block_k, t.block_k), pl.ds(jn * t.block_n, t.block_n)]
        return acc + plt.dot(xs, ws).astype(jnp.float32)

    acc = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((t.block_m, t.block_n), jnp.float32))
    cols = col0 + jn * t.block_n + jnp.arange(t.block_n, dtype=jnp.int32)
    mask = (r < count)[:, None]
    if t.k_splits > 1:
        plt.store(o_ref.at[ks, rows[:, None], cols[None, :]], acc, mask=mask)
    else:
        plt.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=mask)


def _row_strip(w_ref, jn, col0: int, ks, expert, row, count, x_ref, o_ref, *, t: Tiling, k_steps: int,
               rows_out: int, row_div: int, swiglu: int):
    """`_tile_strip` for a slot of one row (count 1 here, as `_item` calls it), on the CUDA
    cores: the direct path's slot holds one row, so a 16-row tensor-core tile would gather (and,
    for down, run silu(gate) * up on) 15 rows only to mask them. Products summed elementwise in a
    [block_k, block_n] float32 tile (no reduction across threads a step), reduced once at the end."""
    src = jnp.minimum(row, rows_out - 1) // row_div
    k0 = ks * (k_steps * t.block_k)
    K = w_ref.shape[1]

    def load_x(k):
        """[block_k] of the row's left operand at columns k.., in float32."""
        if not swiglu:
            return x_ref[src, pl.ds(k, t.block_k)].astype(jnp.float32)
        g = sum(x_ref[p, src, pl.ds(k, t.block_k)].astype(jnp.float32) for p in range(swiglu))
        u = sum(x_ref[p, src, pl.ds(K + k, t.block_k)].astype(jnp.float32) for p in range(swiglu))
        return (jax.nn.silu(g) * u).astype(w_ref.dtype).astype(jnp.float32)  # as the tile path rounds

    def step(i, acc):
        k = k0 + i * t.block_k
        ws = w_ref[expert, pl.ds(k, t.block_k), pl.ds(jn * t.block_n, t.block_n)]
        return acc + load_x(k)[:, None] * ws.astype(jnp.float32)

    acc = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((t.block_k, t.block_n), jnp.float32))
    out = jnp.sum(acc, axis=0)
    cols = pl.ds(col0 + jn * t.block_n, t.block_n)
    if t.k_splits > 1:
        o_ref[ks, row, cols] = out
    else:
        o_ref[row, cols] = out.astype(o_ref.dtype)


def row_slots(groups: jax.Array, num_groups: int) -> jax.Array:
    """[3, M] int32 for rows in any order, one slot a row: (its group, the row, 1), or 0 rows
    when its group is outside [0, num_groups) (padding, another device's expert): the slot table
    that the direct path's kernel derives itself from `groups` (passed as its `sched`, one
    int32 a row, so no XLA kernel builds the table between the router and the matmul)."""
    M = groups.shape[0]
    live = (groups >= 0) & (groups < num_groups)
    return jnp.stack([jnp.where(live, groups, 0).astype(jnp.int32), jnp.arange(M, dtype=jnp.int32),
                      live.astype(jnp.int32)])


def _call(x: jax.Array, ws: tuple[jax.Array, ...], group_sizes: jax.Array | None, t: Tiling,
          interpret: bool | None, sched: jax.Array | None = None, rows: int | None = None,
          row_div: int = 1, swiglu: int = 0, raw: bool = False) -> jax.Array:
    """x @ each w in ws per group, side by side: [M, len(ws) * N] (slots from the group sizes
    of sorted rows, or the given `sched` over `rows` output rows: a [3, S] slot table or the
    direct path's groups [M]; `row_div` / `swiglu`: how output rows read x, `_kernel`). `raw`: the kernel's own output, spare rows and K-split
    partials included ([M + bm, ...] or [k_splits, M + bm, ...] float32)."""
    M = x.shape[-2] if rows is None else rows
    K = ws[0].shape[1]
    G, _, N = ws[0].shape
    if not t.fits(K, N) or any(w.shape != ws[0].shape for w in ws):
        raise ValueError(f"tiling {t.name} does not fit K={K}, N={N} (weights {[w.shape for w in ws]})")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if sched is None:
        sched = slots(group_sizes, M, t.block_m)
    if (t.ctas or t.block_m == 1) and sched.ndim != 1:
        raise ValueError(f"tiling {t.name}: persistent CTAs and one-row slots take the direct path's rows only")
    dt = ws[0].dtype if swiglu else x.dtype  # the dot's operands and the output
    k_steps = K // (t.block_k * t.k_splits)
    rows, cols = M + t.block_m, len(ws) * N  # spare rows take the last block's masked lanes
    if t.k_splits > 1:
        out_shape = jax.ShapeDtypeStruct((t.k_splits, rows, cols), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((rows, cols), dt)
    strips = N // t.block_n
    out = pl.pallas_call(
        functools.partial(_kernel, t=t, k_steps=k_steps, strips=strips, rows_out=M, row_div=row_div,
                          swiglu=swiglu),
        # the slot axis slowest (CUDA launches x fastest): every CTA of the first slots (a decode
        # batch's real tokens come first) goes out in the first wave, the padding rows' empty
        # CTAs after them, instead of 7 empty slots between live ones (batch 1 in a bucket of 8)
        grid=(t.ctas,) if t.ctas else (len(ws) * strips, t.k_splits, sched.shape[-1]),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name="jaxllm_moe_decode_gmm",
    )(sched, x, *(w.astype(dt) for w in ws))
    if raw:
        return out
    return out[:, :M].sum(axis=0).astype(dt) if t.k_splits > 1 else out[:M]


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tiling: Tiling = TILINGS[0],
                   interpret: bool | None = None) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N], group_sizes [G] -> [M, N] (uncovered rows undefined)."""
    return _call(x, (w,), group_sizes, tiling, interpret)


def grouped_matmul_pair(x: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array,
                        tiling: Tiling = TILINGS[0], interpret: bool | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """(x @ w1, x @ w2) per group in one launch (the expert MLP's gate and up projections)."""
    out = _call(x, (w1, w2), group_sizes, tiling, interpret)
    return out[:, :w1.shape[2]], out[:, w1.shape[2]:]


def direct_matmul(x: jax.Array, w: jax.Array, groups: jax.Array, tiling: Tiling = TILINGS[0],
                  interpret: bool | None = None) -> jax.Array:
    """x [M, K] in any row order, w [G, K, N], groups [M] int -> [M, N]: row r times
    w[groups[r]] (rows of a group outside [0, G): undefined). Each row is its own slot, so an
    expert that several rows route to is read once per row: for the few rows of a small decode batch,
    whose experts are mostly distinct, that costs less than sorting and unsorting them."""
    return _call(x, (w,), None, tiling, interpret, groups.astype(jnp.int32))


def direct_matmul_pair(x: jax.Array, w1: jax.Array, w2: jax.Array, groups: jax.Array,
                       tiling: Tiling = TILINGS[0], interpret: bool | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """`direct_matmul` of gate and up in one launch."""
    out = _call(x, (w1, w2), None, tiling, interpret, groups.astype(jnp.int32))
    return out[:, :w1.shape[2]], out[:, w1.shape[2]:]


def direct_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                  groups: jax.Array, tiling: Tiling = TILINGS[0], interpret: bool | None = None,
                  down_tiling: Tiling | None = None) -> jax.Array:
    """The expert MLP of unsorted rows in two launches and nothing between them: x [T, H] (row r
    is token r // k's, k = rows / T), groups [T * k] -> [T * k, H] (rows of a group outside
    [0, E): undefined). The gate/up launch reads each row's token straight from x (no repeated copy of
    x); the down launch reads the pair's raw output (its K-split partials summed, then
    silu(gate) * up, as it loads them), by `down_tiling` where given (down's K is gate/up's N:
    a split of it that suits gate/up's K can leave down's CTAs a few kilobytes each)."""
    T, rows = x.shape[0], groups.shape[0]
    sched = groups.astype(jnp.int32)  # the kernel's slot s: row s of group groups[s]
    gu = _call(x, (w_gate, w_up), None, tiling, interpret, sched, rows=rows, row_div=rows // T, raw=True)
    if gu.ndim == 2:
        gu = gu[None]
    w_down = w_down.astype(x.dtype)
    return _call(gu, (w_down,), None, down_tiling or tiling, interpret, sched, rows=rows,
                 swiglu=gu.shape[0])
