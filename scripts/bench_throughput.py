"""Offline throughput, vLLM `benchmark_throughput`-style, with HF transformers as the peer.

Workloads with vLLM's flags (`jaxllm/benchmarks/datasets.py`): `--dataset-name random
--random-input-len N --random-output-len M --random-range-ratio R` (lengths uniform in
[N(1-R), N(1+R)]; `--input-len` / `--output-len` are aliases, R = 0 fixed lengths) or
`--dataset-name jsonl --dataset-path F`. EOS is ignored, all prompts submitted at once.
Prints throughput, TTFT / ITL / end-to-end percentiles (ITL offline: each request's mean
gap between tokens) and the run's roofline (`jaxllm/benchmarks/roofline.py`: per step the
larger of bytes / copy bandwidth and FLOPs / matmul rate, both measured in this process)
with the fraction achieved. With --hf (fixed lengths only), HF transformers' batched greedy
`generate` runs the same prompts in the same process, and the ratio is printed.

Mixture-of-experts shapes (`--random-shape qwen3-30b-a3b`, `tiny-moe`, ...): the roofline's
FLOPs are the active parameters' and a step's bytes the experts its tokens touch
(`roofline.ModelCost`); the HF peer runs the experts implementation of `--hf-experts`
(default grouped_mm for prefill and decode, eager where grouped_mm cannot run; see
`jaxllm/benchmarks/hf_peer.py`) and the JSON records what was asked, what was configured
and what a short probe generate saw each phase run (`hf.experts`). When the model does not
fit twice on the device, run the peer in its own process first and hand its figures over:

    python scripts/bench_throughput.py --random-shape qwen3-30b-a3b ... --hf --hf-only --output-json hf.json
    python scripts/bench_throughput.py --random-shape qwen3-30b-a3b ... --hf-result hf.json --output-json out.json

`--quantization` / `--kv-cache-dtype` (vLLM's flags) quantize the weights at load and the KV pages;
the roofline counts the bytes the engine then holds.

    python scripts/bench_throughput.py --num-prompts 64 --input-len 128 --output-len 64 --hf
    python scripts/bench_throughput.py --random-shape llama3-8b --dataset-name random \
        --random-input-len 544 --random-output-len 288 --random-range-ratio 0.88 --num-prompts 1000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from jaxllm.benchmarks.datasets import add_dataset_args, load_dataset, max_lengths, percentiles  # noqa: E402


def build_llm(args, max_model_len: int):
    from jaxllm import LLM

    kw = dict(load_format=args.load_format, random_shape=args.random_shape, dtype=args.dtype,
              max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
              token_buckets=tuple(args.token_buckets) if args.token_buckets else None,
              seq_buckets=tuple(args.seq_buckets) if args.seq_buckets else None,
              gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    return llm, time.perf_counter() - t0


def latency_stats(outs) -> dict:
    ttft, itl, e2e = [], [], []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m.first_token_time is not None:
            ttft.append(m.first_token_time - m.arrival_time)
        if n > 1 and m.last_token_time is not None:
            itl.append((m.last_token_time - m.first_token_time) / (n - 1))
        if m.finished_time is not None:
            e2e.append(m.finished_time - m.arrival_time)
    return {"ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl), "e2e_ms": percentiles(e2e)}


def run_jaxllm(args, llm, init_s, samples, rates):
    from jaxllm import SamplingParams
    from jaxllm.benchmarks.roofline import ModelCost, StepRecorder, run_floor

    params = [SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True) for s in samples]
    prompts = [{"prompt_token_ids": s.prompt} if isinstance(s.prompt, list) else s.prompt for s in samples]
    rec = StepRecorder(llm.engine)
    res = []
    for mode in args.async_scheduling:  # the same engine, overlapped steps on or off
        llm.engine.async_scheduling = mode == "on"
        llm.engine.flush()
        llm.engine.kv.reset_prefix_cache()  # a second run must not hit the first one's prompts
        rec.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        st = llm.stats()
        quant = "" if args.quantization is None and args.kv_cache_dtype == "auto" else \
            f", {args.quantization or 'bf16'} weights, {args.kv_cache_dtype} KV"
        r = {"engine": f"jaxllm (async {mode}{quant})", "elapsed_s": dt, "init_s": init_s,
             "requests_per_s": len(prompts) / dt, "output_tokens_per_s": n_out / dt,
             "total_tokens_per_s": (n_out + n_in) / dt, "input_tokens": n_in, "output_tokens": n_out,
             "compiles_after_warmup": st["compiles_after_warmup"], "warmup_s": st["warmup_seconds"],
             "num_preemptions": st["num_preemptions"], **latency_stats(outs)}
        if rates:
            roof = run_floor(ModelCost.of_runner(llm.engine.runner), rec.steps, rates["copy_bytes_per_s"],
                             rates["matmul_flops_per_s"])
            r["roofline"] = {**roof, "fraction": roof["floor_s"] / dt,
                             "output_tokens_per_s": n_out / roof["floor_s"]}
        res.append(r)
    return res


def _hf_model(args):
    """(model, device): the embedded SmolLM2 on CPU, or a random-weight shape: on the GPU, or
    on the CPU where the jaxllm run is on the CPU too (tiny shapes: the wiring's smoke test)."""
    import torch
    import transformers as tf

    if args.random_shape:
        from jaxllm.benchmarks.hf_peer import hf_config
        from shapes import get_shape
        if torch.cuda.is_available():
            device, dtype = "cuda", torch.bfloat16
        else:
            import jax
            if jax.default_backend() != "cpu":
                raise SystemExit("--hf with --random-shape runs on a CUDA GPU (the peer of the device run)")
            device, dtype = "cpu", torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = tf.AutoModelForCausalLM.from_config(hf_config(get_shape(args.random_shape)), dtype=dtype)
        return model.eval(), device
    if args.model is not None:
        raise SystemExit("--hf compares against the embedded model or a --random-shape only")
    from jaxllm.models.loader import embedded_model_path
    path = embedded_model_path()
    dtype = torch.float32 if args.dtype != "bfloat16" else torch.bfloat16
    model = tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=dtype)
    torch.set_num_threads(os.cpu_count() or 1)
    return model.eval(), "cpu"


