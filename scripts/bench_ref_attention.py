"""CPU timing of the plain-jnp reference attention (`kernels/ref.py`, the CPU path of every
test and of `scripts/eval_quant.py`) on SmolLM2's heads (9 query / 3 KV heads, head dim 64,
pages of 16): one 784-token prefill forward of one request (eval_quant's fixed text) and one
decode step of 64 requests at 1,000 tokens of context. Prints one JSON line, seconds a layer.

    JAX_PLATFORMS=cpu python scripts/bench_ref_attention.py [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import ref  # noqa: E402
from jaxllm.kernels.metadata import AttentionMetadata  # noqa: E402

S, K, H, D, LAYERS = 16, 3, 9, 64, 30


def case(num_tokens: int, num_reqs: int, ctx: int, prefill: bool):
    blocks = -(-ctx // S)
    kv = jax.random.normal(jax.random.key(0), (LAYERS, 2, K, num_reqs * blocks, S, D), jnp.float32)
    q = jax.random.normal(jax.random.key(1), (num_tokens, H, D), jnp.float32)
    if prefill:  # one request, its tokens at positions 0..ctx-1, padding at -1
        pos = np.full(num_tokens, -1, np.int32)
        pos[:ctx] = np.arange(ctx)
        req = np.zeros(num_tokens, np.int32)
        cu = np.array([0, ctx], np.int32)
    else:  # one token a request, at the end of its context
        pos = np.full(num_tokens, ctx - 1, np.int32)
        req = np.arange(num_tokens, dtype=np.int32)
        cu = np.arange(num_reqs + 1, dtype=np.int32)
    tables = np.arange(num_reqs * blocks, dtype=np.int32).reshape(num_reqs, blocks)
    md = AttentionMetadata(pos, req, pos.copy(), tables, np.full(num_reqs, ctx, np.int32), cu,
                           np.full(num_reqs, 1 if not prefill else ctx, np.int32))
    return q, kv, jax.device_put(md)


def per_layer(q, kv, md, reps: int) -> float:
    f = jax.jit(lambda q, kv, layer, md: ref.ragged_paged_attention(q, kv, layer, md, sm_scale=0.125))
    f(q, kv, jnp.int32(0), md).block_until_ready()
    t0 = time.perf_counter()
    for i in range(reps):
        f(q, kv, jnp.int32(i % LAYERS), md).block_until_ready()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    out = {"prefill_784_tokens_s": per_layer(*case(784, 1, 769, True), args.reps),
           "decode_64x1000_s": per_layer(*case(64, 64, 1000, False), args.reps),
           "backend": jax.default_backend(), "cpus": os.cpu_count()}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
