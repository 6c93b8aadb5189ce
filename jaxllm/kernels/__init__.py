"""Attention backends behind one signature: fn(q, kv_pages, layer, md, *, sm_scale) -> out.

Backends:
  reference  plain jnp (ref.py): the CPU path and the definition the kernels are tested against;
  pallas     portable Pallas kernel (pallas_ragged.py): Triton on GPU, interpret mode on CPU;
  mosaic     Hopper decode kernel (mosaic_decode.py) for steps whose token bucket is no larger
             than the request bucket (T <= R: decode steps), the prefill/mixed path otherwise.
None picks by platform: cpu -> reference, gpu -> mosaic.

Why T <= R is a static, always-correct switch: the Mosaic kernel handles every token on
its own (its request from token_req, its keys from its position), so it is exact for
any batch; T <= R only bounds its cost by that of a decode batch of T rows. Larger
token buckets carry prefill chunks, where reading each context once per token would
be quadratic, so they go to the prefill path.

Prefill/mixed path on GPU: `_GPU_PREFILL` below, set by measurement (docs/kernels.md):
on an H200, a step of 4 prefill chunks of 512 tokens + 60 decode rows at context 2048
(Llama-3-8B heads, bf16) took 0.64 ms with the Pallas kernel and 27.4 ms with XLA
gather-then-attend (scripts/bench_kernels.py --mixed, 2026-11-30).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax

from jaxllm.kernels import ref

log = logging.getLogger(__name__)

AttentionFn = Callable[..., jax.Array]
BACKENDS = ("reference", "pallas", "mosaic")
# Prefill/mixed steps on GPU: "pallas" or "reference" (XLA gather-then-attend), by measurement.
_GPU_PREFILL = "pallas"


def _pallas_fn(interpret: bool | None = None) -> AttentionFn:
    from jaxllm.kernels import pallas_ragged
    return functools.partial(pallas_ragged.ragged_paged_attention, interpret=interpret)


def _prefill_fn(platform: str) -> AttentionFn:
    if platform == "gpu" and _GPU_PREFILL == "pallas":
        return _pallas_fn()
    return ref.ragged_paged_attention


def mosaic_attention(q, kv_pages, layer, md, *, sm_scale: float,
                     prefill_fn: AttentionFn = ref.ragged_paged_attention) -> jax.Array:
    """Decode kernel when T <= R (shapes are static under jit), else `prefill_fn`."""
    from jaxllm.kernels import kv_quant, mosaic_decode
    if kv_quant.is_quantized(kv_pages, q.shape[-1]):
        # The decode kernel's TMA/wgmma path takes bf16 pages only; quantized pages go to
        # the prefill/mixed kernel, which dequantizes them in registers (kv_quant.py).
        return prefill_fn(q, kv_pages, layer, md, sm_scale=sm_scale)
    group = q.shape[1] // kv_pages.shape[2]
    if group & (group - 1) or q.shape[2] & (q.shape[2] - 1):
        # Triton lowering needs power-of-two blocks and the decode kernel was only
        # validated on such shapes (an H200 run with SmolLM2's 9 q / 3 kv heads failed
        # to lower): use the reference for these models.
        return ref.ragged_paged_attention(q, kv_pages, layer, md, sm_scale=sm_scale)
    num_tokens, num_reqs = q.shape[0], md.block_tables.shape[0]
    if num_tokens <= num_reqs:
        return mosaic_decode.paged_decode_attention(q, kv_pages, layer, md, sm_scale=sm_scale)
    return prefill_fn(q, kv_pages, layer, md, sm_scale=sm_scale)


def _normalize_platform(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def get_attention_fn(backend: str | None, platform: str) -> AttentionFn:
    """Resolve an attention backend for `platform` ("cpu", "gpu"/"cuda", "tpu"); logs the choice."""
    platform = _normalize_platform(platform)
    if backend is None:
        backend = "mosaic" if platform == "gpu" else "reference"
        how = "auto"
    else:
        how = "requested"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    if backend == "mosaic" and platform != "gpu":
        raise ValueError(f"the mosaic backend needs an NVIDIA Hopper GPU, not {platform!r}")
    if backend == "reference":
        fn, detail = ref.ragged_paged_attention, "jnp gather-then-attend"
    elif backend == "pallas":
        fn = _pallas_fn(interpret=platform == "cpu")
        detail = "interpret mode" if platform == "cpu" else "Triton lowering"
    else:
        fn = functools.partial(mosaic_attention, prefill_fn=_prefill_fn(platform))
        detail = f"Mosaic GPU decode kernel for T <= R, {_GPU_PREFILL} for prefill/mixed"
    log.info("attention backend: %s (%s, %s on %s)", backend, how, detail, platform)
    return fn
