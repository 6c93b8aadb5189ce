"""Rotary position embeddings: the inverse frequencies of a config (Llama-3.1 and linear scaling)
and the rotate-half rotation HF's Llama family applies."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2], with Llama-3.1 or linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_llama3 is not None:
        factor, low, high, orig = cfg.rope_llama3
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / low, orig / high
        smooth = (orig / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    if cfg.rope_linear_factor is not None:
        inv = inv / cfg.rope_linear_factor
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (the HF convention) on x [T, H, D]."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
