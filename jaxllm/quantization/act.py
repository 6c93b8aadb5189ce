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
    """x [..., K] quantized per row: x ~= values * scale. `dtype`: x's (the matmul's output)."""
    values: jax.Array  # float8_e4m3fn [..., K]
    scale: jax.Array  # float32 [..., 1]
    dtype: jnp.dtype = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def reshape(self, *shape: int) -> "Fp8Rows":
        v = self.values.reshape(*shape)
        return Fp8Rows(v, self.scale.reshape(*v.shape[:-1], 1), self.dtype)

    def dequantize(self) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scale).astype(self.dtype)

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


def _rows(fn_kernel, fn_ref, *args, width: int, out_dtype, **kw) -> Fp8Rows:
    """The kernel (a GPU, a row width it takes), else its reference, on args flattened to rows."""
    lead = args[0].shape[:-1]
    flat = [a.reshape(-1, a.shape[-1]) if a.ndim == len(lead) + 1 else a for a in args]
    fn = fn_ref if jax.default_backend() == "cpu" or act_quant.supported(width) else fn_kernel
    q, s = fn(*flat, **kw)
    return Fp8Rows(q.reshape(*lead, q.shape[-1]), s.reshape(*lead, 1), out_dtype)


def norm(x: jax.Array, w: jax.Array, eps: float, consumer=None) -> jax.Array | Fp8Rows:
    """rms_norm(x, w, eps); as Fp8Rows when `consumer` (the linear it feeds, or a list of
    them) takes them."""
    if not (fused() and takes_rows(consumer, x.shape)):
        return act_quant.rms_norm_ref(x, w, eps)
    return _rows(act_quant.norm_quant, act_quant.norm_quant_ref, x, w, width=x.shape[-1], out_dtype=x.dtype, eps=eps)


def silu_mul(gate: jax.Array, up: jax.Array | None = None, consumer=None) -> jax.Array | Fp8Rows:
    """silu(gate) * up (up None: gate [..., 2F] holds gate then up, as a fused gate/up matmul
    gives them); as Fp8Rows when `consumer` (the down projection) takes them."""
    width = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    if not (fused() and takes_rows(consumer, (*gate.shape[:-1], width))):
        return act_quant.silu_mul_ref(gate, up)
    args = (gate,) if up is None else (gate, up)
    return _rows(act_quant.silu_mul_quant, act_quant.silu_mul_quant_ref, *args, width=width, out_dtype=gate.dtype)


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
