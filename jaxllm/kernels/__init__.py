"""Attention backends behind one signature: fn(q, kv_pages, layer, md, *, sm_scale) -> out.

Backends:
  reference  plain jnp (ref.py): the CPU path and the definition the kernels are tested against;
  pallas     portable Pallas kernel (pallas_ragged.py): Triton on GPU, interpret mode on CPU;
  mosaic     Hopper: the decode kernel (mosaic_decode.py) for steps whose token bucket is no
             larger than the request bucket (T <= R: decode steps) on bf16, fp8, int8 and int4
             pages (int pages only for formats in `mosaic_kv_quant.INT_FORMATS`: int4, and
             in the shapes `mosaic_kv_quant.reads_pages` names; others: the
             Pallas kernel for every step), the ragged prefill kernel
             (mosaic_prefill.py) for prefill/mixed steps when prefill_choice.py picks it
             (JAXLLM_PREFILL_KERNEL=auto, the default: a start-up probe, validated on an
             H200), else the portable Pallas kernel for those.
None picks by platform: cpu -> reference, Hopper GPU -> mosaic, other GPUs -> pallas.

Why T <= R is a static, always-correct switch: the Mosaic kernel handles every token on
its own (its request from token_req, its keys from its position), so it is exact for
any batch; T <= R only bounds its cost by that of a decode batch of T rows. Larger
token buckets carry prefill chunks, where reading each context once per token would
be quadratic, so they go to the prefill path.

Prefill/mixed path on GPU (docs/kernels.md): the Mosaic prefill kernel on Hopper, chosen per
head shape by `prefill_choice.prefill_kernel`; the Pallas kernel (Triton) otherwise, which
beat XLA gather-then-attend 0.64 ms to 27.4 ms on a mixed step (H200, 2026-11-30).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.kernels import ref

log = logging.getLogger(__name__)

AttentionFn = Callable[..., jax.Array]
BACKENDS = ("reference", "pallas", "mosaic")


def _pallas_fn(interpret: bool | None = None) -> AttentionFn:
    from jaxllm.kernels import pallas_ragged
    return functools.partial(pallas_ragged.ragged_paged_attention, interpret=interpret)


def gpu_prefill_attention(q, kv_pages, layer, md, *, sm_scale: float) -> jax.Array:
    """Prefill/mixed step on a GPU: the Mosaic prefill kernel where its probe passed, else
    the portable Pallas kernel (chosen from static shapes at trace time)."""
    from jaxllm.kernels import kv_quant, mosaic_prefill, prefill_choice
    # The Mosaic prefill kernel reads pages in q's dtype, fp8, int8 and int4 pages; int formats go
    # to it only once routed (mosaic_prefill.INT_FORMATS, after a GPU check), others: Pallas.
    fmt = kv_quant.page_format(kv_pages.dtype, kv_pages.shape[-1], q.shape[-1])
    if (fmt in ("plain", "fp8") or fmt in mosaic_prefill.INT_FORMATS) and \
            prefill_choice.prefill_kernel(q, kv_pages) == "mosaic":
        return mosaic_prefill.ragged_prefill_attention(q, kv_pages, layer, md, sm_scale=sm_scale)
    return _pallas_fn()(q, kv_pages, layer, md, sm_scale=sm_scale)


def _prefill_fn(platform: str) -> AttentionFn:
    return gpu_prefill_attention if platform == "gpu" else ref.ragged_paged_attention


def mosaic_attention(q, kv_pages, layer, md, *, sm_scale: float,
                     prefill_fn: AttentionFn = ref.ragged_paged_attention,
                     queries_per_request: int = 1) -> jax.Array:
    """Decode kernel when T <= R (shapes are static under jit), else `prefill_fn`.

    queries_per_request > 1 (speculative decoding: k + 1): the decode kernel takes up to that
    many consecutive tokens of a request in one CTA, so verifying k drafts reads the request's
    pages once, not k + 1 times (decode_schedule.items)."""
    from jaxllm.kernels import kv_quant, mosaic_decode, mosaic_kv_quant
    fmt = kv_quant.page_format(kv_pages.dtype, kv_pages.shape[-1], q.shape[-1])
    if fmt in ("int8", "int4") and not mosaic_kv_quant.reads_pages(kv_pages, q.shape[-1]):
        # int pages the decode kernel does not read: the prefill/mixed kernel (Pallas) reads
        # them for every step, dequantizing in registers (kv_quant.py).
        return prefill_fn(q, kv_pages, layer, md, sm_scale=sm_scale)
    if kv_pages.dtype.itemsize == 4:
        # float32 pages: the decode kernel's TMA swizzle is laid out for 16- and 8-bit rows
        # (a float32 engine failed to lower it on an H200): the prefill/mixed path's kernel.
        return prefill_fn(q, kv_pages, layer, md, sm_scale=sm_scale)
    group = q.shape[1] // kv_pages.shape[2]
    num_tokens, num_reqs = q.shape[0], md.block_tables.shape[0]
    if num_tokens <= num_reqs and decode_head_dim_ok(q.shape[2], kv_pages.dtype):
        g = _pow2(group)  # a group that is no power of two (SmolLM2: 9 q / 3 kv heads) padded
        qpi = max(min(queries_per_request, mosaic_decode.ROWS // g), 1)
        dst = decode_deq_stages()
        qk8 = decode_qk_fp8() and kv_pages.dtype == jnp.float8_e4m3fn and qpi == 1 and not dst
        fn = functools.partial(mosaic_decode.paged_decode_attention, queries_per_item=qpi,
                               deq_stages=dst, qk_fp8=qk8)
        if g != group:
            return padded_group(fn, q, kv_pages, layer, md, sm_scale=sm_scale)
        return fn(q, kv_pages, layer, md, sm_scale=sm_scale)
    if group & (group - 1) or q.shape[2] & (q.shape[2] - 1):
        # Triton lowering needs power-of-two blocks: these models' other steps (prefill,
        # mixed) take the reference.
        return ref.ragged_paged_attention(q, kv_pages, layer, md, sm_scale=sm_scale)
    from jaxllm.kernels import mixed_split
    if mixed_split.mode() == "decode" and _split_ok(q, kv_pages, prefill_fn):
        mixed_split.log_once((num_tokens, num_reqs))
        return mixed_split.split_decode_rows(q, kv_pages, layer, md, sm_scale=sm_scale,
                                             decode_fn=mosaic_decode.paged_decode_attention,
                                             prefill_fn=prefill_fn)
    return prefill_fn(q, kv_pages, layer, md, sm_scale=sm_scale)


def decode_deq_stages() -> int:
    """JAXLLM_DECODE_DEQ_STAGES: 0 (default) the decode kernel's consumer converts quantized
    tiles itself; d > 0 its producer warpgroup converts them into a d-deep f16 ring
    (`mosaic_decode.paged_decode_attention(deq_stages=d)`; slower on an H100 in session 25,
    so opt-in)."""
    from jaxllm.envs import env_int
    return env_int("JAXLLM_DECODE_DEQ_STAGES", 0, minimum=0)


def decode_qk_fp8() -> bool:
    """JAXLLM_DECODE_QK_FP8=1 (an experiment, off by default): on e4m3 pages the decode kernel
    rounds the query to e4m3 and multiplies it with the K pages as stored (vLLM's
    FlashAttention-3 path quantizes q for fp8 caches the same way), so only V is converted;
    rounding q costs about as much accuracy as the e4m3 keys themselves
    (`mosaic_decode.paged_decode_attention(qk_fp8=True)`)."""
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_DECODE_QK_FP8", "0", ("0", "1")) == "1"


def fp8_gemm_tiling() -> str:
    """JAXLLM_FP8_GEMM: "" (default) prefill-sized fp8 W8A8 matmuls take the warp-specialized
    kernel of `kernels/fp8_gemm_ws.py` where the warm-up measured it faster than XLA's fp8 GEMM
    (Hopper, one device; `quantization/choice.measure_gemm`); "xla" always XLA's fp8 GEMM; a
    tiling name of that file (e.g. "fg_128x256x128s3b8") always that kernel, unmeasured."""
    from jaxllm.envs import env_choice
    from jaxllm.kernels.fp8_gemm_ws import BY_NAME
    return env_choice("JAXLLM_FP8_GEMM", "", ("", "xla", *BY_NAME))


def decode_head_dim_ok(head_dim: int, page_dtype) -> bool:
    """Head dims the Mosaic decode kernel is checked at on an H200, bf16 and fp8 pages
    (scripts/check_decode_shapes.py): 128 and 64."""
    del page_dtype  # (both page dtypes it reads pass at both)
    return head_dim in (64, 128)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def padded_group(fn: AttentionFn, q, kv_pages, layer, md, *, sm_scale: float) -> jax.Array:
    """`fn` on q with each KV head's G query heads padded by zero heads to the next power of two,
    the padding heads' outputs dropped: q [T, K * G, D] -> [T, K * G, D] (the decode kernel's
    per-head TMA copies failed to lower for SmolLM2's G = 3 on an H200; padded they are checked)."""
    import jax.numpy as jnp
    T, H, D = q.shape
    K = kv_pages.shape[2]
    G, G2 = H // K, _pow2(H // K)
    q4 = jnp.pad(q.reshape(T, K, G, D), ((0, 0), (0, 0), (0, G2 - G), (0, 0)))
    out = fn(q4.reshape(T, K * G2, D), kv_pages, layer, md, sm_scale=sm_scale)
    return out.reshape(T, K, G2, D)[:, :, :G].reshape(T, H, D)


