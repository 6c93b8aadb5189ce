"""The decode kernel's grid schedule, apart from the kernel (`mosaic_decode.py`): how many
context splits a batch gets (`default_config` at trace time, `active_splits` at run time), how
speculative verification cuts a batch into items of consecutive tokens (`items`), and the merge
of split partials (`combine`, one XLA fusion)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.kernels.metadata import AttentionMetadata


def split_cap() -> int:
    """The most context splits a (token, KV head) pair gets: JAXLLM_DECODE_MAX_SPLITS (a power of
    two), default 32. At 16 a batch-1 step of a model with 4 KV heads filled 64 of 132 SMs; at 32
    it fills 128 (Qwen3-30B-A3B batch 1 on session 39's H100: the decode kernel 0.32-0.33 ms a
    step against 0.36 at 16, `scripts/gpu_session38.sh a`). Models with 8 KV heads or more split
    16 ways at most either way (the wave rule of `default_config`)."""
    from jaxllm.envs import env_int
    n = env_int("JAXLLM_DECODE_MAX_SPLITS", 32, minimum=1)
    if n & (n - 1):
        raise ValueError(f"JAXLLM_DECODE_MAX_SPLITS must be a power of two, got {n}")
    return n


def default_config(num_tokens: int, num_kv_heads: int, num_sms: int = 132) -> tuple[int, int]:
    """(splits, stages) for a decode batch; see docs/kernels.md for the measurements.

    Enough (token, head) pairs: no split, 3 stages = 112 KB of SMEM, so two CTAs share an
    SM and one's prologue/epilogue latency hides under the other's stream. Few pairs:
    split the context until one wave fills the SMs, with deep pipelines (one CTA per SM).
    """
    pairs = num_tokens * num_kv_heads
    if pairs >= num_sms:
        return 1, 3
    splits, most = 1, split_cap()
    while splits < most and pairs * splits * 2 <= num_sms:
        splits *= 2
    return splits, 6 if splits == 1 else 5


def active_splits(positions: jax.Array, num_kv_heads: int, max_splits: int,
                  num_sms: int = 132) -> jax.Array:
    """[2] int32: (`default_config`'s split count for the real tokens, real tokens).

    A step compiled for T tokens may carry only one real token (a batch of 1 padded
    to 8), so the count is chosen at run time. Real tokens come first (padding ends
    the batch), which lets the kernel map a flat CTA index onto them.
    """
    real = jnp.sum(positions >= 0).astype(jnp.int32)
    pairs = real * num_kv_heads
    n = jnp.int32(1)
    c = 2
    while c <= max_splits:
        n = jnp.where(pairs * c <= num_sms, c, n)  # as default_config's doubling rule
        c *= 2
    return jnp.stack([n, real])


def combine(o_part: jax.Array, lse: jax.Array, group: int, dtype,
            valid: jax.Array | None = None) -> jax.Array:
    """Merge split partials: o_part [N, T, K, G, D] f32, lse [N, T, K, 64] (log2) -> [T, H, D].

    valid [N, T] marks the partials the kernel wrote; the others hold whatever the
    buffer held (a skipped CTA writes nothing) and weigh 0.
    """
    lse = lse[..., :group]  # [N, T, K, G]
    if valid is not None:
        lse = jnp.where(valid[:, :, None, None], lse, -jnp.inf)
        o_part = jnp.where(valid[:, :, None, None, None], o_part, 0.0)
    top = lse.max(axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # all splits empty (padding) -> weights 0
    w = jnp.exp2(lse - top)
    num = jnp.einsum("ntkg,ntkgd->tkgd", w, o_part)
    den = w.sum(axis=0)
    out = num / jnp.where(den == 0.0, 1.0, den)[..., None]
    return out.reshape(out.shape[0], -1, out.shape[-1]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Items:
    """A batch's tokens cut into items of up to qpi consecutive tokens of one request (a
    request's tokens are consecutive in the batch, at consecutive positions). Real items come
    first, in token order, as real tokens do."""

    tok0: jax.Array  # [T] the item's first token; unused items 0
    req: jax.Array  # [T] the item's request row; unused items 0
    first: jax.Array  # [T] position of its first token; unused items -1
    last: jax.Array  # [T] position of its last token; unused items -1
    item_of: jax.Array  # [T] each token's item; padding tokens 0
    offset: jax.Array  # [T] each token's index in its item


def items(md: AttentionMetadata, qpi: int) -> Items:
    T = md.positions.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    valid = md.positions >= 0
    req = md.token_req.astype(jnp.int32)
    start = md.query_start_loc[req]
    i = t - start  # index of each token in its request's new tokens
    is_start = valid & (i % qpi == 0)
    item_of = jnp.where(valid, jnp.cumsum(is_start.astype(jnp.int32)) - 1, 0)
    count = jnp.minimum(qpi, md.query_start_loc[req + 1] - start - i)  # tokens in the item
    slot = jnp.where(is_start, item_of, T)  # scatters of the item starts; the rest dropped
    put = lambda fill, v: jnp.full((T,), fill, jnp.int32).at[slot].set(v.astype(jnp.int32), mode="drop")
    return Items(tok0=put(0, t), req=put(0, req), first=put(-1, md.positions),
                 last=put(-1, md.positions + count - 1), item_of=item_of, offset=jnp.where(valid, i % qpi, 0))
