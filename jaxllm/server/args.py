"""`jaxllm serve [MODEL]`: flags (named as vLLM's) and the uvicorn launch.

Engine flags come from `jaxllm.engine.arg_utils.add_engine_args`; this module adds the
server's own. The engine is built (and every bucket compiled) before the port
opens, so the first request never pays for compilation.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxllm.envs import env_float
from jaxllm.server.reasoning import REASONING_PARSERS
from jaxllm.server.tool_parsers import TOOL_PARSERS

EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags; MODEL is positional (as in `vllm serve MODEL`), `--model` also works."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF folder, .gguf file or converted folder; omitted: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default $JAXLLM_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts; the first is reported in responses")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="sequences allowed to wait beyond --max-num-seqs; more are refused with 503 "
                        "(-1: unbounded)")
    p.add_argument("--max-request-body-bytes", type=int, default=32 * 2 ** 20,
                   help="larger request bodies are refused with 413 (0: no limit)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides, --tool-call-parser reads its calls')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (needed by --enable-auto-tool-choice)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> into reasoning_content; constraints apply after it")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def served_names(args: argparse.Namespace) -> list[str]:
    model = args.model_tag or args.model
    return args.served_model_name or [model or getattr(args, "random_shape", None) or EMBEDDED_MODEL_NAME]


def build_server_app(args: argparse.Namespace):
    """Build the engine and the app from parsed `jaxllm serve` arguments."""
    from jaxllm.engine.arg_utils import engine_kwargs
    from jaxllm.engine.async_engine import AsyncLLM
    from jaxllm.server.app import build_app

    bound = None if args.max_waiting_requests < 0 else args.max_waiting_requests
    engine = AsyncLLM.from_config(args.model_tag or args.model, max_waiting_requests=bound,
                                  **{"usage_context": "serve", **engine_kwargs(args)})
    engine.engine.prepare_structured_outputs()  # not at the first constrained request, mid-batch
    return build_app(engine, served_names(args), api_key=args.api_key, tool_call_parser=args.tool_call_parser,
                     enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser,
                     max_request_bytes=args.max_request_body_bytes)


SWITCH_INTERVAL = 0.0005  # seconds; Python's default is 0.005


def set_switch_interval() -> None:
    """The server's threads (HTTP loop, engine loop, dispatch) hand work to each other every step;
    a thread woken for its part waits for the GIL up to Python's switch interval (5 ms) while
    another runs Python. At 0.5 ms the serving step of an 8B model on an H200 went from 13.5 to
    9.9 ms per output token (64 streams, `scripts/gpu_structured_profile.sh`, docs/benchmarks.md).
    JAXLLM_SWITCH_INTERVAL sets it (seconds; 0 keeps Python's)."""
    try:
        value = env_float("JAXLLM_SWITCH_INTERVAL", SWITCH_INTERVAL, minimum=0.0)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if value > 0:
        sys.setswitchinterval(value)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # no-op under the CLI
    set_switch_interval()
    app = build_server_app(args)
    logging.getLogger("jaxllm").info("serving %s on http://%s:%d", served_names(args)[0], args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_keep_alive=30)
    return 0
