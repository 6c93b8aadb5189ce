"""Hopper paged decode attention on Mosaic GPU (`plgpu.kernel`), one query token (or a few) per CTA.

Grid (token, kv head), or a flat one when split (below). Each CTA owns the G = H / K query heads of one kv
head for one token, so every key/value page is loaded once for all of them.
Two warpgroups:
  * producer (wg 1): walks the split's pages through the block table and TMA-copies
    each [S, D] K and V page (contiguous in `kv_pages [L, 2, K, P, S, D]`) into
    an `nst`-deep ring of [BK, D] shared-memory tiles (BK = ppb pages), so up to
    nst * BK * D * 4 bytes are in flight per CTA;
  * consumer (wg 0): scores = q @ K^T and acc += p @ V on the tensor cores (wgmma,
    M = 64 rows of which the first G are real: decode is bound by HBM, not FLOPs),
    online softmax in float32 registers, then frees the slot.
Split-K: with few (token, head) pairs the context is cut into `num_splits`
page ranges; each CTA writes its normalized partial output and log-sum-exp, and one
kernel merges them (split_combine.py; XLA's `combine` with JAXLLM_DECODE_COMBINE=xla).
With one split the CTA writes the
final bf16 output directly. The split count follows the *real* tokens at run
time (a batch of 1 padded to 8 tokens splits 16 ways, not 2) over a flat grid of
one wave: CTAs past real tokens x heads x splits return at once.

fp8 pages (`kv_cache_dtype="fp8"` / `"fp8_e5m2"`, per-tensor scale 1.0, kernels/kv_quant.py):
the producer TMA-copies the fp8 pages as they are (half the bytes of bf16); the consumer
loads each [BK, D] tile into registers, converts it to float16 there and stores it into one
f16 staging tile per operand, which the wgmma reads (wgmma's B operand lives in shared
memory, and fp8 x bf16 has no wgmma form). The wgmmas of an fp8 cache run in f16, not bf16:
Hopper converts fp8 to f16 in one instruction per pair (`cvt.rn.f16x2.e4m3x2` / `e5m2x2`)
and has none to bf16 (Mosaic: "only cast from f8E4M3FN to f16 is supported"). Every
e4m3 / e5m2 value is exact in f16; the query is scaled by sm_scale * log2(e) in float32
before its f16 cast (so |q| up to ~5e5 fits f16's 65504), and the probabilities in [0, 1]
are cast to f16 (3 more mantissa bits than bf16).

int8 / int4 pages (kv_quant.py's page-major split layout: a page's [S, Dv] values, then its
scales, then int4's minimums) take the same f16 path: the producer copies each page's
values and the tail of bytes holding its scales into shared memory as stored, and the consumer
converts the integer tile in registers, multiplies each key row by its scale (int4: plus its
minimum) and stores it into the f16 staging tile (kernels/mosaic_kv_quant.py).

Every token is handled independently (its request from `token_req`, its key
range from `positions`), so the kernel is correct for any batch; it is only
*efficient* when each request has one new token (decode). With `queries_per_item` q > 1
(speculative verification: k + 1 tokens a request) a CTA takes an *item* of up to q
consecutive tokens of one request instead, their q x G query rows in its 64, each row
masked causally to its own token's position: the pages are read once per item, not once
per token (`items` cuts the batch; a request with more tokens takes several items).

This file plans the scratch buffers and the grid and launches the kernel; the body a CTA runs
is `decode_kernel` in mosaic_decode_kernel.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import kv_quant, mosaic_kv_quant, split_combine
from jaxllm.kernels.decode_schedule import active_splits, combine, default_config, items
from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.kernels.mosaic_decode_kernel import LOG2E, ROWS, decode_kernel


def q_fp8(q: jax.Array, sm_scale: float) -> jax.Array:
    """The query as the `qk_fp8` kernel multiplies it: scaled by sm_scale * log2(e) (the kernel's
    softmax is base 2) and rounded to e4m3."""
    return (q.astype(jnp.float32) * (sm_scale * LOG2E)).astype(jnp.float8_e4m3fn)


def combine_kernel() -> bool:
    """JAXLLM_DECODE_COMBINE: "kernel" (default) merges split partials in one kernel
    (`split_combine.py`), "xla" as XLA compiles `decode_schedule.combine` (three kernels)."""
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_DECODE_COMBINE", "kernel", ("kernel", "xla")) == "kernel"


def _interpret_params():
    """Mosaic GPU's CPU interpreter (simulated SMEM, TMA and barriers, race detection)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(detect_races=True)


