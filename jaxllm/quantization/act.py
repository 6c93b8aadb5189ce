"""Activations handed to fp8 W8A8 matmuls already quantized, by the op that makes them.

An fp8 W8A8 linear (`QArray` kind "fp8", act "fp8", one scale per output channel) quantizes its
input per token. When the model's RMSNorm (before q/k/v and gate/up) or silu(gate) * up
(before down) feeds only such linears, `norm` / `silu_mul` return that input as `Fp8Rows`
made in one kernel (`kernels/act_quant.py`), and each matmul takes it as it is: the
quantization is not repeated per consumer and x is not written in bf16 first. Anything else
gets the plain bf16 op, so bf16 models and the other modes are unchanged.

JAXLLM_ACT_QUANT: "kernel" (default) the fused Pallas kernel on a GPU, its jnp reference on
the CPU (the same ops the matmul's own quantization runs, so the tests take this path);
"xla" never fused (each matmul quantizes its bf16 input, as before).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.kernels import act_quant
from jaxllm.quantization.qarray import QArray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """x [..., K] quantized per row: x ~= values * scale. `dtype`: x's (the matmul's output).
    `rows` > 0: x is [rows, K] and values / scale hold more rows, zeros past `rows` (padded by
    the kernel that made them for the Mosaic fp8 decode matmul, which takes x padded)."""
    values: jax.Array  # float8_e4m3fn [..., K] (2-D [Mp, K] when rows)
    scale: jax.Array  # float32 [..., 1]
    dtype: jnp.dtype = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))
    rows: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, self.values.shape[-1]) if self.rows else self.values.shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def unpadded(self) -> "Fp8Rows":
        if not self.rows:
            return self
        return Fp8Rows(self.values[:self.rows], self.scale[:self.rows], self.dtype)

    def reshape(self, *shape: int) -> "Fp8Rows":
        if self.rows and tuple(shape) in ((-1, self.shape[-1]), self.shape):
            return self  # 2-D already
        x = self.unpadded()
        v = x.values.reshape(*shape)
        return Fp8Rows(v, x.scale.reshape(*v.shape[:-1], 1), self.dtype)

    def dequantize(self) -> jax.Array:
        x = self.unpadded()
        return (x.values.astype(jnp.float32) * x.scale).astype(self.dtype)

    def __matmul__(self, w) -> jax.Array:
        from jaxllm.quantization.kernels import matmul
        return matmul(self, w)


def takes_rows(w, x_shape: tuple[int, ...] | None = None) -> bool:
    """Whether matmul(x, w) quantizes x per token first: an fp8 W8A8 QArray, per channel, and
    (given x's shape) a path for these rows that takes x quantized (not, e.g., a weight-only
    decode kernel chosen by measurement: `kernels.takes_rows`). A list: each of them does."""
    if isinstance(w, (list, tuple)):
        return bool(w) and all(takes_rows(v, x_shape) for v in w)
    if not isinstance(w, QArray):
        return False
    from jaxllm.kernels.qmatmul_mosaic import takes
    from jaxllm.quantization.choice import two_d
    from jaxllm.quantization.kernels import path_for, takes_rows as path_takes_rows
    w2 = two_d(w)
    return takes(w2) and (x_shape is None or path_takes_rows(path_for(x_shape, w2), w2))


def fused() -> bool:
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_ACT_QUANT", "kernel", ("kernel", "xla")) == "kernel"


def padded_for(consumer, x_shape: tuple[int, ...]) -> int:
    """Rows the consumers take x padded to (0: as it is): every consumer's path for these rows
    is the Mosaic fp8 decode matmul, which pads x to a multiple of 8 rows (session 29's compiled
    fp8 Llama-3-8B batch-1 step: a pad kernel after each of the three fused quantizations a layer)."""
    from jaxllm.kernels.qmatmul_mosaic import padded_rows
    from jaxllm.quantization.choice import two_d
    from jaxllm.quantization.kernels import path_for
    ws = consumer if isinstance(consumer, (list, tuple)) else [consumer]
    if len(x_shape) != 2 or not all(path_for(x_shape, two_d(w)).startswith("mosaic/") for w in ws):
        return 0
    return padded_rows(x_shape[0]) if padded_rows(x_shape[0]) > x_shape[0] else 0


def _rows(fn_kernel, fn_ref, *args, width: int, out_dtype, out_rows: int = 0, **kw) -> Fp8Rows:
    """The kernel (a GPU, a row width it takes), else its reference, on args flattened to rows;
    `out_rows`: padded to that many rows (2-D x only)."""
    lead = args[0].shape[:-1]
    flat = [a.reshape(-1, a.shape[-1]) if a.ndim == len(lead) + 1 else a for a in args]
    fn = fn_ref if jax.default_backend() == "cpu" or act_quant.supported(width) else fn_kernel
    if out_rows:
        q, s = fn(*flat, out_rows=out_rows, **kw)
        return Fp8Rows(q, s, out_dtype, rows=lead[0])
    q, s = fn(*flat, **kw)
    return Fp8Rows(q.reshape(*lead, q.shape[-1]), s.reshape(*lead, 1), out_dtype)


def norm(x: jax.Array, w: jax.Array, eps: float, consumer=None) -> jax.Array | Fp8Rows:
    """rms_norm(x, w, eps); as Fp8Rows when `consumer` (the linear it feeds, or a list of
    them) takes them."""
    if not (fused() and takes_rows(consumer, x.shape)):
        return act_quant.rms_norm_ref(x, w, eps)
    return _rows(act_quant.norm_quant, act_quant.norm_quant_ref, x, w, width=x.shape[-1], out_dtype=x.dtype,
                 out_rows=padded_for(consumer, x.shape), eps=eps)


def silu_mul(gate: jax.Array, up: jax.Array | None = None, consumer=None) -> jax.Array | Fp8Rows:
    """silu(gate) * up (up None: gate [..., 2F] holds gate then up, as a fused gate/up matmul
    gives them); as Fp8Rows when `consumer` (the down projection) takes them."""
    width = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    if not (fused() and takes_rows(consumer, (*gate.shape[:-1], width))):
        return act_quant.silu_mul_ref(gate, up)
    args = (gate,) if up is None else (gate, up)
    return _rows(act_quant.silu_mul_quant, act_quant.silu_mul_quant_ref, *args, width=width, out_dtype=gate.dtype,
                 out_rows=padded_for(consumer, (*gate.shape[:-1], width)))


def fuse_int() -> bool:
    """Whether int8 / int4 weight-only q/k/v and gate/up are held fused in the unrolled layout
    (`qarray.concat_out`); JAXLLM_FUSE_INT=0 keeps them apart (as JAXLLM_FUSE_FP8 for fp8)."""
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_FUSE_INT", "1", ("0", "1")) == "1"


def fuse(ws: list) -> QArray | None:
    """fp8 W8A8 per-channel QArrays (values [..., N, K], scale [..., N, 1]) of one input as one,
    their outputs side by side (x @ fused = concat of x @ each): q/k/v, or gate/up, as the bf16
    layout fuses them. None for any other weights (they stay separate matmuls), or with
    JAXLLM_FUSE_FP8=0. Apart, two matmuls of one x through XLA's fp8 dot are merged by XLA into
    one whose weight is the two concatenated on every step: session 28's H100 decode step (batch
    1, Llama-3-8B shape) spent 2.55 ms of 7.53 in that concatenation of gate and up, where the
    warm-up's timing (each matmul alone) had XLA's path tied with the kernels."""
    from jaxllm.envs import env_choice
    if env_choice("JAXLLM_FUSE_FP8", "1", ("0", "1")) == "0" or not all(takes_rows(w) for w in ws):
        return None
    return QArray(jnp.concatenate([w.values for w in ws], -2), jnp.concatenate([w.scale for w in ws], -2),
                  kind="fp8", act="fp8")
