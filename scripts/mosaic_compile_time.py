"""Where the Mosaic prefill kernel's start-up time goes, on one GPU (issue 14).

    python3 scripts/mosaic_compile_time.py [--tokens 256 2048 8192] [--layers 8]

For each token count T (one prompt of T tokens, 64 request rows, Llama-3-8B heads, page 16),
times jit lowering, XLA compile and the first run of:
  * cond:    the engine's wrapper (`ragged_prefill_attention`: a lax.cond between the aligned
             and the relabeled call, i.e. two kernels),
  * direct:  the kernel alone on the aligned layout (one kernel),
  * again:   `direct` once more from a fresh jit of a new function (does a second compile of the
             identical kernel cost again?),
  * layersN: N calls of the direct kernel in one program (different layer operands, the same
             kernel text: the unrolled engine step's case),
  * pallas:  the portable Pallas kernel, for comparison.
One JSON line per (T, variant): lower_s, compile_s, first_run_s. No persistent cache unless
--cache-dir names one.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import mosaic_prefill, pallas_ragged  # noqa: E402
from jaxllm.kernels.metadata import AttentionMetadata  # noqa: E402

H, K, D, S, R = 32, 8, 128, 16, 64


def case(T: int):
    pages = -(-T // S)
    rng = np.random.default_rng(0)
    tables = np.zeros((R, max(pages, 1)), np.int32)
    tables[0, :pages] = rng.permutation(pages)
    qsl = np.full((R + 1,), T, np.int32)
    qsl[0] = 0
    md = AttentionMetadata(
        positions=jnp.arange(T, dtype=jnp.int32), token_req=jnp.zeros((T,), jnp.int32),
        slot_mapping=jnp.full((T,), -1, jnp.int32), block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray([T] + [0] * (R - 1), jnp.int32), query_start_loc=jnp.asarray(qsl),
        num_seqs=jnp.asarray([1], jnp.int32))
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, 2, K, pages, S, D)), jnp.bfloat16)
    return q, kv, md


def variants(layers: int):
    scale = D ** -0.5
    direct = functools.partial(mosaic_prefill._attend, sm_scale=scale, block_keys=128, num_stages=2,
                               interpret=False, semantics=None)

    def one(q, kv, md, layer=0):
        return direct(q, md.query_start_loc, md.positions, kv_pages=kv, layer=jnp.int32(layer), md=md)

    def many(q, kv, md):
        out = q
        for i in range(layers):  # each call's output feeds the next: nothing is dead code
            out = one(out, kv, md, i % 2)
        return out

    return {
        "cond": lambda q, kv, md: mosaic_prefill.ragged_prefill_attention(q, kv, jnp.int32(0), md, sm_scale=scale),
        "direct": one,
        "again": lambda q, kv, md: one(q, kv, md),
        f"layers{layers}": many,
        "pallas": lambda q, kv, md: pallas_ragged.ragged_paged_attention(q, kv, jnp.int32(0), md, sm_scale=scale),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 2048, 8192])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--only", nargs="*", default=None, help="variant names to run")
    p.add_argument("--cache-dir", default=None,
                   help="JAX's persistent compilation cache here (run twice: is a Mosaic kernel's "
                        "compile kept?)")
    args = p.parse_args()
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    print(json.dumps({"jax": jax.__version__, "device": str(jax.devices()[0])}), flush=True)
    for T in args.tokens:
        q, kv, md = case(T)
        for name, fn in variants(args.layers).items():
            if args.only and name not in args.only:
                continue
            row = {"T": T, "variant": name}
            try:
                t0 = time.perf_counter()
                lowered = jax.jit(fn).lower(q, kv, md)
                t1 = time.perf_counter()
                compiled = lowered.compile()
                t2 = time.perf_counter()
                jax.block_until_ready(compiled(q, kv, md))
                t3 = time.perf_counter()
                jax.block_until_ready(compiled(q, kv, md))
                t4 = time.perf_counter()
                row.update(lower_s=round(t1 - t0, 3), compile_s=round(t2 - t1, 3),
                           first_run_s=round(t3 - t2, 3), second_run_s=round(t4 - t3, 4))
            except Exception as e:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
