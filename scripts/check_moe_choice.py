"""The engine's grouped-matmul choice at prefill-sized row counts, as its warm-up makes it, alone.

`gmm.Chooser.measure` on one Qwen3-30B-A3B layer's expert shape (128 experts, top-8, H 2,048,
F 768, bf16) at the rows of a prefill step (default 8,192 tokens = 65,536 rows): every engine
candidate timed as `moe.experts` runs it (sort, MLP, unsort, combine), by its marginal cost
between loops of PREFILL_CALLS calls (the default since session 34) and, with --one-call, one
call an execution as the warm-up timed it before. One JSON line each. (Sessions 25-26 read the
warp-specialized kernels ~2x slower here than in `bench_moe.py gmm`'s loop; session 34 found why,
a fused index computation, `moe_gmm_mosaic.gather_rows`.)

    python scripts/check_moe_choice.py [--tokens 8192] [--one-call]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax.numpy as jnp  # noqa: E402

from jaxllm.models import gmm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--one-call", action="store_true", help="also time one call an execution")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    rows = [t * args.top_k for t in args.tokens]
    for calls in ([gmm.PREFILL_CALLS, None] if args.one_call else [gmm.PREFILL_CALLS]):
        gmm.PREFILL_CALLS = calls  # None: one call an execution
        c = gmm.Chooser()
        c.measure(rows, args.experts, args.hidden, args.inter, jnp.bfloat16, top_k=args.top_k)
        print(json.dumps({"marginal_calls": calls, "choice": c.choice,
                          "us": {M: {n: round(t * 1e6, 1) for n, t in sorted(v.items(), key=lambda kv: kv[1])}
                                 for M, v in c.timings.items()}}), flush=True)


if __name__ == "__main__":
    main()
