"""Hopper ragged paged prefill/mixed attention on Mosaic GPU (`plgpu.kernel`), FA3-style.

Same contract as `ref.ragged_paged_attention`: q [T, H, D] ragged over requests (prefill
chunks continuing a cached prefix and decode rows in one batch), keys/values read from the
pool `kv_pages [L, 2, K, P, S, D]` that `ref.write_kv` has just updated in place, output
[T, H, D] with padding tokens 0. The block schedule is `prefill_schedule`'s (shared with the
portable twin `pallas_prefill.py`, which the CPU tests check in interpret mode).

Grid (block, kv head), blocks fastest, so the CTAs of one wave stream the same head's keys
through L2; blocks come heaviest first. A CTA owns 128 rows = bq = 128 / G tokens x the G
query heads of one kv head (row g * bq + i), so every K/V tile serves all G heads (GQA).
Three warpgroups:
  * producer (wg 2, 40 registers): reads the page ids of key step s from the block table
    and TMA-copies the step's pages of K and of V (each page of one head is a contiguous
    [S, D] tile) into an `nst`-deep ring of swizzled [BK, D] tiles, one mbarrier per stage
    and operand; it refills a stage once both consumers have released it;
  * two consumers (wg 0 / 1, 232 registers, 64 rows each): s = q @ K^T and acc += p @ V on
    wgmma (q from SMEM, p from registers), online softmax in float32 in the log2 domain
    (sm_scale * log2 e folded into one FMA), FA3's ping-pong: a shared barrier orders the
    two warpgroups so one's softmax overlaps the other's matmuls. Key steps [0, n_full)
    lie below every row's position and skip the mask; the last ones are masked causally.
Epilogue: the bf16 rows are staged in q's swizzled buffer. A full block (count == bq) stores
one TMA box per head straight into the output; a partial block (its segment is shorter than
bq: decode rows, short chunks; one per such segment) stores its whole tile into a side
buffer [R + 1, K, 128, D] at its segment, and the wrapper scatters the valid rows of those
into the output (a few rows per request), so no row of a neighbouring request is touched.

fp8 pages (`kv_cache_dtype="fp8"` / `"fp8_e5m2"`; scale 1.0: the model applies the scales
around the kernel, kv_quant.py), read as `mosaic_decode.py` reads them: the producer TMA-copies
the pages as they are (1-byte rows: tiles of (8, min(D, 128)) swizzled by that many bytes); each
consumer converts the tiles in registers into its own f16 K and V tiles in SMEM (`page_tile`;
no dequantized cache in HBM), V(s) between its two halves of the QK(s) ping-pong sync (beside
the other's softmax), K(s + 1) while its PV(s) wgmma runs. The wgmmas run in f16: Hopper has
fp8 -> f16 conversions only, and every e4m3 / e5m2 value is exact in f16. The wrapper hands
the kernel q * sm_scale * log2(e) as f16 (the softmax skips its scale) and casts the f16 output
back. Default block at D = 128: 64 keys (128 KB of SMEM; 128 keys, 224 KB, ran too: 1.91 vs
1.98 ms at 1x8192, 0.40 vs 0.33 at 1x2048); D = 256 does not fit. H200, jax 0.11.2, H 32 K 8
D 128: 1.98 ms at 1x8192 (bf16 pages 1.23, Pallas on fp8 3.67), rel err 1.2-1.6e-3 against ref
on the same pages.

int8 / int4 pages (kv_quant.py's split layout: a page's values, then its per-token scales and
int4 minimums) are read as the decode kernel reads them (mosaic_kv_quant.py): the producer
copies each page's value bytes and its scale bytes (two copies a page, 64-key blocks), each
consumer dequantizes the tiles in registers into its f16 K and V tiles (`page_tile`) at the
fp8 path's places, and q comes pre-scaled in f16 as for fp8. q's buffer takes the K tiles'
swizzle (QK's wgmma wants both operands alike: int4 at D = 64 has 32-column tiles). Checked in
the CPU interpreter against the reference and lowered for cuda (jax 0.10 and 0.11.2); the engine
routes them here only once a GPU has checked them (`INT_FORMATS`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import kv_quant, mosaic_kv_quant
from jaxllm.kernels import prefill_schedule as ps
from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.kernels.mosaic_prefill_kernel import LOG2E, ROWS, WG_ROWS, prefill_kernel
from jaxllm.kernels.prefill_schedule import aligned_layout

# Lane semantics, named: jax 0.11 changed plgpu.CompilerParams' default to Warpgroup, under which
# this kernel fails to lower (layout inference fails on jax 0.10.2; most likely also the bare
# AssertionError seen on jax 0.11.2 on the H200), while it lowers under Lane, 0.10.2's default.
SEMANTICS = plgpu.LoweringSemantics.Lane
FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def supported(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
              block_keys: int = 128, fp8: bool = False) -> bool:
    group = num_heads // num_kv_heads
    return (num_heads % num_kv_heads == 0 and group & (group - 1) == 0 and group <= 16
            and head_dim % 64 == 0 and head_dim <= (128 if fp8 else 256) and page_size % 8 == 0
            and (block_keys % page_size == 0 or page_size % block_keys == 0))


def default_block_keys(head_dim: int, fp8: bool, fmt: str = "") -> int:
    """Keys per step: 128; fp8 pages at D > 64: 64 (the f16 tiles' SMEM, module docstring);
    int8 / int4 pages (`fmt`): 64, the decode kernel's tile (`mosaic_kv_quant.IntPages`)."""
    return 64 if (fp8 and head_dim > 64) or fmt in mosaic_kv_quant.KERNEL_FORMATS else 128


# Int page formats the engine routes to this kernel (it reads mosaic_kv_quant.KERNEL_FORMATS:
# interpreter-checked against the reference, lowered for cuda under jax 0.10 and 0.11.2): none
# until scripts/check_prefill.py --kv-cache-dtype int8 int4 has checked them on a GPU.
INT_FORMATS: tuple[str, ...] = ()


def int_pages(kv_pages: jax.Array, head_dim: int, block_keys: int | None = None
              ) -> mosaic_kv_quant.IntPages | None:
    """The int8 / int4 geometry of these pages for this kernel (None: not int pages); raises
    ValueError naming the reason where the kernel cannot read them."""
    fmt = kv_quant.page_format(kv_pages.dtype, kv_pages.shape[-1], head_dim)
    try:
        return mosaic_kv_quant.block_pages(
            kv_pages, head_dim, block_keys or default_block_keys(head_dim, True, fmt))
    except ValueError as e:
        raise ValueError(f"{e}; use the Pallas kernel") from None


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(detect_races=True)


def ragged_prefill_attention(q: jax.Array, kv_pages: jax.Array, layer: jax.Array,
                             md: AttentionMetadata, *, sm_scale: float,
                             block_keys: int | None = None, num_stages: int = 2,
                             interpret: bool = False, semantics: str | None = None) -> jax.Array:
    """Ragged paged attention for prefill/mixed batches, q [T, H, D] -> [T, H, D].

    The kernel runs on `aligned_layout`'s relabeled batch (a gather of q and one of the
    output around it), so one kernel serves every batch: a `lax.cond` between it and a direct
    call for already aligned batches put two kernels in each layer (every call site of a Mosaic
    kernel compiles on its own: about 1.4 s each on an H200 host, `scripts/mosaic_compile_time.py`)
    and made each layer read its predicate back to the host.
    Pages in q's dtype, fp8, int8 or int4 (module docstring); block_keys None:
    `default_block_keys`."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, _, page_size, width = kv_pages.shape
    try:
        fmt = kv_quant.page_format(kv_pages.dtype, width, head_dim)
    except ValueError:
        fmt = "unknown"
    fp8 = fmt != "plain"  # pages converted into f16 tiles: fp8, int8, int4
    if (fmt == "plain" and kv_pages.dtype != q.dtype) or fmt == "unknown":
        raise ValueError(f"{kv_pages.dtype} pages, rows of {width}: the Mosaic prefill kernel "
                         f"reads {q.dtype}, fp8, int8 and int4 pages; use the Pallas kernel")
    block_keys = block_keys or default_block_keys(head_dim, fp8, fmt)
    int_pages(kv_pages, head_dim, block_keys)  # raises where int pages do not fit the copies
    if not supported(num_heads, num_kv_heads, head_dim, page_size, block_keys, fp8):
        raise ValueError(f"unsupported shape: H={num_heads} K={num_kv_heads} D={head_dim} "
                         f"S={page_size} BK={block_keys}" + (f" ({fmt} pages)" if fp8 else ""))
    qsl = md.query_start_loc.astype(jnp.int32)
    new_qsl, new_pos, dest, src, _ = aligned_layout(qsl, md.positions, num_tokens)
    q_pad = q.at[src].get(mode="promise_in_bounds", indices_are_sorted=True)
    if fp8:  # f16 wgmma operands; the score scale moves into q (fused into the gather)
        q_pad = (q_pad.astype(jnp.float32) * (sm_scale * LOG2E)).astype(jnp.float16)
    out = _attend(q_pad, new_qsl, new_pos, kv_pages=kv_pages, layer=layer, md=md, sm_scale=sm_scale,
                  block_keys=block_keys, num_stages=num_stages, interpret=interpret, semantics=semantics)
    out = out.at[dest].get(mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True)
    return out.astype(q.dtype) if fp8 else out


def _attend(q: jax.Array, qsl: jax.Array, positions: jax.Array, *, kv_pages: jax.Array,
            layer: jax.Array, md: AttentionMetadata, sm_scale: float, block_keys: int,
            num_stages: int, interpret: bool, semantics: str | None) -> jax.Array:
    """The kernel on a batch whose segments start at multiples of 8 (`qsl`, `positions`
    replace md's); q [T, H, D] -> [T, H, D] (fp8 / int pages: q f16, pre-scaled, see the
    wrapper)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, num_pages, page_size, width = kv_pages.shape
    ints = int_pages(kv_pages, head_dim, block_keys)
    group = num_heads // num_kv_heads
    bq, bk = ROWS // group, block_keys
    # the block window needs T >= bq; TMA on the [T, K, G, D] view needs T % 8 == 0
    pad = max(bq, -(-num_tokens // 8) * 8) - num_tokens
    if pad:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        positions = jnp.pad(positions, (0, pad), constant_values=-1)
    total = num_tokens + pad
    sched = ps.prefill_schedule(qsl, positions, total, bq)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    fp8 = kv_pages.dtype in FP8 or ints is not None  # f16 tiles converted in registers
    if ints is None:
        copies_per_step = max(1, bk // page_size)
        rb = min(head_dim, 128)  # fp8 tiles: 1-byte rows of D, <= 128 bytes swizzled
        kv_tiled = (plgpu.TilingTransform((8, rb)), plgpu.SwizzleTransform(rb)) if fp8 else tiled
        kv_bufs = [plgpu.SMEM((num_stages, bk, head_dim), kv_pages.dtype, transforms=kv_tiled)] * 2
        meta_bufs, staging = [], tiled
        flat_kv = kv_pages.reshape(-1, page_size, head_dim)
    else:  # each page's bytes in 16-byte rows (split layout); values and meta buffers apart
        copies_per_step = ints.ppb * ints.copies_per_page
        (k_vals, k_meta), (v_vals, v_meta) = (ints.scratch(num_stages, interpret),
                                              ints.scratch(num_stages, interpret))
        kv_bufs, meta_bufs, staging = [k_vals, v_vals], [k_meta, v_meta], ints.staging_transforms()
        flat_kv = kv_pages.reshape(-1, page_size * width // 16, 16)
    scratch = [  # q (and the output's staging) in the K tiles' swizzle: QK's wgmma wants both
        # operands alike (int4 at D = 64: 32-column tiles, 64-byte swizzle)
        plgpu.SMEM((2, WG_ROWS, head_dim), q.dtype, transforms=staging),
        *kv_bufs,
        plgpu.Barrier(num_arrivals=WG_ROWS // min(bq, WG_ROWS), num_barriers=2),
        plgpu.Barrier(num_arrivals=copies_per_step, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=copies_per_step, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=2),
    ]
    if fp8:  # each consumer's f16 K and V tiles (`page_tile`)
        scratch += [plgpu.SMEM((2, bk, head_dim), q.dtype, transforms=staging) for _ in range(2)]
    scratch += meta_bufs  # int pages: the scale (and minimum) bytes
    if interpret:  # wgmma operand staging (see the kernel)
        scratch += [plgpu.SMEM((head_dim, bk), q.dtype), plgpu.SMEM((WG_ROWS, bk), q.dtype)]
    body = functools.partial(
        prefill_kernel, sm_scale=float(sm_scale), bq=bq, bk=bk, page_size=page_size,
        num_kv_heads=num_kv_heads, num_pages=num_pages, nst=num_stages, fp8=fp8,
        interpret=interpret, ints=ints)
    num_reqs = qsl.shape[0] - 1
    out, side = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((total, num_kv_heads, group, head_dim), q.dtype),
                  jax.ShapeDtypeStruct((num_reqs + 1, num_kv_heads, ROWS, head_dim), q.dtype)),
        scratch_types=tuple(scratch),
        grid=(sched.shape[1], num_kv_heads), grid_names=("b", "h"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=getattr(plgpu.LoweringSemantics, semantics)
            if semantics else SEMANTICS),
        interpret=_interpret_params() if interpret else None,
    )(sched, md.block_tables.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
      q.reshape(total, num_kv_heads, group, head_dim),
      flat_kv)
    # rows of the partial blocks: side [R + 1, K, G * bq, D] -> their tokens
    rows = ps.short_segment_rows(qsl, total, bq)  # [R + 1, bq]
    side = side.reshape(num_reqs + 1, num_kv_heads, group, bq, head_dim).transpose(0, 3, 1, 2, 4)
    out = out.at[rows].set(side, mode="drop")
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim)
