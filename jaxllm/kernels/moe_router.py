"""The MoE router of a decode-sized step in one kernel: logits, softmax, top-k, renormalisation.

`route_tokens(h [T, H], w [H, E], valid [T]) -> (weights [T, k] float32, ids [T, k] int32)`, the
contract of `moe.route` on `h @ w` (float32 logits) except that padding tokens (`valid` False)
get id E, no expert, and weight 0: the expert kernels skip them without an XLA kernel masking
the ids in between (`moe.experts` with `valid=None`).

Why: XLA compiles the router of a batch-1 decode step into four kernels a layer (a split-K
GEMV, the split sum fused with the softmax, top-k, then the direct grouped matmul's row table)
plus a fifth that applies the RMSNorm weight again for the experts' input (Qwen3-30B-A3B:
about a fifth of the step's ~19 kernels a layer, each a few microseconds in a launch-bound
step). Here one program takes 16 tokens: it streams the router weight ([H, E] bf16, 512 KB
for Qwen3-30B-A3B) through `num_stages` pipelined tiles, multiplies on the tensor cores
(float32 accumulation), then does the routing in registers. Reading the weight from one
program per 16 tokens costs bandwidth that a split-K GEMV spreads over many SMs, so it is
offered for small batches only (`fits`). With `rms_norm` it also takes the RMSNorm before the
router: it reads the residual stream, normalises each tile of rows as it streams (statistics in
a first pass over the rows) and writes the normed rows out for the experts, so that XLA's
RMSNorm kernel goes too (Qwen3-30B-A3B batch-1 step: 924 kernels, 731 with the router here,
587 with the RMSNorm here and `rope_write.py`; docs/moe.md). On an H100 that one-program read
took 10-31 us more than XLA's router (session 34), so `splits` cuts H over many programs, each
storing float32 partial logits, and a second small launch sums them and routes (`mode()`
"split"): two kernels where XLA's path has six (the norm's scale, the pad to two rows, the
split-K GEMV, softmax, top-k, the padding mask).

Routing as `moe.route`: "softmax" (Qwen2/3-MoE: softmax over all experts, top-k of the
probabilities, renormalised when `norm_topk_prob`), "softmax_topk" (Mixtral: top-k of the
logits, softmax over them). Ties pick the lower expert id, as `lax.top_k`. Logits are summed in
another order than XLA's, so a near-tie may resolve differently (the float32 sum of H products).

A `pallas_call`: Triton on the GPU, Pallas' interpreter on the CPU (tests/test_moe_router.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

BLOCK_T = 16  # tokens a program (the tensor cores' minimum M)
MAX_TOKENS = 64  # larger batches keep XLA's router (a split-K GEMM spreads the weight over SMs)
SPLIT_TOKENS = 2  # the split kernels by default: steps of up to 2 tokens (measured there, session 36)
ROUTINGS = ("softmax", "softmax_topk")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def padded_experts(E: int) -> int:
    """The kernel's expert columns: E rounded up to a power of two, at least 16 (the tensor
    cores' minimum N); the padding columns read as -inf logits."""
    return max(16, 1 << (E - 1).bit_length())


def block_k(E: int, H: int) -> int:
    """Router-weight rows a pipeline stage: up to 32 KB bf16 tiles, a power of two dividing H
    (0: none of at least 16 rows)."""
    bk = 16384 // E
    while bk >= 16 and H % bk:
        bk //= 2
    return bk if bk >= 16 else 0


def fits(T: int, H: int, E: int, top_k: int, routing: str) -> bool:
    """Shapes the kernel takes: up to 256 experts, a power-of-two top-k (Triton's tiles), H a
    multiple of 16, up to MAX_TOKENS tokens, a known routing."""
    return (T <= MAX_TOKENS and E <= 256 and _pow2(top_k) and top_k <= E
            and block_k(padded_experts(E), H) > 0 and routing in ROUTINGS)


