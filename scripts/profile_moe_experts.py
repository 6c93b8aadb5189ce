"""One `moe.experts` call (sort, expert MLP, unsort, combine) at a prefill's rows, profiled: wall
time a call (10 calls in flight) and GPU time per kernel, for a few grouped-matmul candidates.

Session 34 (H100) found with it that XLA fused the slot-major gather's index computation into
the combine's reduction (3.1 ms beside 1.1 ms of ws kernels at 65,536 rows), since fixed
(`moe_gmm_mosaic.gather_rows`). Qwen3-30B-A3B's expert shape, random routing:

    python scripts/profile_moe_experts.py [--tokens 8192] [--impls tiles128_128x64w8s3 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.models import gmm, moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--impls", nargs="+",
                    default=["tiles128_128x64w8s3", "wsglu128_128x64s4d256", "ws128_256x64s3"])
    args = ap.parse_args()
    from bench_kernels import gpu_kernels

    E, H, F, k, T = 128, 2048, 768, 8, args.tokens
    cands = gmm.candidates(T * k, E, H, F, engine=True)
    key = jax.random.key(0)
    wg = (jax.random.normal(key, (E, H, F)) / np.sqrt(H)).astype(jnp.bfloat16)
    wu = (jax.random.normal(jax.random.key(1), (E, H, F)) / np.sqrt(H)).astype(jnp.bfloat16)
    wd = (jax.random.normal(key, (E, F, H)) / np.sqrt(F)).astype(jnp.bfloat16)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :k], jnp.int32)
    wts = jnp.ones((T, k), jnp.float32)
    x = jax.random.normal(key, (T, H)).astype(jnp.bfloat16)
    for name in args.impls:
        if name not in cands:
            print(name, "not a candidate here", flush=True)
            continue
        f = jax.jit(lambda *a, impl=cands[name]: moe.experts(*a, gmm=impl))
        a = (x, wts, ids, wg, wu, wd)
        jax.block_until_ready(f(*a))
        t0 = time.perf_counter()
        outs = [f(*a) for _ in range(10)]
        jax.block_until_ready(outs)
        wall = (time.perf_counter() - t0) / 10
        per = gpu_kernels(lambda: f(*a), calls=3)
        top = {q[:40]: round(v * 1e6) for q, v in sorted(per.items(), key=lambda kv: -kv[1])[:7]}
        print(name, "wall/call us", round(wall * 1e6), "GPU busy", round(sum(per.values()) * 1e6), top,
              flush=True)


if __name__ == "__main__":
    main()
