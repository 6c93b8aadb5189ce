"""Quantize a float model's linear weights at load (vLLM's online quantization).

`quantize_state` runs on the model's placed, stacked float weights (`[L, K, N]`, from a
checkpoint or random), one jitted call per linear; the quantizers take any leading axes
and numpy or jnp. Each decoder linear (q/k/v/o, gate/up/down) becomes a `QArray`;
embeddings, norms and the LM head stay float (as vLLM's fp8 method leaves them).

    fp8   W8A8 dynamic (vLLM's `--quantization fp8`): per output channel s = amax / 448,
          activations quantized per token at run time.
    int8  W8A16 per output channel, symmetric: s = amax / 127.
    int4  W4A16 asymmetric groups along K: s = (max - min) / 15, offset = min; group 128,
          or the largest of 64 / 32 dividing K where 128 does not (SmolLM2: K = 576 -> 64).
"""

from __future__ import annotations

import re

import numpy as np
import ml_dtypes

from jaxllm.quantization.qarray import FP8_MAX, QArray, pack_int4

LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def is_linear(name: str) -> bool:
    return LINEAR_RE.match(name) is not None


def int4_group(k: int, want: int = 128) -> int:
    for g in (want, 64, 32):
        if k % g == 0:
            return g
    raise ValueError(f"int4 weights need K divisible by 32, got K={k}")


def quantize_fp8(w, xp=np) -> QArray:
    """Float [..., K, N] -> per-output-channel fp8, stored [..., N, K] (W8A8 dynamic)."""
    w = xp.asarray(w).astype(np.float32)
    s = xp.maximum(xp.abs(w).max(axis=-2, keepdims=True), 1e-12) / FP8_MAX  # [..., 1, N]
    q = xp.clip(w / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return QArray(xp.swapaxes(q, -1, -2), xp.swapaxes(s, -1, -2), None, kind="fp8", act="fp8")


def quantize_int8(w, xp=np) -> QArray:
    """Float [..., K, N] -> int8 [..., K, N], symmetric per output channel."""
    w = xp.asarray(w).astype(np.float32)
    s = xp.maximum(xp.abs(w).max(axis=-2, keepdims=True), 1e-12) / 127.0  # [..., 1, N]
    q = xp.clip(xp.round(w / s), -127, 127).astype(np.int8)
    return QArray(q, s, None, kind="int8")


def quantize_int4(w, xp=np, group: int | None = None) -> QArray:
    """Float [..., K, N] -> packed int4 [..., K/2, N], asymmetric per group of K rows."""
    w = xp.asarray(w).astype(np.float32)
    *lead, k, n = w.shape
    g = group or int4_group(k)
    blocks = w.reshape(*lead, k // g, g, n)
    lo, hi = blocks.min(axis=-2), blocks.max(axis=-2)  # [..., K/g, N]
    # float16 scale / offset (half the bytes of float32); quantize by the stored values.
    s = xp.maximum((hi - lo) / 15.0, 1e-8).astype(np.float16)
    o = lo.astype(np.float16)
    sf, of = s.astype(np.float32)[..., None, :], o.astype(np.float32)[..., None, :]
    q = xp.clip(xp.round((blocks - of) / sf), 0, 15).astype(np.uint8).reshape(*lead, k, n)
    return QArray(pack_int4(q, g), s, o, kind="int4")


QUANTIZERS = {"fp8": quantize_fp8, "int8": quantize_int8, "int4": quantize_int4}


LINEAR_PARAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # llama.LayerStack


def quantize_state(params, method: str):
    """Quantize the stacked float linears of a model's nnx state in place, on its device(s).

    Used for every online mode (checkpoint or random weights alike); linears that already
    are QArrays (pre-quantized checkpoints) are left as they are.
    """
    import jax
    import jax.numpy as jnp

    from jaxllm.models.llama import value

    fn = jax.jit(lambda w: QUANTIZERS[method](w, jnp))
    layers = params["layers"]
    for name in LINEAR_PARAMS:
        if name not in layers or isinstance(value(layers[name]), QArray):
            continue
        var = layers[name]
        q = fn(value(var))
        if hasattr(var, "set_value"):
            var.set_value(q)
        else:  # flax < 0.12
            var.value = q
    return params
