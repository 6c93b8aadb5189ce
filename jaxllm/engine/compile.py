"""Start-up compilation of the step: every bucket lowered in turn, compiled on a thread pool.

Tracing and lowering hold the GIL; XLA's compiler does not, so the buckets' compiles overlap
on a host with cores to spare (an H200 host has 16). The compiled executables are kept per
(tokens, rows) and called directly: a step outside them would fall back to the jitted
function and show as a trace in the engine's compile counter.

On accelerators JAX's persistent compilation cache is switched on (as vLLM keeps its compiled
graphs under ~/.cache/vllm), so a second engine in the same process or on the same machine
loads its executables instead of compiling them again.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax

from jaxllm.kernels.timing import compile_threads

log = logging.getLogger("jaxllm")

Pair = tuple[int, int]  # (token bucket, request bucket)


def cache_dir() -> str:
    root = os.environ.get("JAXLLM_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "jaxllm")
    return os.path.join(root, "xla")


def enable_persistent_cache(platform: str) -> str | None:
    """Point JAX's compilation cache at jaxllm's cache folder on accelerators, unless the user
    already chose one (`jax_compilation_cache_dir`) or set JAXLLM_CACHE_ROOT to "" (off).
    CPU runs (tests, CI) keep JAX's default: nothing written to disk."""
    if platform == "cpu" or os.environ.get("JAXLLM_CACHE_ROOT") == "":
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = cache_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    log.info("persistent compilation cache: %s (JAXLLM_CACHE_ROOT=\"\" turns it off)", path)
    return path


def compile_all(lower: Callable[[int, int], Any], pairs: list[Pair],
                threads: int | None = None) -> dict[Pair, Any]:
    """{pair: compiled executable}; lowering in order, XLA's compiles `threads` at a time."""
    threads = threads or compile_threads()
    t0 = time.perf_counter()
    lowered = [(p, lower(*p)) for p in pairs]
    t1 = time.perf_counter()

    def timed(item):
        p, low = item
        s = time.perf_counter()
        return p, low.compile(), time.perf_counter() - s

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="jaxllm-compile") as pool:
        done = list(pool.map(timed, lowered))
    t2 = time.perf_counter()
    slow = max(done, key=lambda d: d[2])
    log.info("compiled %d step shapes in %.1f s: lowering %.1f s, XLA %.1f s on %d threads "
             "(%.1f s of compiles; slowest (tokens %d, rows %d) %.1f s)", len(pairs), t2 - t0,
             t1 - t0, t2 - t1, threads, sum(d[2] for d in done), *slow[0], slow[2])
    return {p: c for p, c, _ in done}
