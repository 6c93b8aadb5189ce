"""Shared-system-prompt workload with prefix caching on and off, in one process.

--num-prompts requests share one random --prefix-len token prefix and end in a
short unique suffix (--suffix-min..--suffix-max tokens); each generates
--output-len tokens (greedy, EOS ignored). All are submitted at once with
`LLM.generate`; the same prompts run on an engine with prefix caching on and
on one with it off (the embedded SmolLM2-135M unless --model). Reports
throughput, mean time to first token (arrival to first token, queueing
included), the prefix-cache hit rate, and whether both runs gave the same
tokens.

    python scripts/bench_prefix.py --num-prompts 64 --prefix-len 1000 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np


def run(args, prompts: list[list[int]], caching: bool) -> tuple[dict, list[list[int]]]:
    from jaxllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, enable_prefix_caching=caching, dtype=args.dtype, load_format=args.load_format,
              random_shape=args.random_shape,
              max_model_len=args.prefix_len + args.suffix_max + args.output_len,
              max_num_seqs=args.max_num_seqs)
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    st = llm.stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    return {
        "prefix_caching": caching, "elapsed_s": round(dt, 2), "init_s": round(init_s, 1),
        "requests_per_s": round(len(prompts) / dt, 3),
        "output_tokens_per_s": round(n_out / dt, 2),
        "total_tokens_per_s": round((n_out + sum(map(len, prompts))) / dt, 1),
        "mean_ttft_s": round(float(np.mean(ttft)), 2),
        "mean_cached_tokens": round(float(np.mean([o.num_cached_tokens for o in outs])), 1),
        "hit_rate": round(st["prefix_cache_hits"] / max(st["prefix_cache_queries"], 1), 3),
        "compiles_after_warmup": st["compiles_after_warmup"],
        "num_preemptions": st["num_preemptions"],
    }, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-shape", default=None, help="random weights of a known shape, e.g. llama3-8b")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: --model is a folder with config.json only, weights drawn on the device")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--suffix-min", type=int, default=8)
    ap.add_argument("--suffix-max", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--order", default="on,off", help="which engine runs first")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    vocab = 49152  # SmolLM2; ids stay in range for any model at least this large
    prefix = rng.integers(100, vocab, size=args.prefix_len).tolist()
    prompts = [prefix + rng.integers(100, vocab, size=int(rng.integers(args.suffix_min, args.suffix_max + 1))
                                     ).tolist() for _ in range(args.num_prompts)]
    results, tokens = {}, {}
    for mode in args.order.split(","):
        results[mode], tokens[mode] = run(args, prompts, mode == "on")
        print(json.dumps(results[mode]), flush=True)
    if "on" in results and "off" in results:
        on, off = results["on"], results["off"]
        print(json.dumps({
            "same_tokens": tokens["on"] == tokens["off"],
            "throughput_speedup": round(on["total_tokens_per_s"] / off["total_tokens_per_s"], 2),
            "ttft_speedup": round(off["mean_ttft_s"] / on["mean_ttft_s"], 2),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_avg": os.getloadavg(),
        }))


if __name__ == "__main__":
    main()
