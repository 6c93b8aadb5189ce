#!/usr/bin/env python
"""Load-test any OpenAI-compatible server (jaxllm, vLLM, ...) and report latency percentiles.

Requests stream (SSE) so time-to-first-token and inter-token latency are seen
as a client sees them. Arrivals are Poisson at --request-rate (or all at once
with --request-rate inf, or evenly spaced with --arrival constant), capped at
--max-concurrency requests in flight. Workloads use vLLM's flags
(`jaxllm/benchmarks/datasets.py`): `--dataset-name random --random-input-len N
--random-output-len M --random-range-ratio R` sends prompts of random token ids
(completions; lengths uniform in [N(1-R), N(1+R)]; the chat endpoint gets seeded
random words instead) and `--dataset-name jsonl --dataset-path F` one prompt per
line. Token counts come from the server's own usage report
(stream_options.include_usage), not from a local tokenizer.

With `--roofline-shape NAME` (jaxllm/models/shapes.py) or `--roofline-config
config.json`, the run's roofline is printed: copy bandwidth and matmul rate measured
in this process (jax on the local device, before the load), the server's running
batch sampled from /metrics, and the floor from `roofline.serving_floor`.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 \
        --num-prompts 64 --request-rate 4 --max-concurrency 16 --input-len 128 --output-len 64

Prints a table and writes JSON (--result-json). Only talks to --base-url.

--structured-output json runs the load twice in one run, unconstrained then with every request
under a JSON schema (vLLM's `structured_outputs` field; the schema asks for more items than
--output-len can hold, so both phases generate --output-len tokens), and reports the output
throughput ratio plus the server's bitmask time per step and grammar compile time (/metrics).
Each phase starts after --warmup untimed requests of its own kind (the JSON phase's compiles
the schema, as the first request of vLLM's structured-output benchmark does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from jaxllm.benchmarks.datasets import Sample, add_dataset_args, load_dataset, percentiles

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water room mother area money story month lot right "
         "study book job word business issue side kind head house service friend father power hour game line "
         "end member law car city community name president team minute idea kid body information back parent "
         "face others level office door health art war history party result change morning reason research").split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first chunk with content
    latency: float = 0.0  # seconds to [DONE]
    itl: list[float] = field(default_factory=list)  # gaps between content chunks


def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = max(1, int(input_len * 0.75))  # ~1.3 tokens per English word
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def arrival_gaps(n: int, rate: float, kind: str, seed: int) -> list[float]:
    if rate == float("inf") or kind == "burst":
        return [0.0] * n
    if kind == "constant":
        return [1.0 / rate] * n
    return list(np.random.default_rng(seed).exponential(1.0 / rate, n))


# The --structured-output json schema: nested objects, bounded strings and integers, an enum and
# arrays with min/max items; at least 1000 records, so no request finishes its JSON early.
STRUCTURED_SCHEMA = {
    "type": "array", "minItems": 1000,
    "items": {"type": "object", "additionalProperties": False,
              "required": ["id", "name", "role", "tags", "address"],
              "properties": {
                  "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
                  "name": {"type": "string", "maxLength": 24},
                  "role": {"enum": ["admin", "user", "guest"]},
                  "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
                           "maxItems": 4},
                  "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                              "properties": {"city": {"type": "string", "maxLength": 20},
                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
}


def scrape(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named Prometheus sample in /metrics text (0 if absent)."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def make_samples(args: argparse.Namespace) -> list[Sample]:
    samples = load_dataset(args, args.vocab_size)
    if args.endpoint == "chat" and args.dataset_name == "random":  # chat takes text: words of ~that length
        texts = make_prompts(len(samples), max(len(x.prompt) for x in samples), args.seed)
        samples = [Sample(" ".join(t.split()[:max(2, int(len(x.prompt) * 0.75))]), x.output_len)
                   for t, x in zip(texts, samples)]
    return samples


async def one(client: httpx.AsyncClient, args: argparse.Namespace, sample: Sample) -> Result:
    res = Result()
    prompt = sample.prompt
    if args.endpoint == "chat":
        url = "/v1/chat/completions"
        body = {"model": args.model, "messages": [{"role": "user", "content": prompt}],
                "max_completion_tokens": sample.output_len}
    else:
        url = "/v1/completions"
        body = {"model": args.model, "prompt": prompt, "max_tokens": sample.output_len}
    body.update(stream=True, stream_options={"include_usage": True}, temperature=args.temperature)
    if getattr(args, "constraint", None) is not None:
        body["structured_outputs"] = args.constraint
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM / jaxllm extension: fixed output length
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"])[:200]
                    return res
                if data.get("usage"):
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.output_tokens = data["usage"]["completion_tokens"]
                for ch in data.get("choices") or []:
                    text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last, chunks = now, chunks + 1
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no content received"
    except Exception as exc:  # counted as a failed request; the run goes on
        res.error = repr(exc)[:200]
    return res


async def sample_running(client: httpx.AsyncClient, out: list[float], stop: asyncio.Event) -> None:
    """The server's running-request gauge every 50 ms (jaxllm: or vllm: prefix)."""
    while not stop.is_set():
        try:
            text = (await client.get("/metrics")).text
            vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith(("jaxllm:num_requests_running", "vllm:num_requests_running"))]
            if vals:
                out.append(sum(vals))
        except Exception:  # metrics are optional: the run goes on without them
            return
        await asyncio.sleep(0.05)


