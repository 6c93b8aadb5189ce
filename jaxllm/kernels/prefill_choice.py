"""Which kernel runs prefill/mixed steps on a GPU: a probe per head shape, a measurement per bucket.

Hopper: the Mosaic prefill kernel (`mosaic_prefill.py`) when its shape rules hold and a
probe passes: the first time a step is traced for a (H, K, D, S, dtype), the kernel is
compiled and run on a small mixed batch (prefill chunk over a cached prefix, decode rows,
padding) and compared with `ref.py`; a lowering error, a runtime error or a wrong answer
logs why and falls back to the portable Pallas kernel (`pallas_ragged.py`, Triton), which
is also what non-Hopper GPUs use. The probe runs during start-up compilation (warm-up),
so no compile happens after it. fp8 pages (float8_e4m3fn / e5m2, `kv_cache_dtype="fp8*"`) and
int8 / int4 pages (once routed: `mosaic_prefill.INT_FORMATS`) are probed and measured on their
own (the page format joins the key: `page_name`), on pages of that format.

"auto" then chooses per token bucket by measurement (`measured_choice`): the first time a step
of T tokens is traced, both kernels run on one T-token prompt of this head shape (checked
against each other, then timed, median of a few runs, one measurement at a time); the Mosaic
kernel is kept where it is at least MOSAIC_MIN_SPEEDUP (1.15x) faster. The margin pays for
its compiles: each layer's Mosaic call compiles on its own (about 1.4 s per call site on an
H200 host, 32 per step shape for an 8B model), while one Triton kernel serves every layer
(1x2048 measured 176 vs 156 TFLOP/s, 1.13x: Pallas; 1x8192 494 vs 250: Mosaic;
docs/benchmarks.md). Buckets under JAXLLM_MOSAIC_MIN_TOKENS tokens (default 1024), where
attention is a small part of the step, keep the Pallas kernel unmeasured. A measurement that
fails falls back to the size rule that preceded it (Mosaic from 4,096 tokens), and so do
several processes (their programs must agree; timings need not).

JAXLLM_PREFILL_KERNEL: "auto" (the probe; the default), "mosaic" or "pallas" (forced).
"auto" became the default once the kernel passed `scripts/gpu_kernel.sh` on an H200
(2026-12-02, jax 0.11.2: correct on ragged batches and the probe's mixed batch, 494-563
TFLOP/s at 1x8192 / 1x32768 against the Pallas kernel's 250-280; docs/benchmarks.md).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.envs import env_int
from jaxllm.kernels import kv_quant, ref
from jaxllm.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)
DEFAULT_MODE = "auto"  # the probe picks the Mosaic kernel on Hopper (validated on an H200)
MOSAIC_MIN_TOKENS = 1024  # "auto": smaller steps keep the Pallas kernel unmeasured (docstring)
MOSAIC_MIN_SPEEDUP = 1.15  # "auto": the Mosaic kernel where measured at least this much faster
FALLBACK_MIN_TOKENS = 4096  # "auto" when a measurement fails: Mosaic from this many tokens


def mosaic_min_tokens() -> int:
    return env_int("JAXLLM_MOSAIC_MIN_TOKENS", MOSAIC_MIN_TOKENS, minimum=0)


def is_hopper() -> bool:
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", "") or "")
    return dev.platform == "gpu" and cc.split(".")[0] == "9"


def probe_case(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype,
               seed: int = 0):
    """A small mixed batch: a 150-token chunk over 200 cached tokens, 3 decode rows, a
    41-token prompt, 5 padding tokens and a padding request row; pages shuffled."""
    rng = np.random.default_rng(seed)
    reqs = [(350, 150), (37, 1), (90, 1), (41, 41), (300, 1)]
    n_pages = [-(-c // page_size) for c, _ in reqs]
    perm = rng.permutation(sum(n_pages) + 3)
    tables = np.zeros((len(reqs) + 1, max(n_pages)), np.int32)
    pos, req, qsl, used = [], [], [0], 0
    for r, (ctx, new) in enumerate(reqs):
        tables[r, :n_pages[r]] = perm[used:used + n_pages[r]]
        used += n_pages[r]
        pos += list(range(ctx - new, ctx))
        req += [r] * new
        qsl.append(qsl[-1] + new)
    pad = 5
    md = AttentionMetadata(
        positions=jnp.asarray(pos + [-1] * pad, jnp.int32),
        token_req=jnp.asarray(req + [0] * pad, jnp.int32),
        slot_mapping=jnp.full((len(pos) + pad,), -1, jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray([c for c, _ in reqs] + [0], jnp.int32),
        query_start_loc=jnp.asarray(qsl + [qsl[-1]], jnp.int32),
        num_seqs=jnp.asarray([len(reqs)], jnp.int32))
    q = jnp.asarray(rng.standard_normal((len(pos) + pad, num_heads, head_dim)), dtype)
    kv = jnp.asarray(rng.standard_normal(
        (1, 2, num_kv_heads, len(perm), page_size, head_dim)), dtype)
    return q, kv, md, len(pos)


def page_name(kv_pages: jax.Array, head_dim: int) -> str:
    """The key's page format: the dtype's name ("float8_e4m3fn", ...), "int8" / "int4" for the
    uint8 split layouts (kv_quant.py)."""
    fmt = kv_quant.page_format(kv_pages.dtype, kv_pages.shape[-1], head_dim)
    return fmt if fmt in ("int8", "int4") else jnp.dtype(kv_pages.dtype).name


def as_pages(kv: jax.Array, name: str | None) -> jax.Array:
    """Model-dtype pages `kv` stored as `name` pages (None: as they are): fp8 by a cast (scale
    1.0, as the engine stores them), int8 / int4 quantized into their split layout."""
    if not name:
        return kv
    if name in ("int8", "int4"):
        dtype, width = kv_quant.page_layout(name, kv.dtype, kv.shape[-1])
        return kv_quant.encode(kv, dtype, width)
    return kv.astype(jnp.dtype(name))


def run_probe(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
              dtype_name: str, interpret: bool = False,
              page_dtype_name: str | None = None) -> tuple[bool, str]:
    """Compile and run the Mosaic kernel on `probe_case` and compare with the reference.

    Runs in a thread of its own: the probe is reached while the engine's step is being
    traced, and a trace's context is per thread, so here the probe's arrays are concrete and
    the kernel is traced on its own (inside the step's trace, `ensure_compile_time_eval`
    evaluated the kernel body eagerly: `NameError: unbound axis name: b` on the H200)."""
    from jaxllm.kernels import mosaic_prefill

    def body():
        q, kv, md, real = probe_case(num_heads, num_kv_heads, head_dim, page_size,
                                     jnp.dtype(dtype_name))
        kv = as_pages(kv, page_dtype_name)  # fp8 / int pages: the reference reads the same ones
        scale = head_dim ** -0.5
        block_keys = 64 if interpret else None  # None: the kernel's default (128 for bf16)
        got = jax.jit(lambda q, kv, md: mosaic_prefill.ragged_prefill_attention(
            q, kv, jnp.int32(0), md, sm_scale=scale, block_keys=block_keys,
            interpret=interpret))(q, kv, md)
        want = jax.jit(lambda q, kv, md: ref.ragged_paged_attention(
            q, kv, jnp.int32(0), md, sm_scale=scale))(q, kv, md)
        return np.asarray(got, np.float32), np.asarray(want, np.float32), real

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            got, want, real = pool.submit(body).result()
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        if not np.isfinite(got).all() or err > 2e-2 or got[real:].any():
            return False, f"probe mismatch (rel err {err:.3g})"
        return True, f"probe rel err {err:.2g}"
    except Exception as e:  # noqa: BLE001 - any failure means: use the portable kernel
        return False, f"probe failed: {type(e).__name__}: {str(e)[:300]}"


@functools.lru_cache(maxsize=None)
def mosaic_prefill_ok(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                      dtype_name: str, page_dtype_name: str | None = None) -> tuple[bool, str]:
    """(usable, reason): the probe described in the module docstring; page_dtype_name: pages
    in another format than q's dtype (`page_name`: fp8, int8, int4)."""
    from jaxllm.kernels import mosaic_kv_quant, mosaic_prefill
    if not is_hopper():
        return False, "not a Hopper GPU"
    if dtype_name not in ("bfloat16", "float16"):
        return False, f"dtype {dtype_name} (the kernel takes 16-bit pages)"
    fp8 = page_dtype_name is not None  # pages converted into f16 tiles: fp8, int8, int4
    ints = page_dtype_name in mosaic_kv_quant.KERNEL_FORMATS
    if fp8 and page_dtype_name not in ("float8_e4m3fn", "float8_e5m2") and not ints:
        return False, f"{page_dtype_name} pages (the kernel takes q's dtype, fp8, int8, int4)"
    block_keys = mosaic_prefill.default_block_keys(head_dim, fp8, page_dtype_name or "")
    if not mosaic_prefill.supported(num_heads, num_kv_heads, head_dim, page_size, block_keys, fp8):
        return False, f"shape H={num_heads} K={num_kv_heads} D={head_dim} S={page_size}"
    if ints:  # the pages' shape and dtype are all the geometry needs
        dtype, width = kv_quant.page_layout(page_dtype_name, jnp.dtype(dtype_name), head_dim)
        pages = jax.ShapeDtypeStruct((1, 2, num_kv_heads, 1, page_size, width), dtype)
        try:
            mosaic_prefill.int_pages(pages, head_dim, block_keys)
        except ValueError as e:
            return False, str(e)
    return run_probe(num_heads, num_kv_heads, head_dim, page_size, dtype_name,
                     page_dtype_name=page_dtype_name)


