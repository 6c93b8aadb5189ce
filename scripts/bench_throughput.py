"""Offline throughput, vLLM `benchmark_throughput`-style, with HF transformers as the peer.

Random prompts of exactly --input-len tokens, --output-len tokens each (EOS
ignored), all submitted at once. With --hf, HF transformers' batched greedy
`generate` runs the same prompts in the same process, and the ratio is printed.

    python scripts/bench_throughput.py --num-prompts 64 --input-len 128 --output-len 64 --hf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))


def run_jaxllm(args, prompts):
    from jaxllm import LLM, SamplingParams

    kw = dict(load_format=args.load_format, random_shape=args.random_shape, dtype=args.dtype, max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              attention_backend=args.attention_backend,
              token_buckets=tuple(args.token_buckets) if args.token_buckets else None,
              seq_buckets=tuple(args.seq_buckets) if args.seq_buckets else None)
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    res = []
    for mode in args.async_scheduling:  # the same engine, overlapped steps on or off
        llm.engine.async_scheduling = mode == "on"
        llm.engine.flush()
        llm.engine.kv.reset_prefix_cache()  # a second run must not hit the first one's prompts
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        st = llm.stats()
        res.append({"engine": f"jaxllm (async {mode})", "elapsed_s": dt, "init_s": init_s,
                    "requests_per_s": len(prompts) / dt, "output_tokens_per_s": n_out / dt,
                    "total_tokens_per_s": (n_out + sum(map(len, prompts))) / dt,
                    "compiles_after_warmup": st["compiles_after_warmup"],
                    "warmup_s": st["warmup_seconds"], "num_preemptions": st["num_preemptions"]})
    return res, llm


def _hf_model(args):
    """(model, device): the embedded SmolLM2 on CPU, or a random-weight shape on the GPU."""
    import torch
    import transformers as tf

    if args.random_shape:
        if not torch.cuda.is_available():
            raise SystemExit("--hf with --random-shape runs on a CUDA GPU (the peer of the device run)")
        from shapes import SHAPES
        cfg = tf.LlamaConfig(**{k: v for k, v in SHAPES[args.random_shape].items() if k != "model_type"})
        with torch.device("cuda"):
            return tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), "cuda"
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
    the first chunk's time (compilation) is reported apart and left out of the rate.
    """
    import torch

    model, device = _hf_model(args)
    kw = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=0)
    if device == "cuda":
        kw["cache_implementation"] = "static"
    ids = torch.tensor(prompts, device=device)
    chunks = [ids[i:i + args.hf_batch] for i in range(0, len(prompts), args.hf_batch)]
    warm_s = 0.0
    with torch.no_grad():
        if device == "cuda":  # compile on the first chunk's shape, untimed
            t0 = time.perf_counter()
            model.generate(chunks[0], attention_mask=torch.ones_like(chunks[0]), **kw)
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for chunk in chunks:
            out = model.generate(chunk, attention_mask=torch.ones_like(chunk), **kw)
        if device == "cuda":
            torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n_out = len(prompts) * args.output_len
    assert out.shape[1] == args.input_len + args.output_len
    return {"engine": "hf-transformers", "elapsed_s": dt, "requests_per_s": len(prompts) / dt,
            "output_tokens_per_s": n_out / dt, "warmup_s": warm_s,
            "total_tokens_per_s": (n_out + sum(map(len, prompts))) / dt, "batch": args.hf_batch}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--random-shape", default=None, help="random weights of a known shape, e.g. llama3-8b")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: --model is a folder with config.json only, weights drawn on the device")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--token-buckets", type=int, nargs="*", default=None)
    p.add_argument("--seq-buckets", type=int, nargs="*", default=None)
    p.add_argument("--async-scheduling", nargs="+", choices=["on", "off"], default=["on"],
                   help="overlapped steps; 'on off' runs both on the same engine")
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate (peer)")
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    from shapes import SHAPES
    vocab = SHAPES[args.random_shape]["vocab_size"] if args.random_shape else 49152
    prompts = rng.integers(min(100, vocab // 4), vocab - min(100, vocab // 4), size=(args.num_prompts, args.input_len)).tolist()
    runs, llm = run_jaxllm(args, prompts)
    jax_res = runs[0]
    results = {"args": vars(args), "machine": f"{platform.node()} {platform.processor()} "
               f"{os.cpu_count()} cpus", "date": time.strftime("%Y-%m-%d"), "jaxllm": jax_res,
               "jaxllm_runs": runs}
    if args.hf:
        del llm
        import gc
        gc.collect()
        results["hf"] = run_hf(args, prompts)
        results["ratio_output_tokens_per_s"] = (jax_res["output_tokens_per_s"]
                                                / results["hf"]["output_tokens_per_s"])
    print(json.dumps(results, indent=2))
    rows = runs + ([results["hf"]] if args.hf else [])
    print(f"\n{'engine':<20}{'req/s':>10}{'out tok/s':>12}{'elapsed s':>12}")
    for r in rows:
        print(f"{r['engine']:<20}{r['requests_per_s']:>10.2f}{r['output_tokens_per_s']:>12.1f}{r['elapsed_s']:>12.2f}")
    if args.hf:
        print(f"jaxllm ({args.async_scheduling[0]}) / HF output tokens/s: "
              f"{results['ratio_output_tokens_per_s']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
