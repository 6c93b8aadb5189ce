"""Engine arguments: the one place the CLI and the server take engine flags from.

As vLLM's `EngineArgs`: every flag is named as vLLM names it and maps onto a field of
`EngineConfig` with the same name (dashes -> underscores). `engine_kwargs` passes on every
parsed flag whose name is a config field, so a new engine flag needs only its
`add_argument` line here and its field in `config.py`. Flags whose value is None are left
out, so the config's own default (often platform dependent) applies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxllm.config import EngineConfig


def json_arg(text: str) -> dict:
    """`--x-config '{"k": v}'`: a JSON object, or a clear argparse error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights drawn on the device, only config.json is read")
    p.add_argument("--random-shape", default=None, metavar="NAME",
                   help="serve/run a named model shape with dummy weights (llama3-8b, qwen3-8b, ...)")
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
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV page storage: auto, fp8, fp8_e4m3, fp8_e5m2, int8, int4")
    p.add_argument("--calculate-kv-scales", action="store_true", default=None,
                   help="fp8 KV cache: per-layer K/V scales from the first batch's amax (default: "
                        "the checkpoint's k_scale/v_scale, else 1.0)")
    p.add_argument("--quantization", "-q", default=None,
                   help="weight quantization: fp8 (W8A8), int8 (W8A16), int4 (W4A16, group 128), gguf (keep "
                        "a GGUF's Q8_0/Q4_0/Q4_1/Q4_K blocks); HF FP8 checkpoints load as stored")
    p.add_argument("--attention-backend", default=None, choices=["reference", "pallas", "mosaic"])
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many devices (all processes' devices together)")
    k = p.add_argument_group("KV transfer", "KV connectors, offload tiers and KV events (vLLM's flags)")
    k.add_argument("--kv-transfer-config", type=json_arg, default=None,
                   help='JSON: {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
                        '"kv_connector_extra_config": {}}')
    k.add_argument("--kv-offload-cpu-gib", type=float, default=None,
                   help="GiB of host memory holding KV blocks evicted from the device")
    k.add_argument("--kv-offload-disk-dir", default=None,
                   help="directory or fsspec URL (s3://...) of the disk tier, written through")
    k.add_argument("--kv-offload-disk-gib", type=float, default=None, help="bound of the disk tier")
    k.add_argument("--kv-events-config", type=json_arg, default=None,
                   help='JSON: {"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557"}')
    p.add_argument("--speculative-config", type=json_arg, default=None, metavar="JSON",
                   help='speculative decoding, vLLM keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="MoE: place whole experts on the tensor-parallel devices (attention stays TP)")
    p.add_argument("--expert-parallel-size", type=int, default=None, metavar="N",
                   help="with --enable-expert-parallel: N groups of devices hold whole experts, each "
                        "expert split over its group's tensor-parallel-size / N devices (default: N = "
                        "tensor-parallel-size)")
    p.add_argument("--enable-eplb", action="store_true", default=None,
                   help="MoE + expert parallel: replicate hot experts into redundant slots by load")
    p.add_argument("--eplb-config", type=json_arg, default=None,
                   help='JSON: {"window_size": W, "step_interval": K, "num_redundant_experts": R}')
    g = p.add_argument_group("multi-host", "run one model over several processes (jax.distributed); "
                             "start every process with the same flags but its own --process-id")
    g.add_argument("--distributed-coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordinator service, e.g. 127.0.0.1:1234")
    g.add_argument("--num-processes", type=int, default=1)
    g.add_argument("--process-id", type=int, default=0,
                   help="0 schedules and serves; the others only run the model's steps")


_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model"}


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of `EngineConfig` from parsed flags (those left at None omitted)."""
    return {k: v for k, v in vars(args).items() if k in _FIELDS and v is not None}