def run_hf(args, prompts):
    """HF transformers batched greedy `generate`, --hf-batch prompts at a time.

    On the GPU with a static cache, which transformers runs through torch.compile;
    the first chunk's time (compilation) is reported apart and left out of the rate
    (if that compiled run fails, the dynamic cache runs instead, and the JSON says so).
    A MoE model runs the experts implementation of --hf-experts (`hf_peer.select_experts`),
    checked by a short untimed probe generate (`hf_peer.probe_experts`).
    """
    import torch
    import transformers as tf

    from jaxllm.benchmarks import hf_peer

    t0 = time.perf_counter()
    model, device = _hf_model(args)
    experts = hf_peer.select_experts(model, args.hf_experts)
    experts["probe"] = hf_peer.probe_experts(model)
    init_s = time.perf_counter() - t0
    print(f"HF experts implementation: {json.dumps(experts)}", flush=True)
    kw = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=0)
    cache = "dynamic"
    if device == "cuda":
        kw["cache_implementation"] = cache = "static"
    ids = torch.tensor(prompts, device=device)
    chunks = [ids[i:i + args.hf_batch] for i in range(0, len(prompts), args.hf_batch)]
    warm_s = 0.0
    with torch.no_grad():
        if device == "cuda":  # compile on the first chunk's shape, untimed
            t0 = time.perf_counter()
            try:
                model.generate(chunks[0], attention_mask=torch.ones_like(chunks[0]), **kw)
            except Exception as e:  # the compiled static-cache path failed: the dynamic cache
                import traceback
                traceback.print_exc()
                kw.pop("cache_implementation")
                cache = f"dynamic (static failed: {type(e).__name__}: {str(e)[:200]})"
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            print(f"hf warm-up (compile + one chunk of {len(chunks[0])}): {warm_s:.1f} s", flush=True)
        t0 = time.perf_counter()
        for i, chunk in enumerate(chunks):
            out = model.generate(chunk, attention_mask=torch.ones_like(chunk), **kw)
            if device == "cuda":  # progress, so that a run cut off by a time limit still tells its rate
                torch.cuda.synchronize()
                print(f"hf chunk {i + 1}/{len(chunks)} ({len(chunk)} prompts): {time.perf_counter() - t0:.1f} s",
                      flush=True)
    dt = time.perf_counter() - t0
    n_out = len(prompts) * args.output_len
    assert out.shape[1] == args.input_len + args.output_len
    return {"engine": "hf-transformers", "elapsed_s": dt, "requests_per_s": len(prompts) / dt,
            "output_tokens_per_s": n_out / dt, "warmup_s": warm_s, "init_s": init_s,
            "total_tokens_per_s": (n_out + sum(map(len, prompts))) / dt, "batch": args.hf_batch,
            "device": device, "dtype": str(next(model.parameters()).dtype), "cache": cache,
            "experts": experts, "torch": torch.__version__, "transformers": tf.__version__}


