"""Quantize a float model's linear weights at load (vLLM's online quantization).

`quantize_state` runs on the model's placed, stacked float weights (`[L, K, N]`, from a
checkpoint or random), one jitted call per linear; the quantizers take any leading axes
and numpy or jnp. Each decoder linear (q/k/v/o, gate/up/down) becomes a `QArray`;
embeddings, norms and the LM head stay float (as vLLM's fp8 method leaves them).

    fp8   W8A8 dynamic (vLLM's `--quantization fp8`): per output channel, activations
          quantized per token at run time. The scale is searched: e4m3's grid repeats every
          octave, so of s = a * amax / 448 for FP8_SEARCH values of a in [1, 2) the one with
          the least squared error per channel is kept (amax / 448 alone: 18% more weight
          error and KL on SmolLM2; docs/benchmarks.md).
    int8  W8A16 per output channel, symmetric: s = amax / 127.
    int4  W4A16 asymmetric groups along K: s = (hi - lo) / 15, offset = lo; group 128,
          or the largest of 64 / 32 dividing K where 128 does not (SmolLM2: K = 576 -> 64).
          The range is searched too (clipping, as llama.cpp's k-quants and AWQ's auto-clip
          do): hi and lo shrunk by the INT4_SHRINK factors, least squared error per group kept
          (min / max alone: KL 0.58 -> 0.35 at group 128 on SmolLM2).

The searches run on the weights only (no calibration data) and cost one pass per candidate;
they carry only each slice's best scale (and offset) from candidate to candidate, and make the
quantized values once, from the winner (under jit in a `fori_loop`: temporaries of one
candidate at a time, ~3x the float32 weight for int4, 2x for fp8).
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


FP8_SEARCH = 16  # candidate fp8 scales per channel, a = 1 + i / FP8_SEARCH
INT4_SHRINK = ((1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.86, 0.84, 0.82, 0.8),  # hi
               (1.0, 0.95, 0.9, 0.85, 0.8))  # lo


def _least_error(factors: np.ndarray, make, err, xp):
    """Per slice, the first candidate with the least `err`: candidate i is `make(factors[i])`,
    a tuple of small per-slice parameters (scales, offsets).

    Only those parameters are carried between candidates; the quantized values are made once,
    from the winner, by the caller. Under jnp the candidates run in a `fori_loop`, so the
    search holds one candidate's temporaries at a time (unrolled, XLA kept every candidate's
    weight-sized temporaries live: 62x the float32 weight for int4, an OOM on an H100 for one
    4096 x 28672 matrix)."""
    table = factors if xp is np else xp.asarray(factors)

    def step(i, carry):
        best, best_err = carry
        cand = make(table[i])
        cand_err = err(*cand)
        better = cand_err < best_err
        return (tuple(xp.where(better, c, b) for c, b in zip(cand, best)),
                xp.where(better, cand_err, best_err))

    best = make(table[0])
    carry = (best, err(*best))
    if xp is np:
        for i in range(1, len(factors)):
            carry = step(i, carry)
        return carry[0]
    import jax
    return jax.lax.fori_loop(1, len(factors), step, carry)[0]


def quantize_fp8(w, xp=np, search: int = FP8_SEARCH) -> QArray:
    """Float [..., K, N] -> per-output-channel fp8, stored [..., N, K] (W8A8 dynamic)."""
    w = xp.asarray(w).astype(np.float32)
    s0 = xp.maximum(xp.abs(w).max(axis=-2, keepdims=True), 1e-12) / FP8_MAX  # [..., 1, N]

    def values(s):
        return xp.clip(w / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)

    def err(s):
        return ((values(s).astype(np.float32) * s - w) ** 2).sum(axis=-2, keepdims=True)

    factors = np.array([1 + i / search for i in range(max(search, 1))], np.float32)
    (s,) = _least_error(factors, lambda f: (s0 * f,), err, xp)
    return QArray(xp.swapaxes(values(s), -1, -2), xp.swapaxes(s, -1, -2), None, kind="fp8",
                  act="fp8")


def quantize_fp8_blocks(w: np.ndarray, bn: int = 128, bk: int = 128) -> QArray:
    """Float [K, N] -> HF FP8's layout (weight-only): e4m3 values [N, K], `weight_scale_inv`
    [N/bn, K/bk] (amax / 448 per block; bn = N, bk = K: one per-tensor scale). What FP8
    checkpoints hold; tests and benchmarks make them from float weights with it."""
    import ml_dtypes

    wt = np.asarray(w, np.float32).T
    n, k = wt.shape
    blocks = wt.reshape(n // bn, bn, k // bk, bk)
    s = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / FP8_MAX
    v = (blocks / s[:, None, :, None]).reshape(n, k).astype(ml_dtypes.float8_e4m3fn)
    return QArray(v, s.astype(np.float32), None, kind="fp8", act="none")


def quantize_int8(w, xp=np) -> QArray:
    """Float [..., K, N] -> int8 [..., K, N], symmetric per output channel."""
    w = xp.asarray(w).astype(np.float32)
    s = xp.maximum(xp.abs(w).max(axis=-2, keepdims=True), 1e-12) / 127.0  # [..., 1, N]
    q = xp.clip(xp.round(w / s), -127, 127).astype(np.int8)
    return QArray(q, s, None, kind="int8")


def quantize_int4(w, xp=np, group: int | None = None, search: bool = True) -> QArray:
    """Float [..., K, N] -> packed int4 [..., K/2, N], asymmetric per group of K rows."""
    w = xp.asarray(w).astype(np.float32)
    *lead, k, n = w.shape
    g = group or int4_group(k)
    blocks = w.reshape(*lead, k // g, g, n)
    lo, hi = blocks.min(axis=-2), blocks.max(axis=-2)  # [..., K/g, N]

    def scale_offset(lo, hi):
        # float16 scale / offset (half the bytes of float32); quantize by the stored values.
        # floor: float16's smallest subnormal (1e-8 rounded to a 0 scale: a constant group
        # divided by zero)
        s = xp.maximum((hi - lo) / 15.0, 2.0 ** -24).astype(np.float16)
        return s, lo.astype(np.float16)

    def values(s, o):
        sf, of = s.astype(np.float32)[..., None, :], o.astype(np.float32)[..., None, :]
        return xp.clip(xp.round((blocks - of) / sf), 0, 15), sf, of

    def err(s, o):
        q, sf, of = values(s, o)
        return ((q * sf + of - blocks) ** 2).sum(axis=-2)

    shrink = [(1.0, 1.0)] + [(a, c) for a in INT4_SHRINK[0] for c in INT4_SHRINK[1]
                             if search and (a != 1.0 or c != 1.0)]  # (hi, lo) factors
    factors = np.array(shrink, np.float32)
    s, o = _least_error(factors, lambda f: scale_offset(lo * f[1], hi * f[0]), err, xp)
    q = values(s, o)[0]
    return QArray(pack_int4(q.astype(np.uint8).reshape(*lead, k, n), g), s, o, kind="int4")


QUANTIZERS = {"fp8": quantize_fp8, "int8": quantize_int8, "int4": quantize_int4}


LINEAR_PARAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # llama.LayerStack


def quantize_state(params, method: str, mesh=None):
    """Quantize the stacked float linears of a model's nnx state in place, on its device(s).

    Used for every online mode (checkpoint or random weights alike); linears that already
    are QArrays (pre-quantized checkpoints) are left as they are. `mesh` (tensor parallel):
    each QArray comes out split like its float weight (`quantization/tp.py`).
    """
    import jax
    import jax.numpy as jnp

    from jaxllm.models.params import set_value, value

    # One layer at a time (lax.map over the stacked layer axis): the quantizers' float32 copies
    # and scale-search candidates of a whole [L, K, N] stack asked an 8B model's step for
    # 175 GiB on an H200 (session 17); per layer they are one layer's.
    quantize = lambda w: jax.lax.map(lambda wl: QUANTIZERS[method](wl, jnp), w)
    layers = params["layers"]
    for name in LINEAR_PARAMS:
        if name not in layers or isinstance(value(layers[name]), QArray):
            continue
        var = layers[name]
        w = value(var)
        if mesh is None:
            q = jax.jit(quantize)(w)
        else:
            from jaxllm.quantization.tp import qarray_shardings
            out = qarray_shardings(jax.eval_shape(quantize, w), w.sharding.spec, mesh, name)
            q = jax.jit(quantize, out_shardings=out)(w)
        set_value(var, q)
    return params


def draw_quantized(make, method: str, seed: int = 0, scale: float = 0.02):
    """The nnx state of `make()` for `load_format="dummy"` with an online method, on the device:
    each decoder linear drawn (scale x normal, as `llama._param`) and quantized one layer at a
    time, so no float stack ever exists whole (a 70B model's 141 GB of bf16 weights exceed one
    H200; its fp8 ones fit); every other weight as `make()` draws it. The linears come out
    as `quantize_state` makes them (the same QArray layouts), from other random draws."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.models.params import set_value, value

    shapes = nnx.state(nnx.eval_shape(make))["layers"]
    names = [n for n in LINEAR_PARAMS if n in shapes]

    def rest():
        state = nnx.state(make())
        for n in names:  # not returned, so never drawn (XLA drops the dead draws)
            set_value(state["layers"][n], jnp.zeros((), value(state["layers"][n]).dtype))
        return state

    params = jax.jit(rest)()
    for i, n in enumerate(names):
        set_value(params["layers"][n], jax.jit(draw_linear, static_argnums=(1, 2, 3, 4))(
            jax.random.key(seed * 7919 + i), value(shapes[n]).shape, value(shapes[n]).dtype, method, scale))
    return params


def draw_linear(key, shape: tuple[int, ...], dtype, method: str, scale: float = 0.02):
    """A random [L, K, N] linear stack, quantized: drawn and quantized one layer at a time."""
    import jax
    import jax.numpy as jnp

    def one(k):
        return QUANTIZERS[method]((scale * jax.random.normal(k, shape[1:])).astype(dtype), jnp)
    return jax.lax.map(one, jax.random.split(key, shape[0]))

