"""A decode-sized step's q/k head RMSNorm (Qwen3), RoPE and K/V write into the paged pool in one
kernel.

`rope_write(qkv [T, (H + 2K) D], ...) -> (q roped [T, H, D], kv_pages)`, q, k and v side by side
as the fused q/k/v projection gives them (no XLA slice of it, each of which was a kernel): the
model's `rms_norm` of each q and k head (with `q_norm` / `k_norm` weights, else none), its
rotate-half `apply_rope` at each token's position, and `ref.write_kv` of the roped k and of v
into the token's slot of layer `layer` (padding tokens, slot -1: nothing written). The pool is
aliased in and out (donated through the step, so written in place).

Why: XLA compiled these, at a batch-1 decode step of Qwen3-30B-A3B, into four kernels a layer
(the k-norm, the KV scatter with k's RoPE, the q-norm, q's RoPE: the rotate-half concatenate
fuses with nothing before it), each a few microseconds of a launch-bound step; with this kernel
two (it, and the sum of the q/k/v GEMM's split-K partials that XLA fused into those four):
635 kernels a step instead of 731 (`scripts/aot_kernels.py`). A program loads each half of a
group of heads ([heads, D/2] tiles, so the rotation pairs columns j and j + D/2 without a
shuffle), normalises in float32 (statistics over both halves, the bf16 cast before the weight as
HF does), rotates, and stores q or writes k / v to their page row. Programs: (token, group of
`Q_HEADS` q heads) and (token, k/v head), so a batch-1 step spreads its loads over 2 x (4 + 4)
CTAs (Qwen3-30B-A3B) where session 33's one program a token (the whole of q, k and v in one
serial chain of loads and stores, 2 CTAs) took 3-4 us more than XLA's four kernels on an H100.

Plain pages only (the model's dtype: fp8 / int pages quantize in `write_kv`), no rotation of
the page layout (`kv_quant.page_rotation`), up to MAX_TOKENS tokens (`fits`); the model keeps
XLA's path otherwise. A `pallas_call`: Triton on the GPU, Pallas' interpreter on the CPU
(tests/test_rope_write.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_TOKENS = 64  # larger steps keep XLA's fusions (their scatter is one kernel at any size)
Q_HEADS = 8  # q heads a program (a power of two); each k/v head pair has a program of its own


def fits(qkv: jax.Array, head_dim: int, kv_pages: jax.Array) -> bool:
    """Plain pages of qkv's dtype (or qkv float32 split-K partials [S, T, C], S a power of two),
    head dim a power of two >= 32, up to MAX_TOKENS tokens."""
    D = head_dim
    plain = qkv.ndim == 2 and kv_pages.dtype == qkv.dtype
    split = (qkv.ndim == 3 and qkv.dtype == jnp.float32 and qkv.shape[0] & (qkv.shape[0] - 1) == 0
             and jnp.issubdtype(kv_pages.dtype, jnp.floating) and kv_pages.dtype.itemsize == 2)
    return ((plain or split) and qkv.shape[-2] <= MAX_TOKENS and kv_pages.shape[-1] == D
            and D >= 32 and D & (D - 1) == 0)


def mode() -> str:
    """JAXLLM_ROPE_WRITE: "kernel" (default) takes decode-sized steps of models with q/k head norms
    (Qwen3) on one GPU here, "all" those of models without them too (Llama: RoPE and the K/V
    write), "xla" keeps XLA's fusions throughout. Session 39's H100: alone (`check_moe_kernels.py
    --cases rope_write`, a chained call's loop cost 25 us included) 15.3 us against XLA's 27.3 at
    one real token, 26.5 against 30.0 at two; in the Qwen3-30B-A3B batch-1 step 0.22 ms of
    kernels a step where XLA's took 0.50 (640 kernels a step against 784); Llama-3-8B batch 1
    under "all" 1.05x the floor against 1.02x, so models without head norms keep XLA's."""
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_ROPE_WRITE", "kernel", ("kernel", "all", "xla"))


def enabled() -> bool:
    return mode() != "xla"


def rope_write_small(qkv, heads, q_norm, k_norm, eps, positions, inv_freq, kv_pages, layer,
                     slot_mapping) -> tuple[jax.Array, jax.Array] | None:
    """`rope_write` where it takes the step (`fits`) and the model has head norms (or `mode()` is
    "all"), else None: the model's `rope_write_fn` hook. Without head norms XLA compiled the same
    work into as many kernels under jax 0.10 (q's RoPE; the KV scatter with k's)."""
    if (q_norm is None and mode() != "all") or not fits(qkv, kv_pages.shape[-1], kv_pages):
        return None
    return rope_write(qkv, heads, q_norm, k_norm, eps, positions, inv_freq, kv_pages, layer,
                      slot_mapping)


def _heads(ref, t, base: int, first, n: int, n_pad: int, half: int, hi: int, dt):
    """[n_pad, half] float32: columns [hi * half, (hi + 1) * half) of heads first .. first + n_pad
    (clamped to the n heads) of token t's row, whose heads start at column `base`. A ref of
    float32 split-K partials [S, T, C] is summed over S and rounded to `dt` (the projection's
    output dtype, as the model's path rounds it)."""
    h = first + jnp.arange(n_pad, dtype=jnp.int32)
    j = jnp.arange(half, dtype=jnp.int32)
    cols = base + jnp.minimum(h, n - 1)[:, None] * (2 * half) + hi * half + j[None, :]
    if len(ref.shape) == 2:
        return plt.load(ref.at[t, cols]).astype(jnp.float32)
    s = jnp.arange(ref.shape[0], dtype=jnp.int32)
    part = plt.load(ref.at[s[:, None, None], t, cols[None, :, :]])  # [S, n_pad, half]
    return jnp.sum(part, axis=0).astype(dt).astype(jnp.float32)


def _norm_rope(ref, w_ref, t, base: int, first, n: int, n_pad: int, half: int, cos, sin,
               eps: float, dt):
    """Heads first .. first + n_pad of token t normalised (w_ref None: not) and rotated: two
    [n_pad, half] halves."""
    x1, x2 = (_heads(ref, t, base, first, n, n_pad, half, hi, dt) for hi in (0, 1))
    if w_ref is not None:
        j = jnp.arange(half, dtype=jnp.int32)
        r = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / (2 * half) + eps)
        w1, w2 = (w_ref[hi * half + j].astype(jnp.float32)[None, :] for hi in (0, 1))
        x1 = (w1 * (x1 * r[:, None]).astype(dt).astype(jnp.float32)).astype(dt).astype(jnp.float32)
        x2 = (w2 * (x2 * r[:, None]).astype(dt).astype(jnp.float32)).astype(dt).astype(jnp.float32)
    return (x1 * cos - x2 * sin).astype(dt), (x2 * cos + x1 * sin).astype(dt)


