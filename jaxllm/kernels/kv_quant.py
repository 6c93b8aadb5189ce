"""Quantized KV pages: storage layouts, quantize on write, dequantize on read (in registers).

`kv_cache_dtype` (vLLM's names plus int8/int4) picks how one K or V row of D values is stored
in the page array `kv_pages [L, 2, K, P, S, W]`; W and the dtype alone tell a kernel the
format (`page_format`), so every backend keeps the one signature
`fn(q, kv_pages, layer, md, *, sm_scale)` and the page array stays a single array:
swap, copy-on-write, prefix caching, tensor parallelism (split on K) and the pool's byte
count carry the scales with the pages without knowing about them.

    auto       W = D, the model dtype
    fp8/_e4m3  W = D, float8_e4m3fn; fp8_e5m2: float8_e5m2. One scale per layer for K and
               one for V (per tensor, as vLLM): the model stores k / k_scale, clipped to the
               format's range and cast, and never hands the scales to a kernel: attention reads
               the pages as they are with q * k_scale and multiplies its output by v_scale
               (softmax(q . s k) = softmax((s q) . k); sum p s v = s sum p v), see
               `models/llama.py` `_attention`. The scales are the model's `kv_scale` param
               [L, 2] (data to the jitted step): 1.0 by default, read from a checkpoint's
               k_scale / v_scale tensors, or calibrated on the first batch
               (`calculate_kv_scales`: amax / fp8 max, `calibrated_scales`).
    int8       W = D + 2 bytes (uint8) a row: D int8 values and the row's scale as bfloat16
               bytes (little-endian). Symmetric, per token and KV head: s = amax / 127.
    int4       W = D / 2 + 4 bytes a row: byte d holds element d (low nibble) and d + D/2
               (high nibble), q in [0, 15]; the bfloat16 scale s = (max - min) / 15 and the
               bfloat16 minimum m, per token and KV head: x = q * s + m. Asymmetric because
               a symmetric per-row scale cost SmolLM2 57% perplexity, this one 16%
               (docs/benchmarks.md). Splitting halves (not neighbours) lets a kernel run
               two D/2-wide dots instead of interleaving nibbles. The rows hold K and V
               rotated along D (`rotation`), which brings that 16% to 4-7%.

Page-major split layout (int8 / int4). A page's S * W bytes are not S rows of W: they hold
the values of all S rows first, `[S, Dv]` row-major (Dv = D for int8, D / 2 for int4), then
the S bfloat16 scales (2S bytes), then for int4 the S bfloat16 minimums (2S bytes). Same
array shape and byte count as a row layout, so everything that moves whole pages is
unchanged; but the values of a page are one contiguous block and its scales another, each
a whole number of 16-byte units when S % 8 == 0, which is what a TMA copy needs (rows of
D + 2 or D/2 + 4 bytes are no TMA shape). `encode` / `decode` work on pages (the last two
axes [S, D] <-> [S, W]); `encode_rows` gives each new row's W bytes as a *record* (values,
then scale, then minimum) and `record_index` where each record byte lives in its page
(`ref.write_kv` scatters records there; the kernels read values at `off * Dv`). Each meta
field is stored *planar*: the S low bytes, then the S high bytes (the scale of slot `off`
is bytes `meta_offset(...) + off` and `+ S + off`), so a kernel reads a run of slots' low
(or high) bytes as one contiguous view (the Mosaic decode kernel's scale loads: a strided
`[keys, 2]` byte view did not lower under jax 0.11). Files that persist pages (the KV disk
store) key them with `LAYOUT_VERSION` (kv_transfer/factory.py `fingerprint`).

Rotated int4 rows. Keys have a few channels much larger than the rest, and a per-row range
set by them leaves 4 bits too coarse for the others. An orthonormal R [D, D] spreads every
channel over all of them (QuaRot's observation): the pages hold k R and v R, attention gets
q R (scores are unchanged: q R (k R)^T = q k^T) and its output is multiplied by R^T
(sum p v R = (sum p v) R). So the kernels never know, as for fp8's scales; the model does it
(`models/llama.py` `_attention`) in float32 around the kernel call.

The bfloat16 scale is read back with integer ops and one same-width bitcast
(`(b0 << 16 | b1 << 24)` viewed as float32), which every lowering (XLA, Triton) has.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.quantization.methods import check_kv_cache_dtype, check_fp8_device

SCALE_BYTES = 2  # a bfloat16 scale per row (int4 adds a bfloat16 minimum: 4 bytes)
META_BYTES = {"int8": 2, "int4": 4}
_FP8 = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def page_layout(kv_cache_dtype: str, model_dtype, head_dim: int) -> tuple[object, int]:
    """(page array dtype, row width W) for `kv_cache_dtype`."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype.startswith("fp8"):
        check_fp8_device(f"kv_cache_dtype={kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return model_dtype, head_dim
    if kv_cache_dtype in _FP8:
        return _FP8[kv_cache_dtype], head_dim
    if head_dim % 2:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs an even head_dim, got {head_dim}")
    width = head_dim if kv_cache_dtype == "int8" else head_dim // 2
    return jnp.uint8, width + META_BYTES[kv_cache_dtype]


def page_format(dtype, width: int, head_dim: int) -> str:
    """"plain", "fp8" (either float8 type), "int8" or "int4", from the page array alone."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
        return "fp8"
    if dtype == jnp.dtype(jnp.uint8):
        if width == head_dim + META_BYTES["int8"]:
            return "int8"
        if width == head_dim // 2 + META_BYTES["int4"]:
            return "int4"
    if width != head_dim:
        raise ValueError(f"page rows of {width} x {dtype} match no KV format for head_dim {head_dim}")
    return "plain"


def is_quantized(kv_pages: jax.Array, head_dim: int) -> bool:
    return page_format(kv_pages.dtype, kv_pages.shape[-1], head_dim) != "plain"


def bytes_per_token(kv_cache_dtype: str, model_dtype, head_dim: int) -> int:
    """Bytes of one K or V row of one KV head."""
    dtype, width = page_layout(kv_cache_dtype, model_dtype, head_dim)
    return width * jnp.dtype(dtype).itemsize


def _scale_bytes(s: jax.Array) -> jax.Array:
    """float32 scales [...] -> their bfloat16 bytes [..., 2] (uint8, little-endian)."""
    return lax.bitcast_convert_type(s.astype(jnp.bfloat16), jnp.uint8)


def scale_from_bytes(b0: jax.Array, b1: jax.Array) -> jax.Array:
    """The float32 value of bfloat16 bytes (b0 low, b1 high); integer ops + a same-width bitcast."""
    bits = (b0.astype(jnp.uint32) << 16) | (b1.astype(jnp.uint32) << 24)
    return lax.bitcast_convert_type(bits, jnp.float32)


# page-major split layout, planar meta bytes (above); split-1 interleaved each scale's bytes
LAYOUT_VERSION = {"int8": "split-2", "int4": "split-2"}


def value_bytes(fmt: str, width: int) -> int:
    """Dv: value bytes of one row of an int8 / int4 page (D or D / 2)."""
    return width - META_BYTES[fmt]


def meta_offset(fmt: str, page_size: int, width: int, field: int = 0) -> int:
    """Byte offset within a page of its [S] bfloat16 scales (field 0) or int4 minimums (1)."""
    return page_size * value_bytes(fmt, width) + field * SCALE_BYTES * page_size


@functools.lru_cache(maxsize=None)
def record_index(fmt: str, page_size: int, width: int) -> np.ndarray:
    """int32 [S, W]: where byte w of slot s's record (`encode_rows`) lives in its page's S * W
    bytes: values at s * Dv + w, then each meta field's bytes in that field's block, planar
    (byte b of slot s's field at `meta_offset + b * S + s`)."""
    dv = value_bytes(fmt, width)
    s = np.arange(page_size)[:, None]
    idx = [s * dv + np.arange(dv)[None, :]]
    for field in range(META_BYTES[fmt] // SCALE_BYTES):
        idx.append(meta_offset(fmt, page_size, width, field) + s
                   + page_size * np.arange(SCALE_BYTES)[None, :])
    return np.concatenate(idx, axis=1).astype(np.int32)


def encode_rows(x: jax.Array, dtype, width: int) -> jax.Array:
    """Rows x [..., D] (any float dtype) -> [..., W] of the page dtype: plain / fp8 rows as
    stored; int8 / int4 each row's *record* (values, scale, int4 minimum), which
    `record_index` places in its page."""
    head_dim = x.shape[-1]
    fmt = page_format(dtype, width, head_dim)
    if fmt == "plain":
        return x.astype(dtype)
    xf = x.astype(jnp.float32)
    if fmt == "fp8":
        top = float(jnp.finfo(dtype).max)
        return jnp.clip(xf, -top, top).astype(dtype)
    if fmt == "int8":
        amax = jnp.max(jnp.abs(xf), axis=-1)
        # Round the scale to bfloat16 first, so values are quantized by the scale that is stored.
        s = (jnp.maximum(amax, 1e-30) / 127.0).astype(jnp.bfloat16).astype(jnp.float32)
        q = jnp.clip(jnp.round(xf / s[..., None]), -127, 127).astype(jnp.int8)
        return jnp.concatenate([lax.bitcast_convert_type(q, jnp.uint8), _scale_bytes(s)], axis=-1)
    lo = jnp.min(xf, axis=-1).astype(jnp.bfloat16).astype(jnp.float32)
    s = (jnp.maximum(jnp.max(xf, axis=-1) - lo, 1e-30) / 15.0).astype(jnp.bfloat16).astype(jnp.float32)
    q = jnp.clip(jnp.round((xf - lo[..., None]) / s[..., None]), 0, 15).astype(jnp.uint8)
    half = head_dim // 2
    vals = q[..., :half] | (q[..., half:] << 4)
    return jnp.concatenate([vals, _scale_bytes(s), _scale_bytes(lo)], axis=-1)


def _split(records: jax.Array, fmt: str) -> jax.Array:
    """Records [..., S, W] -> the page layout [..., S, W] (a static permutation of each page)."""
    *lead, size, width = records.shape
    order = np.argsort(record_index(fmt, size, width).ravel())
    return records.reshape(*lead, size * width)[..., order].reshape(records.shape)


def _unsplit(pages: jax.Array, fmt: str) -> jax.Array:
    """Pages [..., S, W] -> their records [..., S, W] (the inverse of `_split`)."""
    *lead, size, width = pages.shape
    idx = record_index(fmt, size, width).ravel()
    return pages.reshape(*lead, size * width)[..., idx].reshape(pages.shape)


def encode(x: jax.Array, dtype, width: int) -> jax.Array:
    """Pages x [..., S, D] (any float dtype) -> stored pages [..., S, W] of the page format."""
    fmt = page_format(dtype, width, x.shape[-1])
    rows = encode_rows(x, dtype, width)
    return rows if fmt in ("plain", "fp8") else _split(rows, fmt)


def row_scale(rows: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array | None]:
    """(scale, minimum or None) float32 [...] of int records [..., W]."""
    n = rows.shape[-1] - META_BYTES[fmt]
    s = scale_from_bytes(rows[..., n], rows[..., n + 1])
    if fmt == "int8":
        return s, None
    return s, scale_from_bytes(rows[..., n + 2], rows[..., n + 3])


def unpack_values(vals: jax.Array, fmt: str) -> list[jax.Array]:
    """Integer values [..., Dv] (uint8) as float32 chunks along D (int8: [D]; int4: [D/2, D/2])."""
    if fmt == "int8":
        return [lax.bitcast_convert_type(vals, jnp.int8).astype(jnp.float32)]
    return [(vals & 15).astype(jnp.float32), (vals >> 4).astype(jnp.float32)]


def decode_rows(rows: jax.Array, head_dim: int, out_dtype=jnp.float32) -> jax.Array:
    """Records (or plain / fp8 rows) [..., W] -> values [..., D]."""
    fmt = page_format(rows.dtype, rows.shape[-1], head_dim)
    if fmt in ("plain", "fp8"):
        return rows.astype(out_dtype)
    vals = jnp.concatenate(unpack_values(rows[..., :value_bytes(fmt, rows.shape[-1])], fmt), axis=-1)
    s, m = row_scale(rows, fmt)
    out = vals * s[..., None]
    return (out if m is None else out + m[..., None]).astype(out_dtype)


def decode(pages: jax.Array, head_dim: int, out_dtype=jnp.float32) -> jax.Array:
    """Stored pages [..., S, W] -> values [..., S, D] (used on gathered pages, never the whole
    cache)."""
    fmt = page_format(pages.dtype, pages.shape[-1], head_dim)
    if fmt in ("plain", "fp8"):
        return pages.astype(out_dtype)
    return decode_rows(_unsplit(pages, fmt), head_dim, out_dtype)


ROTATED_FORMATS = ("int4",)  # page formats whose rows hold K and V rotated by `rotation`


@functools.lru_cache(maxsize=None)
def rotation(head_dim: int, seed: int = 0) -> np.ndarray:
    """A fixed orthonormal R [D, D] float32: a Hadamard matrix with random column signs (scaled by
    D^-1/2) when D is a power of two, else the Q of a random Gaussian matrix's QR. Fixed by the
    seed, so every engine that reads a page (swap, offload, transfer) rotates alike."""
    rng = np.random.default_rng(seed)
    if head_dim & (head_dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        return (h * rng.choice([-1.0, 1.0], head_dim) / np.sqrt(head_dim)).astype(np.float32)
    q, r = np.linalg.qr(rng.standard_normal((head_dim, head_dim)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def page_rotation(kv_pages: jax.Array, head_dim: int) -> np.ndarray | None:
    """`rotation(head_dim)` when the page array's rows are stored rotated, else None."""
    fmt = page_format(kv_pages.dtype, kv_pages.shape[-1], head_dim)
    return rotation(head_dim) if fmt in ROTATED_FORMATS else None


def rotate(x: jax.Array, r: np.ndarray, transpose: bool = False) -> jax.Array:
    """x [..., D] @ R (or R^T) in float32, back in x's dtype."""
    rr = jnp.asarray(r.T if transpose else r)
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), rr,
                      precision=lax.Precision.HIGHEST).astype(x.dtype)


KV_SCALE_FLOOR = 1e-6  # calibrated fp8 K/V scales never go below this (an all-zero layer)


def fp8_max(dtype) -> float:
    """The largest finite value of an fp8 page dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def calibrated_scales(scale: jax.Array, k: jax.Array, v: jax.Array, real: jax.Array,
                      dtype) -> jax.Array:
    """One layer's (k_scale, v_scale) [2] float32 under calibration (`calculate_kv_scales`).

    `scale` > 0 is already set and kept; 0 means not calibrated yet: amax over the real tokens
    (`real` [T]) of k / v [T, K, D], divided by the page dtype's fp8 max and at least
    KV_SCALE_FLOOR, when the step has a real token, else still 0 (padding-only steps).
    """
    def amax(x):
        return jnp.max(jnp.where(real[:, None, None], jnp.abs(x.astype(jnp.float32)), 0.0))

    new = jnp.maximum(jnp.stack([amax(k), amax(v)]) / fp8_max(dtype), KV_SCALE_FLOOR)
    return jnp.where(scale > 0, scale, jnp.where(jnp.any(real), new, 0.0)).astype(jnp.float32)


def unscale(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / scale in float32 (the value an fp8 page stores); a 0 scale (not calibrated) divides by 1."""
    return x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)
