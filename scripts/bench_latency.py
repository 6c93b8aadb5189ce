"""Decode step latency against the memory-bandwidth floor (vLLM `benchmark_latency`-like flags).

For each --batch-size B: B requests whose --input-len context is already in the
KV cache (filled with random values; prefill is not what is timed), then
--num-iters engine steps of one token per request, timed end to end (host
scheduling + padded batch + jitted step + sampler). The floor is
(weight bytes + K/V bytes read) / C, with C, the copy bandwidth, measured in
the same process. With --hf, HF transformers with a static cache and
torch.compile decodes the same shape as the peer.

    python scripts/bench_latency.py --random-shape llama3-8b --batch-size 1 8 64 --input-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))


def copy_bandwidth(gib: float = 4.0) -> float:
    """C, as every roofline of the project measures it (`jaxllm.benchmarks.roofline.copy_rate`:
    the fastest of rounds of queued copies, after ~1 s of warm-up)."""
    from jaxllm.benchmarks.roofline import copy_rate

    return copy_rate(gib)


def fill_random(runner) -> None:
    import jax

    import jax.numpy as jnp

    def rnd(kv):
        if kv.dtype == jnp.uint8:  # int8/int4 pages: random value bytes, valid scales (and minimums)
            from jaxllm.kernels import kv_quant
            fmt = kv_quant.page_format(kv.dtype, kv.shape[-1], runner.model_cfg.head_dim)
            size, width = kv.shape[-2:]
            meta = kv_quant.meta_offset(fmt, size, width)  # split layout: values, then the scales
            bits = jax.random.bits(jax.random.key(1), kv.shape[:-2] + (size * width,), jnp.uint8)
            scale = jax.lax.bitcast_convert_type(jnp.bfloat16(0.01), jnp.uint8)
            planar = jnp.repeat(scale, size)  # each field's S low bytes, then its S high bytes
            n = size * width - meta
            return bits.at[..., meta:].set(jnp.tile(planar, n // (2 * size))).reshape(kv.shape)
        return jax.random.normal(jax.random.key(1), kv.shape, jnp.bfloat16).astype(kv.dtype)

    # Keep the pages' sharding (tensor parallel; one device: uncommitted, as the runner's):
    # the step would recompile for another.
    keep = {"out_shardings": runner.kv_pages.sharding} if runner.tp else {}
    # keep_unused: the pages are donated but never read; pruned, they could not be aliased and the
    # random pages would be a second pool (an H100 ran out of memory so, session 35).
    fill = jax.jit(rnd, donate_argnums=0, keep_unused=True, **keep)
    runner.kv_pages = fill(runner.kv_pages)
    runner.kv_pages.block_until_ready()


def decode_steps(llm, batch: int, ctx: int, iters: int, rng, profile_steps: int = 0,
                 profile_dir: str | None = None) -> dict:
    """Put `batch` requests with `ctx` cached tokens in the running set; time decode steps.

    With profile_steps, that many more steps run under the profiler afterwards
    (`trace_stats.profile`): GPU busy time, kernel time by kind, host spans.
    """
    from jaxllm import SamplingParams
    from jaxllm.runtime.request import RequestStatus

    eng = llm.engine
    sched = eng.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=iters + profile_steps + 4, ignore_eos=True)
    ids = []
    for i in range(batch):
        rid = f"b{batch}-{i}"
        eng.add_request(rid, rng.integers(0, eng.model_cfg.vocab_size, size=ctx).tolist(), params)
        req = sched.waiting.pop()
        assert eng.kv.allocate_slots(req, ctx) is not None, "KV pool too small"
        req.num_computed_tokens = ctx - 1  # context cached: the next step feeds 1 token
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
        ids.append(rid)
    times = []
    for i in range(iters):
        t = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t)
        # Overlapped steps return the step before's tokens: none after the first.
        assert len(outs) == (0 if i == 0 and eng.async_scheduling else batch)
    res = {"median_s": statistics.median(times[2:]), "min_s": min(times[2:]), "all_s": times}
    if profile_steps:
        from trace_stats import profile
        tag = f"b{batch}{'-async' if eng.async_scheduling else ''}"
        res["profile"] = profile(eng.step, profile_steps, os.path.join(profile_dir, tag))
    eng.flush()
    eng.abort_request(ids)
    return res


def hf_decode(cfg: dict, batch: int, ctx: int, new_tokens: tuple[int, int] = (8, 40)) -> float:
    """Per-token decode time of HF transformers (static cache, torch.compile) at this shape."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg["vocab_size"], (batch, ctx), device="cuda")
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    res = {}
    for n in (*new_tokens, *new_tokens):  # second round is warm (compiled)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        res[n] = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return (res[new_tokens[1]] - res[new_tokens[0]]) / (new_tokens[1] - new_tokens[0])