def _topk(x: jax.Array, k: int, E: int) -> tuple[jax.Array, jax.Array]:
    """Top-k along axis 1 of x [bt, E], largest first, ties to the lower index: ([bt, k], [bt, k])."""
    cols = jnp.arange(E, dtype=jnp.int32)[None, :]
    slot = jnp.arange(k, dtype=jnp.int32)[None, :]
    vals = jnp.zeros((x.shape[0], k), jnp.float32)
    ids = jnp.zeros((x.shape[0], k), jnp.int32)
    for j in range(k):
        best = jnp.max(x, axis=1)
        idx = jnp.min(jnp.where(x == best[:, None], cols, E), axis=1)
        vals = jnp.where(slot == j, best[:, None], vals)
        ids = jnp.where(slot == j, idx[:, None], ids)
        x = jnp.where(cols == idx[:, None], -jnp.inf, x)
    return vals, ids


def _softmax(x: jax.Array) -> jax.Array:
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    return e / jnp.sum(e, axis=1, keepdims=True)


def _logits(h_ref, w_ref, ln_ref, hn_ref, rows, lo, steps: int, *, bk: int, Ep: int,
            eps: float | None) -> jax.Array:
    """Float32 logits [len(rows), Ep] of `rows` over the weight rows lo .. lo + steps * bk (all of
    H, or one split's share); with `eps` the rows are RMS-normalised first (statistics over all
    H columns) and the normed columns of that range stored to hn_ref."""
    T, H = h_ref.shape
    E = w_ref.shape[1]
    bt = rows.shape[0]
    src = jnp.minimum(rows, T - 1)  # rows past T: clamped copies, their results not stored
    cols = jnp.arange(Ep, dtype=jnp.int32)
    if eps is not None:  # RMSNorm statistics of each row (float32, over all H columns)
        sk = _chunk(H, bt, 4096)  # up to 4,096 values a load (one load for one or two rows)

        def sq(i, acc):
            x = h_ref[src[:, None], (i * sk + jnp.arange(sk, dtype=jnp.int32))[None, :]]
            x = x.astype(jnp.float32)
            return acc + jnp.sum(x * x, axis=1)
        ss = jax.lax.fori_loop(0, H // sk, sq, jnp.zeros((bt,), jnp.float32))
        r = jax.lax.rsqrt(ss / H + eps)[:, None]
    if bt < BLOCK_T:  # below 16 rows no tensor cores: products summed on the CUDA cores,
        sub = _chunk(bk, bt * Ep, 4096)  # up to 4,096 products a step
        steps, bk = steps * (bk // sub), sub

    def step(i, acc):
        kk = lo + i * bk + jnp.arange(bk, dtype=jnp.int32)
        x = h_ref[src[:, None], kk[None, :]]  # [bt, bk]
        if eps is not None:  # the model's rms_norm: cast back before the weight, as HF does
            dt = x.dtype
            x = (x.astype(jnp.float32) * r).astype(dt)
            x = (ln_ref[kk].astype(jnp.float32)[None, :] * x.astype(jnp.float32)).astype(dt)
            plt.store(hn_ref.at[rows[:, None], kk[None, :]], x, mask=(rows < T)[:, None])
        if Ep == E:
            w = w_ref[pl.ds(lo + i * bk, bk), :]  # [bk, E]
        else:  # padding columns read as 0
            w = plt.load(w_ref.at[kk[:, None], jnp.minimum(cols, E - 1)[None, :]],
                         mask=(cols < E)[None, :], other=0)
        if bt < BLOCK_T:
            prod = x.astype(jnp.float32)[:, :, None] * w.astype(jnp.float32)[None, :, :]
            return acc + jnp.sum(prod, axis=1)
        return acc + plt.dot(x, w).astype(jnp.float32)

    return jax.lax.fori_loop(0, steps, step, jnp.zeros((bt, Ep), jnp.float32))


def _chunk(n: int, per: int, most: int) -> int:
    """The largest power of two c dividing n with c * per <= most (at least 1)."""
    c = 1
    while n % (2 * c) == 0 and 2 * c * per <= most:
        c *= 2
    return c


def block_rows(T: int) -> int:
    """Rows a program of the split kernels: one or two tokens as they are (no padding rows, the
    products on the CUDA cores), else 16 (the tensor cores' minimum M)."""
    return BLOCK_T if T > 2 else T


def _refs(refs, eps: float | None) -> tuple:
    """(ln_ref, the outputs..., hn_ref), the norm's refs None without `eps`."""
    if eps is None:
        return (None, *refs, None)
    return refs


def _kernel(valid_ref, h_ref, w_ref, *refs, top_k: int, routing: str, norm: bool, bk: int,
            Ep: int, eps: float | None):
    """One program: the whole of H, then the routing. refs: (ln_ref,) when `eps` (h_ref is the
    residual stream, RMS-normalised here), then the weights and ids outputs, then (the
    normalised rows, hn_ref) when `eps`."""
    ln_ref, wt_ref, id_ref, hn_ref = _refs(refs, eps)
    T, H = h_ref.shape
    rows = pl.program_id(0) * BLOCK_T + jnp.arange(BLOCK_T, dtype=jnp.int32)
    logits = _logits(h_ref, w_ref, ln_ref, hn_ref, rows, 0, H // bk, bk=bk, Ep=Ep, eps=eps)
    _store_routing(logits, valid_ref, wt_ref, id_ref, rows, T, w_ref.shape[1], top_k=top_k,
                   routing=routing, norm=norm)


def _partial_kernel(h_ref, w_ref, *refs, bk: int, Ep: int, eps: float | None):
    """Program (b, s): split s's share of H for rows block b, its float32 partial logits stored to
    part_ref [S, T, Ep] (and its columns of the normed rows with `eps`)."""
    ln_ref, part_ref, hn_ref = _refs(refs, eps)
    T, H = h_ref.shape
    S = part_ref.shape[0]
    bt = block_rows(T)
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    share = H // S
    s = pl.program_id(1)
    logits = _logits(h_ref, w_ref, ln_ref, hn_ref, rows, s * share, share // bk, bk=bk, Ep=Ep, eps=eps)
    cols = jnp.arange(Ep, dtype=jnp.int32)
    plt.store(part_ref.at[s, rows[:, None], cols[None, :]], logits, mask=(rows < T)[:, None])


def _combine_kernel(valid_ref, part_ref, wt_ref, id_ref, *, E: int, top_k: int, routing: str,
                    norm: bool):
    """Program b: the S partial logits of rows block b summed, then the routing."""
    S, T, Ep = part_ref.shape
    bt = block_rows(T)
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    cols = jnp.arange(Ep, dtype=jnp.int32)
    mask = (rows < T)[None, :, None]
    sc = _chunk(S, bt * Ep, 8192)  # partials a load: all 32 of one or two tokens at once

    def add(i, acc):
        ss = i * sc + jnp.arange(sc, dtype=jnp.int32)
        part = plt.load(part_ref.at[ss[:, None, None], rows[None, :, None], cols[None, None, :]],
                        mask=mask, other=0.0)
        return acc + jnp.sum(part, axis=0)

    logits = jax.lax.fori_loop(0, S // sc, add, jnp.zeros((bt, Ep), jnp.float32))
    _store_routing(logits, valid_ref, wt_ref, id_ref, rows, T, E, top_k=top_k, routing=routing, norm=norm)


def _store_routing(logits, valid_ref, wt_ref, id_ref, rows, T: int, E: int, *, top_k: int,
                   routing: str, norm: bool) -> None:
    """Route the float32 logits [bt, Ep] of `rows` and store their weights and ids (rows < T;
    padding tokens: weight 0, id E)."""
    Ep = logits.shape[1]
    cols = jnp.arange(Ep, dtype=jnp.int32)
    if Ep != E:
        logits = jnp.where((cols < E)[None, :], logits, -jnp.inf)
    if routing == "softmax_topk":
        top, ids = _topk(logits, top_k, Ep)
        weights = _softmax(top)
    else:
        weights, ids = _topk(_softmax(logits), top_k, Ep)
        if norm:
            weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    live = valid_ref[jnp.minimum(rows, T - 1)] != 0
    mask = (rows < T)[:, None]
    slots = jnp.arange(top_k, dtype=jnp.int32)
    plt.store(wt_ref.at[rows[:, None], slots[None, :]], jnp.where(live[:, None], weights, 0.0),
              mask=mask)
    plt.store(id_ref.at[rows[:, None], slots[None, :]], jnp.where(live[:, None], ids, E), mask=mask)


def split_rows(H: int, E: int, splits: int) -> int:
    """Weight rows a pipeline stage of one split's share of H (`block_k`, at most the share);
    0 where `splits` does not cut H into shares of a multiple of 16 rows."""
    if splits < 1 or H % splits or (H // splits) % 16:
        return 0
    share, bk = H // splits, block_k(padded_experts(E), H)
    while bk > share or (bk and share % bk):
        bk //= 2
    return bk if bk >= 16 else 0


def default_splits(H: int, E: int) -> int:
    """Splits of H for the router weight: about 16 KB of bf16 weight a program (Qwen3-30B-A3B's
    [2048, 128]: 32 programs of 64 rows), so the weight is read by as many SMs as a split-K GEMV
    uses, rather than by one program per 16 tokens (session 34: that one-program read took
    10-31 us on an H100)."""
    s = max(1, (H * padded_experts(E) * 2) // 16384)
    while s > 1 and not split_rows(H, E, s):
        s //= 2
    return s


def route_tokens(h: jax.Array, w: jax.Array, valid: jax.Array | None, top_k: int, routing: str,
                 norm_topk_prob: bool, interpret: bool | None = None,
                 num_warps: int = 4, num_stages: int = 4,
                 rms_norm: tuple[jax.Array, float] | None = None,
                 splits: int = 1) -> tuple[jax.Array, ...]:
    """h [T, H], w [H, E] (h's dtype), valid [T] bool or None (all valid) -> (weights [T, k]
    float32, ids [T, k] int32; padding tokens: weight 0, id E). With `rms_norm` = (weight [H],
    eps), h is the residual stream: the router reads `llama.rms_norm(h, weight, eps)`, computed
    here, and returns it as well (the experts' input): (weights, ids, normed h [T, H]).
    `splits` > 1 cuts H into that many shares, one program each (`_partial_kernel`: float32
    partial logits [splits, T, E]), and a second launch sums them and routes. Raises ValueError
    where `fits` does not hold or `splits` does not cut H (`split_rows`)."""
    T, H = h.shape
    E = w.shape[-1]
    if not fits(T, H, E, top_k, routing):
        raise ValueError(f"the router kernel does not take T={T} H={H} E={E} top_k={top_k} "
                         f"routing={routing!r} (`moe_router.fits`)")
    if splits != 1 and not split_rows(H, E, splits):
        raise ValueError(f"splits={splits} does not cut H={H} into shares of 16k rows")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if valid is None:
        valid = jnp.ones((T,), bool)
    valid = valid.astype(jnp.int32)
    Ep = padded_experts(E)
    routed = (jax.ShapeDtypeStruct((T, top_k), jnp.float32), jax.ShapeDtypeStruct((T, top_k), jnp.int32))
    extra, eps, normed = (), None, ()
    if rms_norm is not None:
        extra, eps = (rms_norm[0].astype(h.dtype),), float(rms_norm[1])
        normed = (jax.ShapeDtypeStruct((T, H), h.dtype),)
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    route = dict(top_k=top_k, routing=routing, norm=bool(norm_topk_prob))
    if splits == 1:
        return pl.pallas_call(
            functools.partial(_kernel, **route, bk=block_k(Ep, H), Ep=Ep, eps=eps),
            grid=(pl.cdiv(T, BLOCK_T),), out_shape=routed + normed, compiler_params=params,
            interpret=interpret, name="jaxllm_moe_router",
        )(valid, h, w.astype(h.dtype), *extra)
    part, *hn = pl.pallas_call(
        functools.partial(_partial_kernel, bk=split_rows(H, E, splits), Ep=Ep, eps=eps),
        grid=(pl.cdiv(T, block_rows(T)), splits),
        out_shape=(jax.ShapeDtypeStruct((splits, T, Ep), jnp.float32),) + normed,
        compiler_params=params, interpret=interpret, name="jaxllm_moe_router_split",
    )(h, w.astype(h.dtype), *extra)
    weights, ids = pl.pallas_call(
        functools.partial(_combine_kernel, E=E, **route),
        grid=(pl.cdiv(T, block_rows(T)),), out_shape=routed, compiler_params=params,
        interpret=interpret, name="jaxllm_moe_router_combine",
    )(valid, part)
    return (weights, ids, *hn)


MODES = ("split", "kernel", "xla")


def mode() -> str:
    """JAXLLM_MOE_ROUTER: "split" (default) routes decode-sized steps on one GPU here with H cut
    over `default_splits` programs and a second launch that routes; "kernel" with one program per
    16 tokens; "xla" keeps XLA's router throughout. On an H100 (session 36) the split kernels
    time as XLA's router alone (17.7 against 17.6-18.4 us a call) and the batch-1 step the same
    (4.76 against 4.77 ms, GPU-bound) with 193 fewer kernels (784), which counts where a step is
    bound by its launches (session 26's H200); the one-program kernel took 10-31 us more than
    XLA's router a call (session 34). The start-up probe falls back to XLA's router where the
    kernel disagrees with it or fails (`engine/kernel_probes.py`)."""
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_MOE_ROUTER", "split", MODES)  # "split": steps of <= SPLIT_TOKENS


def enabled() -> bool:
    return mode() != "xla"


def route_small(x: jax.Array, w, valid: jax.Array, top_k: int, routing: str,
                norm_topk_prob: bool, ln: jax.Array, eps: float) -> tuple[jax.Array, ...] | None:
    """`route_tokens` of the residual stream x with the RMSNorm (ln, eps) before the router
    done here, where it takes the batch (`fits`, plain weights of x's dtype): (weights, ids,
    normed x); else None. The model's `router_fn` hook (models/moe_model.py); split by `mode()`."""
    T, H = x.shape
    if not (isinstance(w, jax.Array) and w.dtype == x.dtype and w.ndim == 2
            and isinstance(ln, jax.Array) and fits(T, H, w.shape[1], top_k, routing)):
        return None
    splits = 1
    if mode() == "split":
        if T > SPLIT_TOKENS:  # larger steps: XLA's router (the split form unmeasured there)
            return None
        splits = default_splits(H, w.shape[1])
    return route_tokens(x, w, valid, top_k, routing, norm_topk_prob, rms_norm=(ln, eps),
                        splits=splits)


def route_logits(logits: jax.Array, top_k: int, routing: str, norm_topk_prob: bool
                 ) -> tuple[jax.Array, jax.Array]:
    """The routing in plain jnp (`moe.route`, the CPU path): logits [T, E] -> (weights [T, k]
    float32, ids [T, k] int32), `lax.top_k`'s ties (the lower id first)."""
    logits = logits.astype(jnp.float32)
    if routing == "softmax_topk":
        top, ids = jax.lax.top_k(logits, top_k)
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
    if routing != "softmax":
        raise ValueError(f"unknown routing {routing!r}")
    top, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, ids.astype(jnp.int32)


def route_tokens_ref(h: jax.Array, w: jax.Array, valid: jax.Array | None, top_k: int,
                     routing: str, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """`route_tokens` in plain jnp: `route_logits` of the float32 logits, padding masked."""
    logits = jnp.einsum("th,he->te", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    weights, ids = route_logits(logits, top_k, routing, norm_topk_prob)
    if valid is None:
        return weights, ids
    return (jnp.where(valid[:, None], weights, 0.0),
            jnp.where(valid[:, None], ids, w.shape[-1]).astype(jnp.int32))
