"""int8 / int4 KV pages in the Mosaic GPU decode kernel: copying a page's split bytes into
shared memory and dequantizing a [BK, D] tile into the kernel's f16 staging tile.

Pages are in kv_quant.py's page-major split layout: a page's S * W bytes hold its `[S, Dv]`
values (Dv = D for int8, D / 2 for int4), then S bfloat16 scales, then (int4) S bfloat16
minimums. The kernel sees the page array as `[pages, S * W / 16, 16]` bytes (a free reshape);
with S % 8 == 0 every page starts on a 16-byte boundary.

Producer (`copy_page`), asynchronous copies of `[rows, 16]` bytes (the pages are always in
bounds; a copy moves at most 256 rows under jax 0.11.2):
  * values: the page's first S * Dv bytes (at most 4,096) into the slot's `[BK, Dv]` buffer
    at page j's keys (the destination viewed as `[rows, 16]`), i.e. linear row-major bytes;
  * meta: Pallas' Mosaic GPU lowering wants every copy a multiple of 128 bytes (each thread
    of the warpgroup arrives with 1/128 of them), and a page's scale (and minimum) bytes are
    only 2S (4S), so the copy takes the last `window` = roundup(S * M, 128) bytes of the
    page (M = 2 int8, 4 int4): some value bytes, then the page's meta, into the slot's 1-D
    `[ppb * window]` buffer, `window` bytes a page.

Consumer (`dequant_tile`): the per-key scale (and minimum) as float32 `[BK]` in the layout
of the tile's rows (`WGMMA.reduce(1)`), the values loaded from linear shared memory in the
WGMMA layout, int8 -> float32 (bitcast u8 -> i8, exact) or int4 nibbles (`& 15`, `>> 4`),
`x * s` (+ m), cast to f16 and stored into the staging tile the wgmma reads (as for fp8
pages). int4 keeps elements d (low nibble) and d + D/2 (high) apart: the two halves go to
the staging tile's two column halves, each a whole tile column of its swizzle.

The scale of key k = j * S + s has its low byte at `j * window + (window - S * M) + s` and its
high byte S further (kv_quant's planar meta bytes): pages are `window` apart, so `[BK]` is not
one view. For each page j a contiguous `[BK]` byte view starting `j * S` bytes early puts page
j's low (or high) bytes at rows j * S .. j * S + S - 1 (every such view stays inside the
buffer); a select by `row // S` keeps each row's own. The views are 1-D and contiguous (the
first layout interleaved each scale's bytes and read a strided column of a `[BK, 2]` view;
under jax 0.11.2 the kernel failed in layout inference then, but the values' reshaped view,
fixed in `copy_page`, failed first, so that view was never tried alone).

The CPU interpreter has no rule for `plgpu.load` or ref reshapes, so there the buffers are
16-byte rows (`IntPages.scratch`) whose bytes are read as plain arrays and reshaped as values
(`interpret=True`); the byte offsets, the per-page views and the select are the same code on
both paths. The compiled path's buffer shapes and copies are covered by the cuda exports
(tests/test_mosaic_quant.py, also under jax 0.11.2: scripts/jax011_lowering.sh).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import kv_quant, mgpu_compat

_COPY_UNIT = 128  # bytes: Pallas' Mosaic GPU copies move a multiple of the warpgroup size
_IN_BOUNDS = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
# Rows of 16 bytes a copy moves along one dimension (jax 0.11.2's async copies). A page's values
# are one copy: an int8 page of 64 keys x 128 bytes (512 rows) would need two, and copied in
# two chunks the kernel's layout inference found no solution within its search budget (jax
# 0.11.2, exported for cuda on the CPU), so such pages stay with the Pallas kernel.
_MAX_COPY_ROWS = 256


@dataclasses.dataclass(frozen=True)
class IntPages:
    """The byte geometry of int8 / int4 pages (kv_quant.py's split layout) for the kernel."""
    fmt: str  # "int8" | "int4"
    page_size: int  # S
    width: int  # W, bytes a row
    head_dim: int  # D
    ppb: int  # pages a [BK] tile

    @property
    def dv(self) -> int:  # value bytes a row
        return kv_quant.value_bytes(self.fmt, self.width)

    @property
    def meta(self) -> int:  # scale (+ minimum) bytes a row
        return kv_quant.META_BYTES[self.fmt]

    @property
    def window(self) -> int:  # bytes of the meta copy of a page
        return -(-self.page_size * self.meta // _COPY_UNIT) * _COPY_UNIT

    @property
    def rows(self) -> int:  # 16-byte rows of a page
        return self.page_size * self.width // 16

    @property
    def keys(self) -> int:
        return self.ppb * self.page_size

    copies_per_page = 2  # the values, then the meta window

    def check(self) -> None:
        s = self.page_size
        if (s % 8 or (s * self.dv) % _COPY_UNIT or self.window > s * self.width
                or s * self.dv // 16 > _MAX_COPY_ROWS):
            raise ValueError(f"{self.fmt} pages of {s} rows x {self.width} bytes: no copy "
                             f"shape (needs S % 8 == 0, S * Dv % 128 == 0 and S * Dv <= 4096)")
        if kv_quant.meta_offset(self.fmt, s, self.width) + s * self.meta != s * self.width:
            raise AssertionError("the meta bytes must end the page")

    def scratch(self, num_stages: int, interpret: bool = False) -> tuple:
        """SMEM for one of K / V: values [nst, BK, Dv], meta [nst, ppb * window], each in the
        shape its loads read (no reshaped SMEM view: see `copy_page`). The CPU interpreter has
        no rule for ref reshapes: there the buffers are 16-byte rows ([nst, BK * Dv / 16, 16],
        [nst, ppb * window / 16, 16]) holding the same bytes, read as values and reshaped."""
        if interpret:
            return (plgpu.SMEM((num_stages, self.keys * self.dv // 16, 16), jnp.uint8),
                    plgpu.SMEM((num_stages, self.ppb * self.window // 16, 16), jnp.uint8))
        return (plgpu.SMEM((num_stages, self.keys, self.dv), jnp.uint8),
                plgpu.SMEM((num_stages, self.ppb * self.window), jnp.uint8))

    def smem_bytes(self, num_stages: int) -> int:
        return 2 * num_stages * (self.keys * self.dv + self.ppb * self.window)

    def staging_transforms(self) -> tuple:
        """Tiling and swizzle of the f16 staging tile: int4 writes its two D/2 halves separately,
        so a half must be whole tiles (D = 64: 32-column tiles, 64-byte swizzle)."""
        cols = min(64, self.head_dim // 2 if self.fmt == "int4" else self.head_dim)
        return plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(2 * cols)


# Int page formats the engine routes to the decode kernel, by measurement. On one H200 (jax
# 0.11.2, 2026-12-05, `python scripts/check_mosaic_quant.py --formats fp8,int8,int4`, batch 64,
# context 2,048, page 16, 32/8 heads x 128) both int formats were correct against the reference
# (rel err 0.0014 int8, 0.0012 int4); int4 pages took 0.58x the Pallas kernel's time on the same
# pages, int8 pages 1.21x (slower: int8 stays with the Pallas kernel). Sessions 20 and 21 failed
# to lower them (layout inference, the values' buffer read through a reshaped view; fixed in
# `copy_page`). Kernel tests name the formats they exercise.
KERNEL_FORMATS = ("int8", "int4")  # what the kernel reads (tests, scripts/check_mosaic_quant.py)
INT_FORMATS: tuple[str, ...] = ("int4",)
# ... at the head dims checked there: D = 64 (its int4 staging tiles are 32 columns, a path of
# its own) waits for scripts/check_decode_shapes.py's int rows on a GPU.
INT_HEAD_DIMS: tuple[int, ...] = (128,)


def block_pages(kv_pages: jax.Array, head_dim: int, block_keys: int = 64) -> IntPages | None:
    """The geometry of int8 / int4 pages for a kernel reading `block_keys`-key tiles (None: not
    int pages); ValueError naming the reason where its copies cannot move them (pages that do
    not divide the tile, `IntPages.check`)."""
    *_, page_size, width = kv_pages.shape
    fmt = kv_quant.page_format(kv_pages.dtype, width, head_dim)
    if fmt not in KERNEL_FORMATS:
        return None
    if block_keys % page_size:
        raise ValueError(f"{fmt} pages of {page_size} keys: the kernel copies whole pages into "
                         f"its {block_keys}-key tiles")
    g = IntPages(fmt, page_size, width, head_dim, block_keys // page_size)
    g.check()
    return g


def reads_pages(kv_pages: jax.Array, head_dim: int,
                formats: tuple[str, ...] | None = None) -> bool:
    """Whether the Mosaic decode kernel takes these int8 / int4 pages (kernels/__init__.py): a
    routed format (`formats`; default INT_FORMATS at INT_HEAD_DIMS) in a shape its copies can
    move (`block_pages`)."""
    fmt = kv_quant.page_format(kv_pages.dtype, kv_pages.shape[-1], head_dim)
    if formats is None and head_dim not in INT_HEAD_DIMS:
        return False
    if fmt not in (INT_FORMATS if formats is None else formats):
        return False
    try:
        return block_pages(kv_pages, head_dim) is not None
    except ValueError:
        return False


def copy_page(g: IntPages, src, page, vals, meta, j: int, barrier, interpret: bool = False) -> None:
    """Page `page` of `src` [pages, S * W / 16, 16] (bytes) into page slot j of a stage's `vals`
    [BK, Dv] and `meta` [ppb * window] buffers (two copies: the barrier's arrivals). The buffers
    have the shapes their loads read; only the copies' destinations are reshaped views. Loads
    from a reshaped view (a [BK * Dv / 16, 16] buffer read as [BK, Dv]) gave the buffer an empty
    tiling constraint, on which Mosaic's layout inference fails under jax 0.11.2
    (`_conjure_transforms_for_smem_ref`: IndexError; reproduced on the CPU by exporting for cuda
    under jax 0.11.2); global-memory refs take no reshape in a copy there. The interpreter's
    buffers are 16-byte rows (`IntPages.scratch`): the same bytes at the same offsets."""
    s, n, m = g.page_size, g.page_size * g.dv // 16, g.window // 16
    if interpret:
        vals_dst, meta_dst = vals.at[pl.ds(j * n, n)], meta.at[pl.ds(j * m, m)]
    else:
        vals_dst = vals.at[pl.ds(j * s, s)].reshape(n, 16)
        meta_dst = meta.at[pl.ds(j * g.window, g.window)].reshape(m, 16)
    plgpu.copy_gmem_to_smem(src.at[page, pl.ds(0, n)], vals_dst, barrier, oob_mode=_IN_BOUNDS)
    plgpu.copy_gmem_to_smem(src.at[page, pl.ds(g.rows - m, m)], meta_dst, barrier,
                            oob_mode=_IN_BOUNDS)


def _row_meta(g: IntPages, meta, field: int, interpret: bool) -> jax.Array:
    """float32 [BK]: field 0 (scale) or 1 (int4 minimum) of each key of the stage's `meta`."""
    s, keys = g.page_size, g.keys
    first = g.window - s * g.meta + 2 * field * s  # the field's first byte in a page's window
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def run(start: int) -> jax.Array:
        """Bytes start .. start + BK - 1 of the stage's meta buffer (u8 [BK])."""
        if interpret:
            return meta[...].reshape(-1)[start:start + keys]
        return mgpu_compat.load(meta.at[pl.ds(start, keys)], layout=row_layout, optimized=False)

    row = lax.broadcasted_iota(jnp.int32, (keys,), 0)
    if not interpret:
        row = plgpu.layout_cast(row, row_layout)
    out = None
    for j in range(g.ppb):  # page j's field lands on rows j * S .. j * S + S - 1 of this view
        start = j * (g.window - s) + first  # low bytes; the high bytes S further
        v = kv_quant.scale_from_bytes(run(start), run(start + s))
        out = v if out is None else jnp.where(row // s == j, v, out)
    return out


def dequant_tile(g: IntPages, vals, meta, deq, interpret: bool) -> None:
    """The stage's [BK, D] tile (`vals`, `meta`: one stage's buffers), dequantized in registers
    and stored as f16 into the staging tile `deq` [BK, D]."""
    keys, dv = g.keys, g.dv
    if interpret:
        raw = vals[...].reshape(keys, dv)
    else:
        raw = mgpu_compat.load(vals, layout=plgpu.Layout.WGMMA, optimized=False)
    scale = _row_meta(g, meta, 0, interpret)

    def rows(x):  # [BK] -> [BK, Dv] along the tile's rows
        return lax.broadcast_in_dim(x, (keys, dv), [0])

    if g.fmt == "int8":
        x = lax.bitcast_convert_type(raw, jnp.int8).astype(jnp.float32)
        deq[...] = (x * rows(scale)).astype(deq.dtype)
        return
    lo = rows(_row_meta(g, meta, 1, interpret))  # int4: x = q * s + min
    s = rows(scale)
    wide = raw.astype(jnp.int32)  # Mosaic shifts no 8-bit registers
    deq[:, pl.ds(0, dv)] = ((wide & 15).astype(jnp.float32) * s + lo).astype(deq.dtype)
    deq[:, pl.ds(dv, dv)] = ((wide >> 4).astype(jnp.float32) * s + lo).astype(deq.dtype)