def main() -> None:
    from jaxllm.cli import setup_logging

    setup_logging()  # the engine's start-up lines (kernel choices) in the log
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--random-shape", default="llama3-8b", help="used when --model is not given")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: --model is a folder with config.json only, weights drawn on the device")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--quantization", "-q", default=None, help="weights: fp8, int8, int4")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV pages: auto, fp8, int8, int4")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--min-bucket", type=int, default=8,
                   help="smallest padded row and token count, as the engine's defaults (8): a "
                        "batch of 1 runs padded to 8, T = R. --min-bucket 1 runs it unpadded "
                        "(on an H200 XLA then emits the matmuls as reductions: slower)")
    p.add_argument("--min-token-bucket", type=int, default=None,
                   help="smallest token bucket if larger than the row bucket (T > R: the step "
                        "takes the prefill attention path; for experiments)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--profile-steps", type=int, default=0, help="profile this many extra steps per batch")
    p.add_argument("--profile-dir", default="/tmp/jaxllm-trace")
    p.add_argument("--async-scheduling", nargs="+", choices=["on", "off"], default=["on"],
                   help="overlapped steps; 'on off' times both on the same engine")
    p.add_argument("--hf", action="store_true", help="HF transformers + torch.compile peer")
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    from shapes import SHAPES

    from jaxllm import LLM

    C = copy_bandwidth()
    max_b = max(args.batch_size)
    seqs = tuple(sorted({max(b, args.min_bucket) for b in args.batch_size}))  # one bucket a batch
    min_t = args.min_token_bucket or 1
    max_len = args.input_len + args.num_iters + 8
    llm = LLM(args.model, random_shape=None if args.model else args.random_shape,
              load_format=args.load_format, dtype=args.dtype,
              max_model_len=max_len, max_num_seqs=max_b,
              num_gpu_blocks_override=max_b * -(-max_len // 16) + 16,
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
              token_buckets=tuple(sorted({*(max(b, min_t) for b in seqs),
                                          args.max_num_batched_tokens})), seq_buckets=seqs,
              tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.engine.runner
    fill_random(runner)
    m = runner.model_cfg
    # The floor is per device: its share of the weights and of the KV heads it reads.
    weight_bytes = runner.device_bytes["weight_bytes"]
    kv_heads = runner.tp.layout.kv_heads_per_device if runner.tp else m.num_kv_heads
    kv_per_token = m.num_layers * 2 * kv_heads * runner.kv_width * runner.kv_pages.dtype.itemsize
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch_size:
        for mode in args.async_scheduling:
            llm.engine.async_scheduling = mode == "on"
            r = decode_steps(llm, b, args.input_len, args.num_iters, rng, args.profile_steps,
                             args.profile_dir)
            floor = (weight_bytes + b * args.input_len * kv_per_token) / C
            rows.append({"batch": b, "ctx": args.input_len, "async": mode, "step_s": r["median_s"],
                         "floor_s": floor, "x_floor": r["median_s"] / floor, "profile": r.get("profile")})
    st = llm.stats()
    result = {"C_bytes_per_s": C, "weight_bytes_per_device": weight_bytes,
              "total_weight_bytes": runner.weight_bytes, "tensor_parallel_size": args.tensor_parallel_size,
              "rows": rows, "compiles_after_warmup": st["compiles_after_warmup"],
              "warmup_s": st["warmup_seconds"], "attention_backend": args.attention_backend,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    save(result, args.output_json)  # before the peer: its failure must not lose these figures
    if args.hf:
        del llm
        import gc
        gc.collect()
        cfg = SHAPES[args.random_shape]
        result["hf"] = []
        for b in args.hf_batch_size:
            try:
                t = hf_decode(cfg, b, args.input_len)
            except Exception as e:  # e.g. out of memory beside JAX's pool: report, go on
                result["hf"].append({"batch": b, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            floor = (weight_bytes + b * args.input_len * kv_per_token) / C
            result["hf"].append({"batch": b, "step_s": t, "x_floor": t / floor})
    if not args.output_json:
        print(json.dumps(result, indent=2))
    print(f"\nC = {C / 1e12:.2f} TB/s, tp {args.tensor_parallel_size}, quantization {args.quantization}, "
          f"kv {args.kv_cache_dtype}, weights per device "
          f"{weight_bytes / 1e9:.2f} GB, compiles after warm-up {result['compiles_after_warmup']}")
    print(f"{'batch':>6}{'ctx':>6}{'async':>6}{'step ms':>10}{'floor ms':>10}{'x floor':>9}")
    for r in rows:
        print(f"{r['batch']:>6}{r['ctx']:>6}{r['async']:>6}{r['step_s'] * 1e3:>10.2f}"
              f"{r['floor_s'] * 1e3:>10.2f}{r['x_floor']:>9.2f}")
        if r["profile"]:
            from trace_stats import print_summary
            print_summary(r["profile"], top=12)
    for r in result.get("hf", []):
        if "error" in r:
            print(f"HF+torch.compile batch {r['batch']}: {r['error']}")
        else:
            print(f"HF+torch.compile batch {r['batch']}: {r['step_s'] * 1e3:.2f} ms/step = {r['x_floor']:.2f}x floor")
    save(result, args.output_json)


def save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