def q_heads_per_program(H: int) -> int:
    """q heads a program: Q_HEADS rounded down to a power of two, at most H's power of two."""
    return min(Q_HEADS, pl.next_power_of_2(H))


def _kernel(pos_ref, slot_ref, layer_ref, inv_ref, x_ref, *refs, H: int, K: int, half: int,
            page_size: int, eps: float, norm: bool):
    """Program (t, g): token t's q heads g * hq .. (g + 1) * hq for g < cdiv(H, hq), else its
    k and v head g - cdiv(H, hq) (written only where the token has a slot)."""
    if norm:
        qw_ref, kw_ref, _, qo_ref, kv_ref = refs
    else:
        (_, qo_ref, kv_ref), qw_ref, kw_ref = refs, None, None
    dt = qo_ref.dtype
    t, g = pl.program_id(0), pl.program_id(1)
    hq = q_heads_per_program(H)
    groups = pl.cdiv(H, hq)
    j = jnp.arange(half, dtype=jnp.int32)
    ang = pos_ref[t].astype(jnp.float32) * inv_ref[j]
    cos, sin = jnp.cos(ang)[None, :], jnp.sin(ang)[None, :]
    D = 2 * half
    slot = slot_ref[t]

    @pl.when(g < groups)
    def _q():
        h = g * hq + jnp.arange(hq, dtype=jnp.int32)
        q1, q2 = _norm_rope(x_ref, qw_ref, t, 0, g * hq, H, hq, half, cos, sin, eps, dt)
        for hi, part in ((0, q1), (1, q2)):
            plt.store(qo_ref.at[t, h[:, None], hi * half + j[None, :]], part, mask=(h < H)[:, None])

    @pl.when((g >= groups) & (slot >= 0))
    def _write():
        layer, page, off = layer_ref[0], slot // page_size, slot % page_size
        kh = g - groups
        hk = kh + jnp.arange(1, dtype=jnp.int32)
        k1, k2 = _norm_rope(x_ref, kw_ref, t, H * D, kh, K, 1, half, cos, sin, eps, dt)
        v1, v2 = (_heads(x_ref, t, (H + K) * D, kh, K, 1, half, hi, dt).astype(dt) for hi in (0, 1))
        for which, hi, part in ((0, 0, k1), (0, 1, k2), (1, 0, v1), (1, 1, v2)):
            plt.store(kv_ref.at[layer, which, hk[:, None], page, off, hi * half + j[None, :]], part)


def rope_write(qkv: jax.Array, heads: tuple[int, int], q_norm: jax.Array | None,
               k_norm: jax.Array | None, eps: float, positions: jax.Array, inv_freq: np.ndarray,
               kv_pages: jax.Array, layer: jax.Array, slot_mapping: jax.Array,
               interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """qkv [T, (H + 2K) D] (q's H heads, k's K, v's K), heads (H, K) -> (q normed and roped
    [T, H, D], kv_pages with each token's k (normed, roped) and v written at its slot of
    `layer`). q_norm / k_norm [D] or None (no head norm). qkv may also be the q/k/v projection's
    float32 split-K partials [S, T, (H + 2K) D] (`gemv.gemv(..., partials=True)`), summed here
    and rounded to the pages' dtype as the projection's output would be: no kernel sums them."""
    (T, C), (H, K), D = qkv.shape[-2:], heads, kv_pages.shape[-1]
    if not fits(qkv, D, kv_pages) or C != (H + 2 * K) * D:
        raise ValueError(f"rope_write does not take qkv {qkv.shape} {qkv.dtype}, heads {heads}, "
                         f"pages {kv_pages.dtype} [..., {kv_pages.shape[-1]}] (`rope_write.fits`)")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    norm = q_norm is not None
    weights = (q_norm, k_norm) if norm else ()
    args = (positions.astype(jnp.int32), slot_mapping.astype(jnp.int32),
            jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.asarray(inv_freq, jnp.float32),
            qkv, *weights, kv_pages)
    return pl.pallas_call(
        functools.partial(_kernel, H=H, K=K, half=D // 2, page_size=kv_pages.shape[-2],
                          eps=float(eps), norm=norm),
        grid=(T, pl.cdiv(H, q_heads_per_program(H)) + K),
        out_shape=(jax.ShapeDtypeStruct((T, H, D), kv_pages.dtype),
                   jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)),
        input_output_aliases={len(args) - 1: 1},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxllm_rope_write",
    )(*args)