def _split_ok(q, kv_pages, prefill_fn: AttentionFn) -> bool:
    """The split (mixed_split.py) only where the mixed kernel is the portable Pallas one: the
    Mosaic prefill kernel's handling of padding tokens inside a request is not verified."""
    if not decode_head_dim_ok(q.shape[2], kv_pages.dtype):  # the decode kernel's rows
        return False
    if prefill_fn is not gpu_prefill_attention:
        return prefill_fn is ref.ragged_paged_attention
    from jaxllm.kernels import prefill_choice
    return prefill_choice.prefill_kernel(q, kv_pages) == "pallas"


def _hopper() -> bool:
    from jaxllm.kernels import prefill_choice
    try:
        return prefill_choice.is_hopper()
    except Exception:  # noqa: BLE001 - no device to ask: keep the Hopper default
        return True


def _normalize_platform(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def get_attention_fn(backend: str | None, platform: str, queries_per_request: int = 1) -> AttentionFn:
    """Resolve an attention backend for `platform` ("cpu", "gpu"/"cuda", "tpu"); logs the choice.
    `queries_per_request`: see `mosaic_attention` (the mosaic backend only)."""
    platform = _normalize_platform(platform)
    if backend is None:
        backend = "reference" if platform != "gpu" else "mosaic" if _hopper() else "pallas"
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
        fn = functools.partial(mosaic_attention, prefill_fn=_prefill_fn(platform),
                               queries_per_request=queries_per_request)
        detail = ("Mosaic GPU decode kernel for decode steps (T <= R%s); prefill/mixed steps: "
                  "see prefill_choice (Mosaic prefill kernel or Pallas)"
                  % (f", up to {queries_per_request} tokens of a request per CTA"
                     if queries_per_request > 1 else ""))
    log.info("attention backend: %s (%s, %s on %s)", backend, how, detail, platform)
    return fn
