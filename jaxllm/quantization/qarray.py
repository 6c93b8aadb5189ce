"""`QArray`: a quantized weight standing in for a float matrix w [..., K, N] in `x @ w`.

A registered pytree (its arrays are the leaves), so it rides in an nnx Param, through
`lax.scan` over stacked layers, `split_layers` (`qa[i]`) and jit like any weight. `x @ qa`
works because jax arrays defer `@` to an unknown right operand (`__rmatmul__`), so the
model code is unchanged. Layouts (the leading [...] are the stacked layer axes):

    kind "fp8"    values float8_e4m3fn [..., N, K]   scale [..., N, 1] per output channel,
                  or [..., N/bn, K/bk] blocks (HF FP8 `weight_scale_inv`, 128 x 128).
                  Per-channel: W8A8, activations quantized per token at run time (vLLM's
                  dynamic fp8); blocks: W8A16 (dequantized tile by tile in the matmul).
                  Stored [N, K] so the fp8 dot contracts both operands' last axis (no
                  transpose of W per call, which XLA's fp8 GEMM would otherwise do).
    kind "int8"   values int8 [..., K, N]            scale [..., K/g, N]  (g = K: per channel)
    kind "int4"   values uint8 [..., K/2, N]         scale, offset [..., K/g, N]: w = q * s + o
                  with q in [0, 16); in each group of g rows along K, byte j holds rows j (low
                  nibble) and j + g/2 (high) - GGUF Q4_0/Q4_1's own order, so those load as is
                  (`pack` sets a nibble group other than the scale group: Q4_K packs 64 rows
                  per 32-byte run and scales every 32).

The matmuls here are the plain-jnp path (CPU and the XLA GPU path); `kernels.py` picks
another implementation per mode from a measured table where one is faster.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0  # float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    values: jax.Array
    scale: jax.Array
    offset: jax.Array | None = None
    kind: str = dataclasses.field(default="int8", metadata=dict(static=True))
    act: str = dataclasses.field(default="none", metadata=dict(static=True))  # "fp8": W8A8
    pack: int = dataclasses.field(default=0, metadata=dict(static=True))  # int4 nibble group; 0: = group

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape [..., K, N]."""
        v = self.values.shape
        if self.kind == "fp8":
            return (*v[:-2], v[-1], v[-2])
        if self.kind == "int4":
            return (*v[:-2], 2 * v[-2], v[-1])
        return tuple(v)

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def group(self) -> int:
        """Rows of K per scale (int kinds)."""
        return self.shape[-2] // self.scale.shape[-2]

    def __getitem__(self, i) -> "QArray":
        """Index the leading (layer) axes of every part."""
        return jax.tree.map(lambda a: a[i], self)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        from jaxllm.quantization.kernels import matmul
        return matmul(x, self)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight [..., K, N] (tests and the jnp weight-only path)."""
        xp = np if isinstance(self.values, np.ndarray) else jnp
        if self.kind == "fp8":
            w = self.values.astype(np.float32)
            w = w * _expand(self.scale, w.shape, xp)
            return xp.swapaxes(w, -1, -2).astype(dtype)
        q = unpack_int4(self.values, self.pack or self.group, xp) if self.kind == "int4" else self.values
        w = q.astype(np.float32) * _expand(self.scale, q.shape, xp)
        if self.offset is not None:
            w = w + _expand(self.offset, q.shape, xp)
        return w.astype(dtype)


def _expand(s, shape, xp):
    """Broadcast a [..., A/a, B/b] block scale over [..., A, B] (blocks may overhang)."""
    a = -(-shape[-2] // s.shape[-2])
    b = -(-shape[-1] // s.shape[-1])
    s = xp.repeat(xp.repeat(s, a, axis=-2), b, axis=-1)
    return s[..., :shape[-2], :shape[-1]]


def unpack_int4(packed, group: int, xp=jnp):
    """uint8 [..., K/2, N] -> the nibbles as uint8 [..., K, N] (see the module docstring)."""
    *lead, half_k, n = packed.shape
    p = packed.reshape(*lead, half_k * 2 // group, group // 2, n)
    q = xp.concatenate([p & 15, p >> 4], axis=-2)  # [..., K/g, g, N]
    return q.reshape(*lead, 2 * half_k, n)


def pack_int4(q, group: int):
    """Nibbles uint8 [..., K, N] in [0, 16) -> uint8 [..., K/2, N]."""
    *lead, k, n = q.shape
    g = q.reshape(*lead, k // group, group, n).astype(np.uint8)
    packed = g[..., :group // 2, :] | (g[..., group // 2:, :] << 4)
    return packed.reshape(*lead, k // 2, n)


def stack(qs: list[QArray]) -> QArray:
    """Per-layer QArrays (numpy) -> one with a leading layer axis."""
    return jax.tree.map(lambda *a: np.stack(a), *qs)


def concat_out(qs: list) -> QArray | None:
    """int8 / int4 weight-only QArrays of one input (values [..., K(/2), N_i], scales and
    offsets [..., K/g, N_i]; the same kind, group and nibble order) as one of [..., K, sum N_i]:
    x @ it is the x @ each side by side (every output column keeps its own sum). None for any
    other weights. q/k/v or gate/up held so are one decode kernel launch and one pass of x's
    preparation instead of three or two (session 29: 8 int4 kernels a Llama layer apart)."""
    if not qs or not all(isinstance(q, QArray) and q.kind in ("int8", "int4") and q.act == "none" for q in qs):
        return None
    first = qs[0]
    same = lambda q: (q.kind, q.group, q.pack, q.offset is None, q.values.shape[:-1]) == (  # noqa: E731
        first.kind, first.group, first.pack, first.offset is None, first.values.shape[:-1])
    if not all(same(q) for q in qs):
        return None
    cat = lambda parts: jnp.concatenate(parts, axis=-1)  # noqa: E731
    return QArray(cat([q.values for q in qs]), cat([q.scale for q in qs]),
                  None if first.offset is None else cat([q.offset for q in qs]),
                  kind=first.kind, act=first.act, pack=first.pack)