# The workload fields an --hf-result file must share with this run.
WORKLOAD = ("random_shape", "model", "num_prompts", "random_input_len", "random_output_len", "seed", "dtype")


def main() -> None:
    from jaxllm.cli import setup_logging

    setup_logging()  # the engine's start-up lines (kernel choices) in the log
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--random-shape", default=None, help="random weights of a known shape, e.g. llama3-8b")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: --model is a folder with config.json only, weights drawn on the device")
    add_dataset_args(p)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", "-q", default=None,
                   help="weights quantized at load (vLLM's flag): fp8, int8, int4; a quantized checkpoint's own")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3, fp8_e5m2, int8, int4")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt + output")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--token-buckets", type=int, nargs="*", default=None)
    p.add_argument("--seq-buckets", type=int, nargs="*", default=None)
    p.add_argument("--async-scheduling", nargs="+", choices=["on", "off"], default=["on"],
                   help="overlapped steps; 'on off' runs both on the same engine")
    p.add_argument("--no-roofline", action="store_true", help="skip measuring copy bandwidth / matmul rate")
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate (peer; fixed lengths)")
    p.add_argument("--hf-batch", type=int, default=64)
    from jaxllm.benchmarks.hf_peer import EXPERTS_CHOICES
    p.add_argument("--hf-experts", default="grouped_mm", choices=EXPERTS_CHOICES,
                   help="HF MoE experts implementation (grouped_mm: prefill and decode, eager where it "
                        "cannot run; hf-default: transformers' choice, batched_mm in decode off the CPU)")
    p.add_argument("--hf-only", action="store_true",
                   help="run only the HF peer (its own process, the whole device); see --hf-result")
    p.add_argument("--hf-result", default=None,
                   help="the JSON of an --hf-only run of the same workload: its figures are the peer's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    try:
        max_in, max_out = max_lengths(args)
    except ValueError as e:
        p.error(str(e))
    if (args.hf or args.hf_only) and (args.dataset_name != "random" or args.random_range_ratio):
        p.error("--hf runs batched generate: it needs --dataset-name random with --random-range-ratio 0")
    if args.hf_result and (args.hf or args.hf_only):
        p.error("--hf-result takes the peer's figures from a file: drop --hf / --hf-only")
    if args.hf_only:
        if not args.random_shape:
            p.error("--hf-only needs --random-shape (the jaxllm run builds the same shape)")
        from jaxllm.benchmarks.datasets import load_dataset as _load
        from shapes import get_shape
        samples = _load(args, get_shape(args.random_shape)["vocab_size"])
        args.input_len, args.output_len = args.random_input_len, args.random_output_len
        results = {"args": vars(args), "machine": f"{platform.node()} {platform.processor()} "
                   f"{os.cpu_count()} cpus", "date": time.strftime("%Y-%m-%d"),
                   "hf": run_hf(args, [s.prompt for s in samples])}
        print(json.dumps(results, indent=2))
        hf = results["hf"]
        print(f"hf-transformers ({hf['experts'].get('prefill')} / {hf['experts'].get('decode')} experts, "
              f"{hf['cache']} cache): {hf['output_tokens_per_s']:.1f} out tok/s, {hf['elapsed_s']:.2f} s")
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=2)
        return
    peer = None
    if args.hf_result:
        with open(args.hf_result) as f:
            peer = json.load(f)
        diff = {k: (peer["args"].get(k), getattr(args, k)) for k in WORKLOAD if peer["args"].get(k) != getattr(args, k)}
        if diff:
            p.error(f"--hf-result {args.hf_result} ran another workload: {diff}")

    rates = None
    if not args.no_roofline:
        from jaxllm.benchmarks.roofline import measure_rates
        rates = measure_rates()  # before the engine takes the memory
    if args.dataset_name == "jsonl" and args.max_model_len is None:
        p.error("--dataset-name jsonl needs --max-model-len")
    llm, init_s = build_llm(args, args.max_model_len or max_in + max_out)
    samples = load_dataset(args, llm.engine.model_cfg.vocab_size)
    runs = run_jaxllm(args, llm, init_s, samples, rates)
    jax_res = runs[0]
    results = {"args": vars(args), "machine": f"{platform.node()} {platform.processor()} "
               f"{os.cpu_count()} cpus", "date": time.strftime("%Y-%m-%d"), "rates": rates,
               "jaxllm": jax_res, "jaxllm_runs": runs}
    if args.output_json:  # before the peer: its failure must not lose these figures
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    if args.hf:
        del llm
        import gc
        gc.collect()
        args.input_len, args.output_len = args.random_input_len, args.random_output_len
        results["hf"] = run_hf(args, [s.prompt for s in samples])
    elif peer is not None:
        results["hf"] = dict(peer["hf"], from_file=args.hf_result)
    if "hf" in results:
        results["ratio_output_tokens_per_s"] = (jax_res["output_tokens_per_s"]
                                                / results["hf"]["output_tokens_per_s"])
    print(json.dumps(results, indent=2))
    rows = runs + ([results["hf"]] if "hf" in results else [])
    w = max(20, *(len(r["engine"]) + 2 for r in rows))
    print(f"\n{'engine':<{w}}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>13}{'elapsed s':>11}")
    for r in rows:
        print(f"{r['engine']:<{w}}{r['requests_per_s']:>10.2f}{r['output_tokens_per_s']:>12.1f}"
              f"{r['total_tokens_per_s']:>13.1f}{r['elapsed_s']:>11.2f}")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    for r in runs:
        print(f"{r['engine']}: {'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
        for name in ("ttft_ms", "itl_ms", "e2e_ms"):
            print(f"  {name[:-3].upper():<12}" + "".join(f"{fmt(r[name][k]):>10}" for k in ("mean", "p50", "p90", "p99")))
        if "roofline" in r:
            ro = r["roofline"]
            print(f"  roofline: {ro['floor_s']:.2f} s for {ro['steps']} steps ({ro['memory_bound_steps']} "
                  f"memory-bound) at C={ro['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
                  f"{ro['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s -> {ro['output_tokens_per_s']:.1f} out tok/s; "
                  f"achieved {ro['fraction']:.2f} of it")
    if "hf" in results:
        ex = results["hf"].get("experts") or {}
        print(f"jaxllm ({args.async_scheduling[0]}) / HF output tokens/s: "
              f"{results['ratio_output_tokens_per_s']:.2f}x (HF experts: prefill {ex.get('prefill')}, "
              f"decode {ex.get('decode')}; probe {ex.get('probe')})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
