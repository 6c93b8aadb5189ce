"""The engine as its users run it, on one device: prefill and a mixed workload with DEFAULT settings.

One `LLM(random_shape=..., load_format dummy)` engine with the defaults (max_num_batched_tokens,
buckets, KV pool sizing) and max_model_len large enough for the longest prompt:
  - TTFT of one prompt of each --ttft-lens (max_tokens 1, median of --reps after one warm
    call) against its FLOP floor (prompt FLOPs / the matmul rate measured in this process);
  - prefill throughput, --prefill-batch prompts of --prefill-len tokens, max_tokens 1, with
    the FLOPs achieved as a fraction of the measured matmul rate (MFU) and of the card's spec
    (mixture-of-experts shapes: FLOPs of the active parameters, `roofline.ModelCost`);
  - a mixed random workload (vLLM's random dataset flags) against its roofline
    (`jaxllm/benchmarks/roofline.py`, engine steps recorded).
`--peer hf` runs the same TTFT and prefill calls through HF transformers (sdpa attention,
random bf16 weights on the GPU) instead, in its own process, so each side has the device.

    python scripts/bench_engine.py --random-shape llama3-8b --output-json out/engine_jax.json
    python scripts/bench_engine.py --random-shape llama3-8b --peer hf --output-json out/engine_hf.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from jaxllm.benchmarks.datasets import random_dataset  # noqa: E402

SPEC_TFLOPS = {"H200": 989.4, "H100": 989.4}  # dense bf16, SXM


def prompt_flops(cost, n: int) -> float:
    return 2.0 * cost.matmul_params * n + cost.attn_flops_per_pair * n * (n + 1) / 2 + 2.0 * cost.head_params


def save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def attempt(result: dict, key: str, fn, *a) -> None:
    """One measurement; its failure is recorded and the rest go on."""
    t0 = time.perf_counter()
    try:
        result[key] = fn(*a)
    except Exception as e:  # report, go on
        traceback.print_exc()
        result[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"== {key} ({time.perf_counter() - t0:.0f} s): {json.dumps(result[key])[:600]}", flush=True)


def run_jax(args) -> dict:
    from jaxllm import LLM, SamplingParams
    from jaxllm.benchmarks.roofline import ModelCost, StepRecorder, breakdown, measure_rates, run_floor

    res: dict = {"engine": "jaxllm", "rates": measure_rates()}
    F = res["rates"]["matmul_flops_per_s"]
    t0 = time.perf_counter()
    max_len = max(args.ttft_lens + [args.prefill_len + 1, 2 * (args.random_input_len + args.random_output_len)]) + 16
    extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    if args.quantization:  # issue 17: the same workload with quantized weights / KV pages
        extra["quantization"] = args.quantization
    if args.kv_cache_dtype:
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(random_shape=args.random_shape, max_model_len=max_len, **extra)  # defaults otherwise
    eng = llm.engine
    res["init_s"] = time.perf_counter() - t0
    res["config"] = {"max_num_seqs": eng.cfg.max_num_seqs, "max_num_batched_tokens": eng.token_buckets[-1], "token_buckets": list(eng.token_buckets),
                     "seq_buckets": list(eng.seq_buckets), "num_blocks": eng.runner.num_blocks,
                     "max_model_len": max_len, "warmup_s": eng.warmup_seconds,
                     "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                     "JAXLLM_FP8_GEMM": os.environ.get("JAXLLM_FP8_GEMM", "")}
    cost = ModelCost.of_runner(eng.runner)
    vocab = eng.model_cfg.vocab_size
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(n: int) -> dict:
        ids = rng.integers(100, vocab - 100, size=n).tolist()
        times = []
        for i in range(args.reps + 1):
            eng.kv.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
            if i:  # the first call is the warm one
                times.append(time.perf_counter() - t)
        s = statistics.median(times)
        floor = prompt_flops(cost, n) / F
        return {"len": n, "ttft_s": s, "floor_s": floor, "x_floor": s / floor}

    def prefill() -> dict:
        B, n = args.prefill_batch, args.prefill_len
        prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, size=n).tolist()} for _ in range(B)]
        best = None
        for _ in range(2):
            eng.kv.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        flops = B * prompt_flops(cost, n)
        return {"batch": B, "len": n, "elapsed_s": best, "tokens_per_s": B * n / best,
                "tflops": flops / best / 1e12, "mfu_measured": flops / best / F,
                "mfu_spec": flops / best / (args.spec_tflops * 1e12),
                "flops_basis": "active parameters" if eng.model_cfg.moe is not None else "all parameters"}

    def mixed() -> dict:
        samples = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, vocab, seed=0)
        rec = StepRecorder(eng)
        eng.kv.reset_prefix_cache()
        params = [SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True) for s in samples]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": s.prompt} for s in samples], params, use_tqdm=False)
        end = time.perf_counter()
        dt = end - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        C = res["rates"]["copy_bytes_per_s"]
        roof = run_floor(cost, rec.steps, C, F)
        roof["by_kind"] = breakdown(cost, rec.steps, rec.times, end, C, F, lag=1 if eng.async_scheduling else 0)
        rec.enabled = False
        return {"num_prompts": len(samples), "elapsed_s": dt, "output_tokens_per_s": n_out / dt,
                "total_tokens_per_s": (n_out + sum(len(s.prompt) for s in samples)) / dt,
                "roofline_output_tokens_per_s": n_out / roof["floor_s"], "fraction_of_roofline": roof["floor_s"] / dt,
                "roofline": roof, "num_preemptions": llm.stats()["num_preemptions"]}

    def mixed_unfitted() -> dict:
        """The mixed workload with prompt chunks not fitted to the token buckets (runtime/padding.py)."""
        import dataclasses
        fitted = eng.scheduler.config
        eng.scheduler.config = dataclasses.replace(fitted, token_buckets=())
        try:
            return mixed()
        finally:
            eng.scheduler.config = fitted

    def mixed_profile() -> dict:
        """The mixed workload's steady state under the profiler: after --profile-after steps,
        --profile-steps steps traced (trace_stats.py): GPU busy vs wall per step, kernel time by
        kind (attention, matmul, other) and the top kernels; then the rest is aborted."""
        from jaxllm.benchmarks.roofline import step_kind
        from jaxllm.sampling_params import RequestOutputKind
        from trace_stats import profile
        samples = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, vocab, seed=1)
        eng.kv.reset_prefix_cache()
        for i, s in enumerate(samples):
            eng.add_request(f"prof-{i}", s.prompt, SamplingParams(  # final outputs, as LLM.generate asks
                max_tokens=s.output_len, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
        for _ in range(args.profile_after):
            eng.step()
        running = len(eng.scheduler.running)
        rec = StepRecorder(eng)
        summary = profile(eng.step, args.profile_steps, args.profile_dir, python_tracer=args.python_tracer)
        rec.enabled = False
        C, F = res["rates"]["copy_bytes_per_s"], res["rates"]["matmul_flops_per_s"]
        window = {"decode_steps": sum(step_kind(st) == "decode" for st in rec.steps),
                  "steps": len(rec.steps), "tokens": sum(t for t, _ in rec.steps),
                  "floor_s_per_step": run_floor(cost, rec.steps, C, F)["floor_s"] / max(len(rec.steps), 1)}
        eng.abort_request([f"prof-{i}" for i in range(len(samples))])
        eng.flush()
        return {"running": running, "window": window, **summary}

    if "ttft" in args.parts:
        for n in args.ttft_lens:
            attempt(res, f"ttft_{n}", ttft, n)
            save(res, args.output_json)
    if "prefill" in args.parts:
        attempt(res, "prefill", prefill)
        save(res, args.output_json)
    if "mixed" in args.parts:
        attempt(res, "mixed", mixed)
        save(res, args.output_json)
    if "mixed_unfitted" in args.parts:
        attempt(res, "mixed_unfitted", mixed_unfitted)
    if "mixed_profile" in args.parts:
        attempt(res, "mixed_profile", mixed_profile)
    res["compiles_after_warmup"] = llm.stats()["compiles_after_warmup"]
    return res


def run_hf(args) -> dict:
    import torch
    import transformers as tf

    from jaxllm.benchmarks.hf_peer import hf_config, select_experts
    from jaxllm.models.shapes import get_shape

    cfg = get_shape(args.random_shape)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa",
                                                    dtype=torch.bfloat16).eval()
    res: dict = {"engine": "hf-transformers (sdpa)", "init_s": time.perf_counter() - t0,
                 "torch": torch.__version__, "transformers": tf.__version__,
                 "experts": select_experts(model, "grouped_mm")}  # MoE: grouped_mm where it runs
    vocab = cfg["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(0)
    kw = dict(max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)

    def call(ids: torch.Tensor) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def ttft(n: int) -> dict:
        ids = torch.randint(100, vocab - 100, (1, n), generator=g).cuda()
        call(ids)
        return {"len": n, "ttft_s": statistics.median(call(ids) for _ in range(args.reps))}

    def prefill() -> dict:
        B, n = args.prefill_batch, args.prefill_len
        ids = torch.randint(100, vocab - 100, (B, n), generator=g).cuda()
        call(ids[:2])
        best = min(call(ids) for _ in range(2))
        return {"batch": B, "len": n, "elapsed_s": best, "tokens_per_s": B * n / best}

    for n in args.ttft_lens:
        attempt(res, f"ttft_{n}", ttft, n)
        save(res, args.output_json)
    attempt(res, "prefill", prefill)
    return res


def main() -> None:
    from jaxllm.cli import setup_logging

    setup_logging()  # the engine's start-up lines (kernel choices) in the log
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-shape", default="llama3-8b")
    p.add_argument("--peer", choices=["none", "hf"], default="none", help="hf: run HF transformers instead")
    p.add_argument("--ttft-lens", type=int, nargs="*", default=[2048, 32768])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefill-batch", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=544)
    p.add_argument("--random-output-len", type=int, default=288)
    p.add_argument("--random-range-ratio", type=float, default=0.88)
    p.add_argument("--spec-tflops", type=float, default=SPEC_TFLOPS["H200"], help="the card's dense bf16 peak")
    p.add_argument("--parts", nargs="+", default=["ttft", "prefill", "mixed"],
                   choices=["ttft", "prefill", "mixed", "mixed_unfitted", "mixed_profile"],
                   help="mixed_unfitted: the mixed workload again, chunks not fitted to the buckets; "
                        "mixed_profile: its steady state under jax.profiler (trace_stats.py)")
    p.add_argument("--profile-after", type=int, default=400, help="mixed_profile: steps before the trace")
    p.add_argument("--profile-steps", type=int, default=40, help="mixed_profile: steps traced")
    p.add_argument("--profile-dir", default="/tmp/jaxllm_mixed_trace")
    p.add_argument("--python-tracer", action=argparse.BooleanOptionalAction, default=True,
                   help="mixed_profile: record Python spans (slows the host; --no-python-tracer for "
                        "the real GPU idle time)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    p.add_argument("--quantization", "-q", default=None, help="weights: fp8, int8, int4 (jaxllm only)")
    p.add_argument("--kv-cache-dtype", default=None, help="KV pages: fp8, int8, int4 (jaxllm only)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    res = run_hf(args) if args.peer == "hf" else run_jax(args)
    save(res, args.output_json)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