async def run(args: argparse.Namespace, on_warm=None) -> tuple[list[Result], float, list[float]]:
    """The timed requests, after --warmup untimed ones; `on_warm(metrics text)` runs between."""
    prompts = make_samples(args)
    gaps = arrival_gaps(len(prompts), args.request_rate, args.arrival, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency + 8)
    sem = asyncio.Semaphore(args.max_concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(args.warmup):
            await one(client, args, prompts[0])
        if on_warm is not None:  # the server's counters from here on cover the timed requests only
            on_warm((await client.get("/metrics")).text)

        async def limited(p: Sample) -> Result:
            async with sem:
                return await one(client, args, p)

        running: list[float] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_running(client, running, stop))
        t0 = time.perf_counter()
        tasks = []
        for p, gap in zip(prompts, gaps):
            tasks.append(asyncio.create_task(limited(p)))
            await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        await sampler
        return results, duration, running


pct = percentiles


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "config": {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items() if k != "api_key"},
        "machine": {"host": platform.node(), "python": platform.python_version(), "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tok / duration, "total_token_throughput": (in_tok + out_tok) / duration,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "ttft_ms": pct([r.ttft for r in ok]), "tpot_ms": pct(tpot),
        "itl_ms": pct([x for r in ok for x in r.itl]), "e2e_ms": pct([r.latency for r in ok]),
        "prompt_lens": [r.prompt_tokens for r in ok], "output_lens": [r.output_tokens for r in ok],
    }


