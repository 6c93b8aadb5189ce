"""`jaxllm` command line: generate, serve, proxy, convert."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from jaxllm.engine.arg_utils import add_engine_args, engine_kwargs


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


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging() -> None:
    """Start-up and engine logs on stderr, at JAXLLM_LOGGING_LEVEL (default INFO, as vLLM's
    VLLM_LOGGING_LEVEL); a no-op when the caller configured logging already."""
    from jaxllm.envs import env_choice

    level = env_choice("JAXLLM_LOGGING_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    logging.basicConfig(level=getattr(logging, level), format=LOG_FORMAT)


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

    x = sub.add_parser("proxy", help="prefill/decode disaggregation proxy (OpenAI API)")
    try:
        from jaxllm.server.proxy import add_proxy_args, run_proxy
        add_proxy_args(x)
        x.set_defaults(fn=run_proxy)
    except ImportError:
        x.set_defaults(fn=lambda a: sys.exit("jaxllm proxy needs: pip install 'jaxllm[serve]'"))

    args = parser.parse_args(argv)
    try:
        setup_logging()
    except ValueError as e:
        parser.error(str(e))
    if getattr(args, "num_processes", 1) > 1 and args.process_id != 0:
        # A follower: same engine, no scheduler/server; runs process 0's steps until it stops.
        from jaxllm.engine.multihost import run_follower
        # The leader's defaults (token budget, buckets) depend on its entry point: match them.
        usage = "serve" if args.cmd == "serve" else "llm"
        run_follower(getattr(args, "model_tag", None) or args.model, usage_context=usage, **engine_kwargs(args))
        return 0
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