def paged_decode_attention(q: jax.Array, kv_pages: jax.Array, layer: jax.Array,
                           md: AttentionMetadata, *, sm_scale: float,
                           num_splits: int | None = None, block_keys: int = 64,
                           num_stages: int | None = None, interpret: bool = False,
                           reduction_scratch_bytes: int | None = None,
                           return_partials: bool = False, num_sms: int = 132,
                           early_v_convert: bool = True, queries_per_item: int = 1,
                           deq_stages: int = 0, qk_fp8: bool = False) -> jax.Array:
    """Decode attention, q [T, H, D] -> [T, H, D]; same contract as ref.ragged_paged_attention.

    Without num_splits the grid has the splits one real token would want, and the
    count in use follows the real tokens at run time (`active_splits`).
    return_partials (benchmarks only): skip the split combine and return the kernel's outputs.
    early_v_convert (fp8 / int8 / int4 pages): convert the V tile while the QK wgmma runs
    instead of after the softmax (on an H200, fp8 pages, B 64 context 2048: 162 vs 169 us, both
    exact; docs/benchmarks.md).
    queries_per_item (speculative verification, `items`): a CTA takes up to this many consecutive
    tokens of one request, all their G query heads in its 64 rows, so a request's K/V pages are
    read once for its k + 1 verified tokens, not once per token.
    deq_stages (fp8 / int8 / int4 pages): 0, the consumer converts each tile itself, between its
    wgmmas; d > 0, the producer warpgroup converts them, num_stages - 1 steps behind its copies,
    into a d-deep ring of f16 staging tiles, so the conversion overlaps the consumer's wgmmas and
    softmax (as FlashAttention-3's producer transposes fp8 V). Model-dtype pages ignore it.
    qk_fp8 (e4m3 pages, one query a CTA, an experiment): the query, scaled by sm_scale * log2(e),
    is rounded to e4m3 here and the QK wgmma multiplies it with the K tile as copied (8-bit
    wgmma takes both operands K-major, which the K pages are): no K conversion, half the
    consumer's; V is converted as before. Rounding q costs accuracy (vLLM's FlashAttention-3
    path does the same for fp8 caches); `ref.ragged_paged_attention` on `q_fp8(q, sm_scale)`
    with sm_scale ln 2 (its exp is base e) is this kernel's reference on the same pages.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_pages, page_size, _ = kv_pages.shape
    group = num_heads // num_kv_heads
    width = kv_pages.shape[-1]
    fmt = kv_quant.page_format(kv_pages.dtype, width, head_dim)
    fp8 = fmt == "fp8"
    staged = fmt != "plain"  # converted into f16 staging tiles (fp8, int8, int4 pages)
    cdt = jnp.float16 if staged else q.dtype  # the wgmmas' operand dtype
    if fmt == "plain" and kv_pages.dtype != q.dtype:
        raise ValueError(f"mixed-dtype pages ({kv_pages.dtype}, q {q.dtype}) are not supported by "
                         f"the Mosaic decode kernel; use the Pallas kernel")
    if group > ROWS or page_size % 8 or head_dim % 64 or block_keys % page_size:
        raise ValueError(f"unsupported shape: G={group}, S={page_size}, D={head_dim}")
    if block_keys != 64:  # 32: wgmma wants K % 64 == 0; 128 failed the check (docs/kernels.md)
        raise ValueError(f"block_keys must be 64, got {block_keys}")
    ppb = max(1, block_keys // page_size)
    dst = deq_stages if staged else 0
    if dst < 0:
        raise ValueError(f"deq_stages must be >= 0, got {deq_stages}")
    ints = None
    if fmt in ("int8", "int4"):
        ints = mosaic_kv_quant.IntPages(fmt, page_size, width, head_dim, ppb)
        ints.check()
    qpi = queries_per_item
    if qpi < 1 or qpi * group > ROWS:
        raise ValueError(f"queries_per_item {qpi} x {group} query heads per KV head must fit the "
                         f"{ROWS} rows of a wgmma")
    out_dtype = q.dtype
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qk8 = bool(qk_fp8)
    if qk8:
        if kv_pages.dtype != jnp.float8_e4m3fn or qpi != 1 or dst:
            raise ValueError(f"qk_fp8 needs e4m3 pages (got {kv_pages.dtype}), queries_per_item 1 "
                             f"(got {qpi}) and deq_stages 0 (got {dst})")
        q4 = jnp.pad(q_fp8(q4, sm_scale), ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    positions, token_req, first, tok0 = md.positions, md.token_req, md.positions, md.positions
    if qpi > 1:
        it = items(md, qpi)
        positions, token_req, first, tok0 = it.last, it.req, it.first, it.tok0
    rows = qpi * group  # q rows of a CTA
    auto_splits, auto_stages = default_config(num_tokens, num_kv_heads, num_sms)
    if num_splits is None and num_tokens * num_kv_heads < num_sms:
        auto_splits, auto_stages = default_config(1, num_kv_heads, num_sms)  # for one real token
    splits, num_stages = num_splits or auto_splits, num_stages or auto_stages
    if num_splits is not None or splits == 1:  # as asked: every token (item), `splits` ways
        active = jnp.array([splits, num_tokens], jnp.int32)
        num_ctas = num_tokens * num_kv_heads * splits  # split: the flat grid, one CTA each
    else:
        active = active_splits(positions, num_kv_heads, splits, num_sms)
        num_ctas = num_sms  # one wave, mapped onto the real tokens (items)
    if qpi > 1:  # (splits, items, real tokens): the CTAs past the items write padding zeros
        active = jnp.stack([active[0], jnp.sum(positions >= 0).astype(jnp.int32),
                            jnp.sum(md.positions >= 0).astype(jnp.int32)])
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    keys = ppb * page_size
    if ints is None:
        flat_kv = kv_pages.reshape(-1, page_size, head_dim)  # page-major; a free reshape
        # fp8 tiles: 1-byte rows of D (<= 128 bytes swizzled per 8-row tile).
        row_bytes = min(head_dim, 128)
        kv_tiled = ((plgpu.TilingTransform((8, row_bytes)), plgpu.SwizzleTransform(row_bytes))
                    if fp8 else tiled)
        kv_bufs = (plgpu.SMEM((num_stages, keys, head_dim), kv_pages.dtype,
                              transforms=kv_tiled),) * 2
        meta_bufs, staging, copies = (None, None), tiled, ppb
    else:  # each page's bytes in 16-byte rows (split layout); values and meta buffers apart
        flat_kv = kv_pages.reshape(-1, page_size * width // 16, 16)
        (k_vals, k_meta), (v_vals, v_meta) = (ints.scratch(num_stages, interpret),
                                              ints.scratch(num_stages, interpret))
        kv_bufs, meta_bufs = (k_vals, v_vals), (k_meta, v_meta)
        staging, copies = ints.staging_transforms(), ppb * ints.copies_per_page
    o_buf = None  # one split: the output is staged in q's buffer, unless that holds e4m3 q
    if splits > 1:
        o_buf = plgpu.SMEM((ROWS, head_dim), jnp.float32)
    elif qk8:
        o_buf = plgpu.SMEM((ROWS, head_dim), out_dtype)
    scratch = (  # 16 KB + nst * BK * D * 4 bytes (+ 32 KB f32 partials when split)
        plgpu.SMEM((ROWS, head_dim), q4.dtype, transforms=kv_tiled if qk8 else ()),
        *kv_bufs,
        o_buf,
        plgpu.SMEM((ROWS,), jnp.float32) if splits > 1 else None,
        plgpu.Barrier(num_arrivals=qpi, num_barriers=1),  # q: one copy per token of an item
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        # fp8 / int pages: the dequantized f16 K and V tiles the wgmmas read (`page_tile`; a
        # ring of dst when the producer converts).
        # (qk8: no K tile to convert)
        *(plgpu.SMEM((dst, keys, head_dim) if dst else (keys, head_dim), cdt, transforms=staging)
          if staged and not (qk8 and which == 0) else None for which in (0, 1)),
        # f16 staging at D == BK: the scaled f16 q, read again every step (`reload_q`)
        plgpu.SMEM((ROWS, head_dim), cdt) if staged and head_dim == keys and not qk8 else None,
        *meta_bufs,  # int8 / int4 pages: the scale (and minimum) bytes
        # dst > 0: staged K / V tile d ready (producer -> consumer), staging slot d free (back)
        *((plgpu.Barrier(num_barriers=dst) if dst else None,) * 3),
    )
    if interpret:  # staging for wgmma's A operand, see `operand`
        scratch += (plgpu.SMEM((ROWS, head_dim), cdt),
                    plgpu.SMEM((ROWS, keys), cdt),
                    plgpu.SMEM((head_dim, keys), q4.dtype if qk8 else cdt))
    item = jnp.dtype(kv_pages.dtype).itemsize
    pages_smem = (num_stages * keys * head_dim * 2 * item if ints is None
                  else ints.smem_bytes(num_stages))
    smem = (ROWS * head_dim * (q4.dtype.itemsize + 2 * (qk8 and splits == 1)) + pages_smem
            + staged * (2 - qk8) * keys * head_dim * 2 * max(dst, 1)
            + (staged and head_dim == keys and not qk8) * ROWS * head_dim * 2
            + (splits > 1) * (ROWS * head_dim * 4 + ROWS * 4))
    # Mosaic reserves scratch for cross-warp reductions; the softmax only reduces along
    # rows (within a warp), so drop it when that lets two CTAs share an SM (<= 113 KB).
    if reduction_scratch_bytes is None and smem <= 112 * 1024 + 512:
        reduction_scratch_bytes = 0
    rsb = {} if reduction_scratch_bytes is None else dict(
        reduction_scratch_bytes=reduction_scratch_bytes)
    if splits > 1:
        out_type = (jax.ShapeDtypeStruct((splits, num_tokens, num_kv_heads, rows, head_dim),
                                         jnp.float32),
                    jax.ShapeDtypeStruct((splits, num_tokens, num_kv_heads, ROWS), jnp.float32))
    else:  # token layout (qpi > 1: each token's rows written on their own)
        out_type = (jax.ShapeDtypeStruct((num_tokens, num_kv_heads, group, head_dim), out_dtype),)
    body = functools.partial(
        decode_kernel, sm_scale=float(sm_scale), num_kv_heads=num_kv_heads,
        num_pages=num_pages, page_size=page_size, ppb=ppb, nst=num_stages, num_splits=splits,
        staged=staged, early_v=staged and early_v_convert, interpret=interpret, heads=group,
        qpi=qpi, ints=ints, dst=dst, qk8=qk8)
    grid = ((num_ctas,), ("w",)) if splits > 1 else ((num_tokens, num_kv_heads), ("t", "h"))
    outs = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch,
        grid=grid[0], grid_names=grid[1],
        num_threads=2, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **rsb),
        interpret=_interpret_params() if interpret else None,
    )(positions.astype(jnp.int32), token_req.astype(jnp.int32),
      md.block_tables.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), active,
      first.astype(jnp.int32), tok0.astype(jnp.int32), q4, flat_kv)
    if return_partials:
        return outs
    if splits == 1:
        return outs[0].reshape(num_tokens, num_heads, head_dim)
    if split_combine.fits(outs[0]) and combine_kernel():  # one kernel, not XLA's three
        out = split_combine.combine(outs[0], outs[1], active, out_dtype, interpret=interpret)
    else:
        valid = ((jnp.arange(splits)[:, None] < active[0])
                 & (jnp.arange(num_tokens) < active[1])[None, :])
        out = combine(outs[0], outs[1], rows, out_dtype, valid)
    if qpi == 1:
        return out
    # few items (the split grid): their merged rows back to the tokens, a small gather
    o5 = out.reshape(num_tokens, num_kv_heads, qpi, group, head_dim).transpose(0, 2, 1, 3, 4)
    got = o5[it.item_of, it.offset]  # [T, K, G, D]: each token's rows of its item
    got = jnp.where((md.positions >= 0)[:, None, None, None], got, 0)
    return got.reshape(num_tokens, num_heads, head_dim)
