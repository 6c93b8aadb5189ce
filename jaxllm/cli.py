"""`jaxllm` command line: generate, serve, convert."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped pages")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--attention-backend", default=None, choices=["reference", "pallas", "mosaic"])
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many devices (all processes' devices together)")
    g = p.add_argument_group("multi-host", "run one model over several processes (jax.distributed); "
                             "start every process with the same flags but its own --process-id")
    g.add_argument("--distributed-coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordinator service, e.g. 127.0.0.1:1234")
    g.add_argument("--num-processes", type=int, default=1)
    g.add_argument("--process-id", type=int, default=0,
                   help="0 schedules and serves; the others only run the model's steps")


def engine_kwargs(args: argparse.Namespace) -> dict:
    kw = dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              gpu_memory_utilization=args.gpu_memory_utilization,
              num_gpu_blocks_override=args.num_gpu_blocks_override, seed=args.seed,
              attention_backend=args.attention_backend,
              tensor_parallel_size=args.tensor_parallel_size,
              distributed_coordinator=args.distributed_coordinator,
              num_processes=args.num_processes, process_id=args.process_id,
              preemption_mode=args.preemption_mode, swap_space=args.swap_space,
              scheduling_policy=args.scheduling_policy)
    if args.enable_prefix_caching is not None:
        kw["enable_prefix_caching"] = args.enable_prefix_caching
    if args.async_scheduling is not None:
        kw["async_scheduling"] = args.async_scheduling
    return kw


def _generate(args: argparse.Namespace) -> int:
    from jaxllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sample_seed, n=args.n)
    t0 = time.perf_counter()
    outs = llm.generate(args.prompt, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if args.json:
        print(json.dumps([{"prompt": o.prompt, "text": o.outputs[0].text,
                           "token_ids": o.outputs[0].token_ids,
                           "finish_reason": o.outputs[0].finish_reason,
                           "all_token_ids": [c.token_ids for c in o.outputs]} for o in outs], indent=2))
    else:
        for o in outs:
            print(f"--- {o.prompt!r}\n{o.outputs[0].text}")
        print(f"[{n_tok} tokens in {dt:.2f}s, {n_tok / dt:.1f} tokens/s]", file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from jaxllm.models.loader import convert

    convert(args.src, args.dst)
    print(f"converted {args.src} -> {args.dst}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxllm")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text offline")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--model", default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--json", action="store_true")
    add_engine_args(g)
    g.set_defaults(fn=_generate)

    c = sub.add_parser("convert", help="convert a model to a cached jaxllm checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.set_defaults(fn=_convert)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from jaxllm.server.args import add_serve_args, run_serve
        add_serve_args(s)
        add_engine_args(s)
        s.set_defaults(fn=run_serve)
    except ImportError:  # the server extra (fastapi, uvicorn) is not installed
        s.set_defaults(fn=lambda a: sys.exit("jaxllm serve needs: pip install 'jaxllm[serve]'"))

    args = parser.parse_args(argv)
    if getattr(args, "num_processes", 1) > 1 and args.process_id != 0:
        # A follower: same engine, no scheduler/server; runs process 0's steps until it stops.
        from jaxllm.parallel import run_follower
        run_follower(getattr(args, "model_tag", None) or args.model, **engine_kwargs(args))
        return 0
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