def table(s: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    lines = [f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.1f}s",
             f"requests/s {s['request_throughput']:.2f}  output tok/s {s['output_token_throughput']:.1f}  "
             f"total tok/s {s['total_token_throughput']:.1f}  (in {s['total_input_tokens']}, "
             f"out {s['total_output_tokens']} tokens)",
             f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[name]
        lines.append(f"{name[:-3].upper():<12}" + "".join(f"{fmt(d[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    if s.get("roofline"):
        r = s["roofline"]
        lines.append(f"roofline: {r['floor_s']:.2f} s (prefill {r['prefill_floor_s']:.2f} s + {r['decode_steps']:.0f} "
                     f"decode steps of mean batch {r['mean_batch']:.1f} at {r['decode_step_floor_s'] * 1e3:.2f} ms) "
                     f"at C={r['copy_bytes_per_s'] / 1e9:.0f} GB/s, {r['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s; "
                     f"achieved {r['fraction']:.2f} of it (idle time between arrivals counts against it)")
    return "\n".join(lines)


def roofline(args: argparse.Namespace, summary: dict, running: list[float], rates: dict) -> dict:
    from jaxllm.benchmarks.roofline import cost_of_config, serving_floor

    cost = cost_of_config(shape_config(args))
    busy = [r for r in running if r > 0]
    floor = serving_floor(cost, summary["prompt_lens"], summary["output_lens"],
                          float(np.mean(busy)) if busy else 1.0, rates["copy_bytes_per_s"],
                          rates["matmul_flops_per_s"])
    return {**floor, "fraction": floor["floor_s"] / summary["duration_s"]}


def server_vocab(args: argparse.Namespace) -> int | None:
    """The served tokenizer's vocabulary size (jaxllm's and vLLM's /tokenizer_info), if it says."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        return httpx.get(args.base_url + "/tokenizer_info", headers=headers, timeout=30).json().get("vocab_size")
    except Exception:  # not every server has it: the caller falls back
        return None


def shape_config(args: argparse.Namespace) -> dict | None:
    if args.roofline_config:
        with open(args.roofline_config) as f:
            return json.load(f)
    if args.roofline_shape:
        from jaxllm.models.shapes import get_shape
        return get_shape(args.roofline_shape)
    return None


_STRUCTURED_METRICS = ("jaxllm:structured_mask_seconds", "jaxllm:structured_mask_steps",
                       "jaxllm:structured_compile_seconds", "jaxllm:structured_compiles")
# The server's own split of the first token's wait (arrival in the engine -> first step -> first
# token): set beside the client's TTFT, it shows the time spent before the request reached the engine.
_WAIT_METRICS = tuple(f"jaxllm:{n}_{k}" for n in ("time_to_first_token_seconds", "request_queue_time_seconds",
                                                   "request_prefill_time_seconds") for k in ("sum", "count"))


def server_wait(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean server-side TTFT, queue and prefill time (ms) between two scrapes."""
    out = {}
    for short, n in (("ttft", "time_to_first_token_seconds"), ("queue", "request_queue_time_seconds"),
                     ("prefill", "request_prefill_time_seconds")):
        c = after[f"jaxllm:{n}_count"] - before[f"jaxllm:{n}_count"]
        out[f"server_{short}_ms_mean"] = 1e3 * (after[f"jaxllm:{n}_sum"] - before[f"jaxllm:{n}_sum"]) / c if c else None
    return out


def _wait_line(d: dict) -> str:
    return "server-side means: " + "  ".join(
        f"{k.removeprefix('server_').removesuffix('_ms_mean')} {'-' if v is None else f'{v:.1f}'} ms"
        for k, v in d.items())


def run_structured(args: argparse.Namespace) -> dict:
    """Unconstrained, then JSON-schema constrained, on one server; the throughput ratio.

    The constrained phase draws its prompts with the next seed (same lengths, other words), so
    neither phase finds the other's prompts in the prefix cache."""
    names = _STRUCTURED_METRICS + _WAIT_METRICS

    def metrics() -> dict[str, float]:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        return scrape(httpx.get(args.base_url + "/metrics", headers=headers, timeout=30).text, names)

    warm: dict[str, dict[str, float]] = {}  # each phase's counters after its warm-up requests
    at_warm = lambda phase: lambda text: warm.__setitem__(phase, scrape(text, names))
    args.constraint = None
    results, duration, _ = asyncio.run(run(args, at_warm("plain")))
    before = metrics()
    wait = server_wait(warm["plain"], before)
    plain = {**summarize(results, duration, args), **wait}
    print("-- unconstrained\n" + table(plain) + "\n" + _wait_line(wait))
    # Both phases start after the same --warmup requests (vLLM's benchmarks send the first request
    # once, untimed, before the run): here the warm-up request compiles the schema, which the
    # server's compile metrics below still count; --warmup 0 times both phases cold.
    args.constraint = {"json": STRUCTURED_SCHEMA}
    args.seed += 1
    results, duration, _ = asyncio.run(run(args, at_warm("json")))
    args.seed -= 1
    after = metrics()
    args.constraint = "json"
    wait = server_wait(warm["json"], after)
    constrained = {**summarize(results, duration, args), **wait}
    print("-- json schema\n" + table(constrained) + "\n" + _wait_line(wait))
    d = {k: after[k] - before[k] for k in _STRUCTURED_METRICS}
    steps = d["jaxllm:structured_mask_steps"]
    ratio = constrained["output_token_throughput"] / max(plain["output_token_throughput"], 1e-9)
    out = {**constrained, "unconstrained": plain, "throughput_ratio": ratio,
           "mask_ms_per_step": 1e3 * d["jaxllm:structured_mask_seconds"] / steps if steps else None,
           "mask_steps": steps, "grammar_compiles": d["jaxllm:structured_compiles"],
           "grammar_compile_ms": 1e3 * d["jaxllm:structured_compile_seconds"]}
    mask = "-" if out["mask_ms_per_step"] is None else f"{out['mask_ms_per_step']:.2f}"
    print(f"structured/unconstrained output throughput ratio {ratio:.3f}  mask {mask} ms/step over "
          f"{steps:.0f} steps  grammar compiles {out['grammar_compiles']:.0f} "
          f"({out['grammar_compile_ms']:.1f} ms; the other requests hit the cache)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    p.add_argument("--arrival", choices=["poisson", "constant", "burst"], default="poisson")
    p.add_argument("--max-concurrency", type=int, default=64)
    add_dataset_args(p)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="ids of random prompts are below this (default: the roofline shape's, else the "
                        "server's /tokenizer_info, else 32000)")
    p.add_argument("--roofline-shape", default=None, help="model shape for the roofline, e.g. llama3-8b")
    p.add_argument("--roofline-config", default=None, help="or the model's config.json")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before the run")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--structured-output", choices=["none", "json"], default="none",
                   help="json: an unconstrained run, then the same load under a JSON schema; their ratio")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    try:
        cfg = shape_config(args)
        if args.vocab_size is None:
            args.vocab_size = cfg["vocab_size"] if cfg else server_vocab(args) or 32000
        make_samples(args)  # bad dataset flags fail before any request
    except ValueError as e:
        p.error(str(e))
    rates = None
    if cfg is not None:
        from jaxllm.benchmarks.roofline import measure_rates
        rates = measure_rates(copy_gib=1.0)  # beside a server on the same device: a small share
    if args.structured_output == "json":
        summary = run_structured(args)
    else:
        results, duration, running = asyncio.run(run(args))
        summary = summarize(results, duration, args)
        if rates is not None and summary["completed"]:
            summary["roofline"] = roofline(args, summary, running, rates)
        print(table(summary))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
