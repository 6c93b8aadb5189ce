"""Quantized matmuls `x [..., K] @ QArray -> [..., N]`, one implementation per (mode, path).

Paths:
  xla   plain jnp: fp8 W8A8 as an fp8 x fp8 `dot_general` contracting both operands' last
        axis (XLA lowers it to cuBLASLt's fp8 GEMM on Hopper; on CPU the operands are
        upcast), weight-only modes as dequantize-then-dot (XLA fuses the convert for int8
        and fp8 blocks; int4's group dequant is not fused and writes a copy of W).
  mgpu  int8 weight-only through JAX's bundled Hopper mixed-type Mosaic GPU kernel
        (`hopper_mixed_type_matmul_mgpu`, int8 LHS x bf16 RHS: computed as (W^T x^T)^T).
  mosaic  fp8 W8A8 per channel, decode-sized steps (<= 64 rows), through jaxllm's Mosaic GPU
        kernel (`kernels/qmatmul_mosaic.py`): the weight streamed once by TMA into fp8 wgmmas
        with the rows of x on wgmma's narrow side; "mosaic/<tiling name>" names the tiling.
  mosaic_nk  int4 g128 / per-channel int8 / weight-only fp8 blocks, decode-sized steps, through
        jaxllm's Mosaic GPU weight-only kernel (`kernels/qmatmul_int_mosaic.py`) on the weight
        re-laid out [N, K] (`Int4NK` / `Int8NK`; fp8 keeps its values and gets per-row scales:
        `Fp8NK`), made once when the warm-up chooses it (`choice.relayout`).
  pallas  int8 / int4 weight-only, decode-sized steps (<= 64 rows), through jaxllm's own
        kernel (`kernels/qmatmul.py`, Triton): the stored integers are read once, converted in
        registers, and each scale group's scale applied to its partial product; larger steps
        and layouts it does not take go to "xla". "pallas/<tiling name>" names the tiling;
        plain "pallas" takes `pallas_tiling`'s.

On a GPU with one device the path of each decode-sized (layout, rows) is chosen by measurement
at warm-up (`choice.py`); anything else takes `TUNING`, the path per (mode, platform): "xla"
everywhere until the H200 run (scripts/gpu_quant.sh: `bench_quant.py matmul` times every path
side by side) says otherwise. The CPU always takes "xla" unless a path is asked for (tests).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxllm.kernels import qmatmul
from jaxllm.quantization.qarray import QArray

# (mode, platform) -> path; fill from scripts/gpu_quant.sh's matmul table.
TUNING: dict[tuple[str, str], str] = {
    ("fp8", "gpu"): "xla",
    ("fp8_block", "gpu"): "xla",
    ("int8", "gpu"): "xla",
    ("int4", "gpu"): "xla",
}


def mode_of(w: QArray) -> str:
    if w.kind == "fp8":
        return "fp8" if w.act == "fp8" else "fp8_block"
    return w.kind


def path_for(x_shape: tuple[int, ...], w) -> str:
    """The path `matmul(x, w)` takes for x of this shape (measured, else the tables)."""
    if jax.default_backend() != "cpu" or is_nk(w):  # (a re-laid-out weight: tests on the CPU)
        from jaxllm.quantization.choice import measured_path
        return measured_path(x_shape, w) or fp8_gemm_path(x_shape, w) or TUNING.get((mode_of(w), "gpu"), "xla")
    return "xla"


def takes_rows(path: str, w) -> bool:
    """Whether this path quantizes x per token itself first (fp8 W8A8 through XLA's fp8 GEMM,
    the Mosaic decode kernel or the ws GEMM), so it can take `act.Fp8Rows` instead."""
    return (path == "xla" or path.startswith(("mosaic/", FP8_GEMM_PATH))) and not is_nk(w) and \
        w.kind == "fp8" and w.act == "fp8"


def matmul(x: jax.Array, w: QArray, path: str | None = None) -> jax.Array:
    platform = jax.default_backend()
    path = path or path_for(x.shape, w)
    from jaxllm.quantization.act import Fp8Rows
    if isinstance(x, Fp8Rows) and not takes_rows(path, w):  # (act.norm / silu_mul ask path_for)
        x = x.dequantize()
    if path == "mgpu":
        return int8_mgpu(x, w)
    if path.startswith("mosaic/"):
        from jaxllm.kernels import qmatmul_mosaic as qm
        return qm.fp8_w8a8(x, w, qm.Tiling.parse(path.partition("/")[2]), interpret=platform == "cpu")
    if path.startswith(FP8_GEMM_PATH):
        from jaxllm.kernels import fp8_gemm_ws as fg
        return fg.fp8_w8a8(x, w, fg.BY_NAME[path.partition("/")[2]], interpret=platform == "cpu")
    if path.startswith(NK_PATH) or is_nk(w):
        return int_nk(x, w, path, interpret=platform == "cpu")
    if path.startswith("pallas"):
        name = path.partition("/")[2]
        tiling = qmatmul.BY_NAME[name] if name else pallas_tiling(x.shape, w)
        if tiling is not None and qmatmul.unsupported(x.shape, w, tiling) is None:
            return qmatmul.qmatmul(x, w, tiling)
    if w.kind == "fp8" and w.act == "fp8":
        return fp8_w8a8(x, w, upcast=platform == "cpu")
    return jnp.matmul(x, w.dequantize(x.dtype))


NK_PATH = "mosaic_nk/"  # the Mosaic int4 / int8 kernel on re-laid-out [N, K] weights
FP8_GEMM_PATH = "ws/"  # the warp-specialized fp8 W8A8 GEMM, prefill-sized steps (by measurement)


def fp8_gemm_path(x_shape: tuple[int, ...], w) -> str | None:
    """"ws/<tiling>" for a prefill-sized step (> 64 rows) of a 2-D fp8 W8A8 weight: the tiling
    JAXLLM_FP8_GEMM names, or (unset) the one the warm-up measured faster than XLA's fp8 GEMM
    for this layout at these rows (`choice.gemm_tiling`), where the tiling takes the shape;
    None otherwise (JAXLLM_FP8_GEMM=xla: never)."""
    from jaxllm.kernels import fp8_gemm_tiling
    from jaxllm.kernels.qmatmul_mosaic import MAX_ROWS as DECODE_ROWS

    name = fp8_gemm_tiling()
    rows = math.prod(x_shape[:-1])
    if name == "xla" or getattr(w, "kind", None) != "fp8" or w.act != "fp8" or w.values.ndim != 2 or rows <= DECODE_ROWS:
        return None
    if not name:
        from jaxllm.quantization.choice import gemm_tiling
        name = gemm_tiling(x_shape, w)
        if name is None:
            return None
    from jaxllm.kernels.fp8_gemm_ws import BY_NAME
    N, K = w.values.shape
    return FP8_GEMM_PATH + name if BY_NAME[name].unsupported(rows, K, N) is None else None


def is_nk(w) -> bool:
    from jaxllm.kernels.qmatmul_int_mosaic import Fp8NK, Int4NK, Int8NK
    return isinstance(w, (Int4NK, Int8NK, Fp8NK))


def int_nk(x: jax.Array, w, path: str, interpret: bool = False) -> jax.Array:
    """int4 / int8 through the Mosaic kernel ("mosaic_nk/<tiling>"; a QArray is re-laid out on
    the way, for checks), or x @ the dequantized weight for a re-laid-out weight at a row count
    the kernel was not chosen for (prefill-sized steps)."""
    from jaxllm.kernels import qmatmul_int_mosaic as qi
    if not is_nk(w):
        w = qi.to_nk(w)
    if path.startswith(NK_PATH):
        return qi.int_matmul(x, w, qi.Tiling.parse(path.partition("/")[2]), interpret=interpret)
    return jnp.matmul(x, w.dequantize(x.dtype))


def pallas_tiling(x_shape: tuple[int, ...], w: QArray, min_ctas: int = 256):
    """The first `qmatmul` tiling (in TILINGS order: fewest K splits) that fits and gives at
    least `min_ctas` CTAs (about two per H200 SM), else the fitting one with the most; None
    when none fits."""
    fits = [t for t in qmatmul.TILINGS if qmatmul.unsupported(x_shape, w, t) is None]
    if not fits:
        return None
    ctas = {t: w.shape[-1] // t.block_n * t.k_splits for t in fits}
    return next((t for t in fits if ctas[t] >= min_ctas), max(fits, key=ctas.get))


def quantize_rows_fp8(x) -> tuple[jax.Array, jax.Array]:
    """Per-token (row) dynamic fp8: (x_q float8_e4m3fn [..., K], scale float32 [..., 1]); an
    `act.Fp8Rows` (quantized by the op that made it) as it is."""
    from jaxllm.quantization.act import Fp8Rows
    if isinstance(x, Fp8Rows):
        x = x.unpadded()
        return x.values, x.scale
    from jaxllm.kernels.act_quant import quantize_ref
    return quantize_ref(x)


def fp8_w8a8(x: jax.Array, w: QArray, upcast: bool = False) -> jax.Array:
    """y = (x_q @ W_q^T) * s_x * s_w, W_q stored [N, K]: both operands contract their last axis."""
    xq, sx = quantize_rows_fp8(x)
    wq = w.values
    if upcast:  # CPU: no fp8 GEMM; the fp8 values are exact in float32
        xq, wq = xq.astype(jnp.float32), wq.astype(jnp.float32)
    y = jax.lax.dot_general(xq, wq, (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * sx * w.scale[..., 0]).astype(x.dtype)


def int8_mgpu(x: jax.Array, w: QArray, w_nk: jax.Array | None = None) -> jax.Array:
    """int8 per-channel W8A16 on Hopper via JAX's mixed-type Mosaic GPU matmul.

    The kernel takes the int8 operand on the left, so this computes (W^T x^T)^T; `w_nk`
    is W^T stored once ([N, K] int8). Without it W is transposed per call (XLA copies it),
    which is why the engine's table keeps "xla" until int8 is stored [N, K] for this path.
    """
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm

    if w.kind != "int8" or w.group != w.shape[-2]:
        raise ValueError(f"the mgpu path takes per-channel int8 weights, not {w.kind} g{w.group}")
    lead, k = x.shape[:-1], x.shape[-1]
    xt = x.reshape(-1, k).astype(jnp.bfloat16).T  # [K, T]
    t = xt.shape[1]
    tile_n = 64 if t <= 128 else 128
    pad = -t % (2 * tile_n)  # two consumer warpgroups split N (the tokens here)
    if pad:
        xt = jnp.pad(xt, ((0, 0), (0, pad)))
    cfg = mm.TuningConfig(tile_m=128, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                          epi_tile_n=64, epi_tile_m=64)
    a = w.values.T if w_nk is None else w_nk
    yt = mm.mixed_matmul_kernel(a, xt, out_dtype=jnp.bfloat16, config=cfg)  # [N, T]
    y = yt[:, :t].T.astype(jnp.float32) * w.scale[0]
    return y.reshape(*lead, -1).astype(x.dtype)
