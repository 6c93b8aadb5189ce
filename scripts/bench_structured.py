#!/usr/bin/env python
"""Structured outputs in-process: JSON-schema vs unconstrained throughput on one engine, the
host's bitmask time per step, and the grammar compile time of the test schema (first, cached).

Same engine, same sampling (temperature 1, --output-len tokens each), prompts of the same length
drawn afresh for every timed run (so no run finds another's in the prefix cache): first
--num-prompts unconstrained requests, then --num-prompts under bench_serving's JSON schema
(which asks for more records than --output-len holds, so every request runs to --output-len).
The ratio of output throughputs is the figure (issue 16: >= 0.85 on CPU, >= 0.95 on an H200).

    python scripts/bench_structured.py --num-prompts 64 --input-len 64 --output-len 64
    python scripts/bench_structured.py --random-shape llama3-8b --load-format dummy --dtype bfloat16 ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import STRUCTURED_SCHEMA, make_prompts  # noqa: E402


def timed_generate(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(c.token_ids) for o in outs for c in o.outputs)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    add_engine_args(p)
    p.add_argument("--token-buckets", type=int, nargs="+", default=None)
    p.add_argument("--seq-buckets", type=int, nargs="+", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="unconstrained/constrained pairs (the best of each)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    from jaxllm import LLM, SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams

    kw = engine_kwargs(args)
    for name in ("token_buckets", "seq_buckets"):
        if getattr(args, name):
            kw[name] = tuple(getattr(args, name))
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    result: dict = {"load_s": time.perf_counter() - t0, "config": vars(args),
                    "machine": {"host": platform.node(), "platform": platform.platform(),
                                "python": platform.python_version()},
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import jax
        result["device"] = str(jax.devices()[0].device_kind)
    except Exception as exc:  # noqa: BLE001
        result["device"] = repr(exc)

    eng = llm.engine
    schema = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    try:  # compile time of the test schema: the first compile, then a cache hit
        compiler = eng.structured.compiler
        t0 = time.perf_counter()
        compiler.compile_now(schema)
        result["compile_first_ms"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiler.compile_now(schema)
        result["compile_cached_ms"] = 1e3 * (time.perf_counter() - t0)
        print(f"grammar compile: first {result['compile_first_ms']:.2f} ms, cached "
              f"{result['compile_cached_ms']:.4f} ms (llguidance tokenizer built before: "
              f"{compiler.backend.vocab_size} ids)")
    except Exception as exc:  # noqa: BLE001
        result["compile_error"] = repr(exc)
        print("compile failed:", exc)

    prompts = make_prompts(args.num_prompts, args.input_len, seed=0)
    plain = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=0)
    constrained = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=0,
                                 structured_outputs=schema)
    timed_generate(llm, prompts[:2], plain)  # both paths once, untimed
    timed_generate(llm, prompts[:2], constrained)
    best = {"unconstrained": 0.0, "json": 0.0}
    mask = {}
    for r in range(args.rounds):
        order = (("unconstrained", plain), ("json", constrained))
        for name, sp in order if r % 2 == 0 else order[::-1]:  # odd rounds: json first
            try:
                before = eng.stats()
                fresh = make_prompts(args.num_prompts, args.input_len, seed=1 + 2 * r + (name == "json"))
                secs, toks = timed_generate(llm, fresh, sp)
                after = eng.stats()
                tps = toks / secs
                best[name] = max(best[name], tps)
                print(f"round {r} {name:>13}: {toks} tokens in {secs:.2f} s = {tps:.1f} tok/s")
                if name == "json":
                    steps = after["structured_mask_steps"] - before["structured_mask_steps"]
                    mask_s = after["structured_mask_seconds"] - before["structured_mask_seconds"]
                    mask = {"mask_ms_per_step": 1e3 * mask_s / max(steps, 1), "mask_steps": steps,
                            "step_ms": 1e3 * secs / max(steps, 1), "output_tokens": toks}
            except Exception as exc:  # noqa: BLE001
                result[f"{name}_error"] = repr(exc)
                print(name, "failed:", exc)
    result.update({"unconstrained_tok_s": best["unconstrained"], "json_tok_s": best["json"],
                   "throughput_ratio": best["json"] / best["unconstrained"] if best["unconstrained"] else None,
                   **mask, "compiles_after_warmup": eng.stats()["compiles_after_warmup"]})
    if mask:
        print(f"json/unconstrained throughput ratio {result['throughput_ratio']:.3f}; host mask "
              f"{mask['mask_ms_per_step']:.2f} ms per step of {mask['step_ms']:.1f} ms (overlapped with the "
              f"forward pass); compiles after warm-up {result['compiles_after_warmup']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if mask else 1


if __name__ == "__main__":
    sys.exit(main())