def prompt_case(T: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype):
    """One T-token prompt from scratch (a prefill bucket's typical step), pages shuffled."""
    rng = np.random.default_rng(T)
    pages = -(-T // page_size)
    md = AttentionMetadata(
        positions=jnp.arange(T, dtype=jnp.int32), token_req=jnp.zeros((T,), jnp.int32),
        slot_mapping=jnp.full((T,), -1, jnp.int32),
        block_tables=jnp.asarray(rng.permutation(pages)[None, :], jnp.int32),
        seq_lens=jnp.asarray([T], jnp.int32), query_start_loc=jnp.asarray([0, T], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32))
    q = jnp.asarray(rng.standard_normal((T, num_heads, head_dim)), dtype)
    kv = jnp.asarray(rng.standard_normal((1, 2, num_kv_heads, pages, page_size, head_dim)), dtype)
    return q, kv, md


def time_kernels(fns: dict, q, kv, md, reps: int = 5, chain: int = 8) -> dict[str, float]:
    """Median seconds per call of each fn(q, kv, md) after one checked run: every output must
    be finite and within 2e-2 (relative) of the first fn's, else that fn is left out. Each of
    the `reps` timings is one jitted loop of `chain` dependent calls (`timing.chained`): timed a
    call at a time, the warm-up's figures carried the host's dispatch, slowed by the compiles
    running beside it, and on an H200 (session 26) the same kernel read 0.205, 0.320 and 0.596
    ms at 1,024 tokens in three start-ups, flipping the choice."""
    from jaxllm.kernels.timing import time_checked
    return time_checked(fns, (q, kv, md), reps, "prefill kernel", f" at T={q.shape[0]}", chain=chain)


_measure_lock = threading.Lock()  # warm-up traces buckets on a thread pool: time one at a time


def _measure(T: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             dtype_name: str, page_dtype_name: str | None = None) -> dict[str, float]:
    from jaxllm.kernels import mosaic_prefill, pallas_ragged

    scale = head_dim ** -0.5
    fns = {"pallas": lambda q, kv, md: pallas_ragged.ragged_paged_attention(
               q, kv, jnp.int32(0), md, sm_scale=scale),
           "mosaic": lambda q, kv, md: mosaic_prefill.ragged_prefill_attention(
               q, kv, jnp.int32(0), md, sm_scale=scale)}

    def body():
        with _measure_lock:
            q, kv, md = prompt_case(T, num_heads, num_kv_heads, head_dim, page_size,
                                    jnp.dtype(dtype_name))
            kv = as_pages(kv, page_dtype_name)  # fp8 / int pages: both kernels read them
            return time_kernels(fns, q, kv, md)

    # A thread of its own, as the probe's: reached while a step is traced (`run_probe`).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(body).result()


@functools.lru_cache(maxsize=None)
def measured_choice(T: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                    dtype_name: str, page_dtype_name: str | None = None) -> tuple[str, str]:
    """("mosaic" or "pallas", why) for steps of T tokens, by measurement (module docstring).

    Several processes take the size rule instead: each compiles the step on its own, and
    timings near the margin could pick different kernels in different processes' programs."""
    if jax.process_count() > 1:
        return ("mosaic" if T >= FALLBACK_MIN_TOKENS else "pallas",
                f"several processes: size rule, Mosaic from {FALLBACK_MIN_TOKENS} tokens")
    try:
        times = _measure(T, num_heads, num_kv_heads, head_dim, page_size, dtype_name,
                         page_dtype_name)
    except Exception as e:  # noqa: BLE001 - no figure: the size rule
        pick = "mosaic" if T >= FALLBACK_MIN_TOKENS else "pallas"
        return pick, (f"measurement failed ({type(e).__name__}: {str(e)[:200]}); "
                      f"size rule: Mosaic from {FALLBACK_MIN_TOKENS} tokens")
    if "pallas" not in times or "mosaic" not in times:
        pick = "pallas" if "pallas" in times or "mosaic" not in times else "mosaic"
        return pick, f"measured {sorted(times)} only (the other gave a wrong result)"
    speedup = times["pallas"] / times["mosaic"]
    pick = "mosaic" if speedup >= MOSAIC_MIN_SPEEDUP else "pallas"
    return pick, (f"measured Mosaic {times['mosaic'] * 1e3:.3f} ms, Pallas {times['pallas'] * 1e3:.3f} ms "
                  f"({speedup:.2f}x; Mosaic from {MOSAIC_MIN_SPEEDUP}x)")


def prefill_kernel(q: jax.Array, kv_pages: jax.Array) -> str:
    """"mosaic" or "pallas" for a prefill/mixed step of these shapes (static under jit)."""
    mode = os.environ.get("JAXLLM_PREFILL_KERNEL", DEFAULT_MODE)
    if mode not in ("auto", "mosaic", "pallas"):
        raise ValueError(f"JAXLLM_PREFILL_KERNEL must be auto, mosaic or pallas, got {mode!r}")
    key = (q.shape[1], kv_pages.shape[2], q.shape[2], kv_pages.shape[4], jnp.dtype(q.dtype).name)
    if jnp.dtype(kv_pages.dtype) != jnp.dtype(q.dtype):  # fp8 / int pages: probed, measured as such
        key += (page_name(kv_pages, q.shape[2]),)
    shape = "H=%d K=%d D=%d S=%d %s" % key[:5] + (f", {key[5]} pages" if len(key) > 5 else "")
    T = q.shape[0]
    if mode == "auto" and T < mosaic_min_tokens():
        if (key, "small") not in _logged:
            _logged.add((key, "small"))
            log.info("prefill/mixed attention for %s, steps under %d tokens: "
                     "portable Pallas kernel (Triton)", shape, mosaic_min_tokens())
        return "pallas"
    if mode == "auto":
        ok, why = mosaic_prefill_ok(*key)
        if ok:
            pick, how = measured_choice(T, *key)
            ok, why = pick == "mosaic", f"{why}; {T}-token steps: {how}"
        log_key = (key, T)
    else:
        explicit = "JAXLLM_PREFILL_KERNEL" in os.environ
        ok = mode == "mosaic"
        why = f"JAXLLM_PREFILL_KERNEL={mode}" + ("" if explicit else " (default)")
        log_key = key
    if log_key not in _logged:
        _logged.add(log_key)
        log.info("prefill/mixed attention for %s: %s (%s)", shape,
                 "Mosaic GPU prefill kernel" if ok else "portable Pallas kernel (Triton)", why)
    return "mosaic" if ok else "pallas"


_logged: set = set()
