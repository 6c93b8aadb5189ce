"""Start-up probes of the decode-step kernels that replace XLA's fusions without a warm-up
measurement (`kernels/moe_router.py`, `kernels/rope_write.py`): each runs once on the device at
the model's shapes against the model's own XLA path; a kernel that raises or disagrees is
logged and left out, so the engine falls back to XLA's path instead of serving wrong tokens
(as `prefill_choice`'s probe does for the Mosaic prefill kernel).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.config import ModelConfig

log = logging.getLogger("jaxllm")
TOKENS = 8  # a batch-1 decode bucket; the first REAL tokens real, the rest padding
REAL = 5


def _close(a, b, tol: float) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.isfinite(a).all() and np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-30))


def router_ok(cfg: ModelConfig, dtype) -> bool:
    """`moe_router.route_tokens` with the RMSNorm against `llama.rms_norm` + `moe.route` here."""
    from jaxllm.kernels import moe_router
    from jaxllm.models.llama import rms_norm

    m, H = cfg.moe, cfg.hidden_size
    split = moe_router.mode() == "split"
    # the split form runs steps of up to SPLIT_TOKENS: a full block and a padding token there
    tokens, real = (moe_router.SPLIT_TOKENS, 1) if split else (TOKENS, REAL)
    if not moe_router.fits(tokens, H, m.num_experts, m.top_k, m.routing):
        return True  # never taken: nothing to check
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, H)), dtype)
    w = jnp.asarray(rng.standard_normal((H, m.num_experts)) / np.sqrt(H), dtype)
    ln = jnp.asarray(rng.standard_normal(H) * 0.1 + 1, dtype)
    valid = jnp.arange(tokens) < real
    try:
        splits = moe_router.default_splits(H, m.num_experts) if split else 1
        wts, ids, h = jax.jit(lambda x, w, ln, v: moe_router.route_tokens(
            x, w, v, m.top_k, m.routing, m.norm_topk_prob, rms_norm=(ln, cfg.rms_norm_eps),
            splits=splits))(x, w, ln, valid)
        want_h = rms_norm(x, ln, cfg.rms_norm_eps)
        # the routing of the kernel's own normed rows: the logits' sum order is all that differs
        want_w, want_ids = moe_router.route_tokens_ref(h, w, valid, m.top_k, m.routing, m.norm_topk_prob)
        ok = (_close(h, want_h, 1e-2) and _close(wts, want_w, 1e-3)
              and np.array_equal(np.asarray(ids), np.asarray(want_ids)))
        why = "disagrees with XLA's RMSNorm and router"
    except Exception as e:  # noqa: BLE001 - any failure: XLA's path instead
        ok, why = False, f"failed ({str(e)[:300]})"
    if not ok:
        log.warning("MoE router kernel %s at H=%d E=%d top_k=%d; XLA's router is used", why, H,
                    m.num_experts, m.top_k)
    return ok


def xla_rope_write(qkv, heads: tuple[int, int], q_norm, k_norm, eps: float, positions, inv_freq,
                   kv_pages, layer, slot_mapping) -> tuple[jax.Array, jax.Array]:
    """The model's XLA path that `rope_write.rope_write` replaces, same arguments and results:
    `llama.rms_norm` of the heads, `apply_rope`, `ref.write_kv` (the probe's reference and
    scripts/check_moe_kernels.py's)."""
    from jaxllm.kernels.ref import write_kv
    from jaxllm.models.llama import rms_norm
    from jaxllm.models.rope import apply_rope

    (H, K), (T, _), D = heads, qkv.shape, kv_pages.shape[-1]
    q, k, v = jnp.split(qkv, [H * D, (H + K) * D], axis=1)
    q, k = q.reshape(T, H, D), k.reshape(T, K, D)
    if q_norm is not None:  # models without head norms (Llama): RoPE only
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return q, write_kv(kv_pages, layer, k, v.reshape(T, K, D), slot_mapping)


def rope_write_ok(cfg: ModelConfig, dtype, page_size: int) -> bool:
    """`rope_write.rope_write` against the model's XLA path (`xla_rope_write`) here."""
    from jaxllm.kernels import rope_write
    from jaxllm.models.rope import rope_inv_freq

    if not cfg.qk_norm and rope_write.mode() != "all":
        return True  # never taken (`rope_write_small`)
    Hq, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pages = jnp.zeros((2, 2, K, 4, page_size, D), dtype)
    qkv = jnp.zeros((TOKENS, (Hq + 2 * K) * D), dtype)
    if not rope_write.fits(qkv, D, pages):
        return True
    rng = np.random.default_rng(1)
    qkv = jnp.asarray(rng.standard_normal(qkv.shape), dtype)
    qn, kn = (jnp.asarray(rng.standard_normal(D) * 0.1 + 1, dtype) for _ in range(2))
    if not cfg.qk_norm:
        qn = kn = None
    real = jnp.arange(TOKENS) < REAL
    pos = jnp.where(real, 100 + 37 * jnp.arange(TOKENS), -1).astype(jnp.int32)
    slots = jnp.where(real, 3 * jnp.arange(TOKENS), -1).astype(jnp.int32)
    inv, eps, layer = rope_inv_freq(cfg), cfg.rms_norm_eps, jnp.int32(1)
    try:
        q, got = jax.jit(lambda qkv, qn, kn, p: rope_write.rope_write(
            qkv, (Hq, K), qn, kn, eps, pos, inv, p, layer, slots))(qkv, qn, kn, pages)
        want_q, want = xla_rope_write(qkv, (Hq, K), qn, kn, eps, pos, inv, pages, layer, slots)
        ok = _close(q[:REAL], want_q[:REAL], 1e-2) and _close(got, want, 1e-2)
        why = "disagrees with XLA's head norms, RoPE and K/V write"
    except Exception as e:  # noqa: BLE001 - any failure: XLA's path instead
        ok, why = False, f"failed ({str(e)[:300]})"
    if not ok:
        log.warning("head-norm / RoPE / K/V-write kernel %s at H=%d K=%d D=%d; XLA's path is used",
                    why, Hq, K, D)
    return ok
