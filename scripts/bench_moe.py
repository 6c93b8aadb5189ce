"""MoE on one GPU: the grouped matmul of one layer, the decode step against touched bytes, and
prefill against the matmul rate (MFU on the active parameters).

    python scripts/bench_moe.py gmm     --tokens 1 64 512 8192 --output-json out.json
    python scripts/bench_moe.py decode  --random-shape qwen3-30b-a3b --batch-size 1 64
    python scripts/bench_moe.py decode  --random-shape mixtral-8x7b -tp 2 --enable-expert-parallel
    python scripts/bench_moe.py prefill --random-shape qwen3-30b-a3b --prefill-batch 8 --prefill-len 2048

gmm: one layer's expert matmuls of --random-shape (default Qwen3-30B-A3B: E=128, top-8,
hidden 2048, expert intermediate 768; `--random-shape tiny-moe` checks the wiring on a
CPU), bf16, gate/up fused [E, H, 2F]) on rows already sorted by
expert, random routing. Variants: XLA `jax.lax.ragged_dot`, JAX's bundled Mosaic
GPU `ragged_dot_mgpu` (a few tilings), jaxllm's decode kernel (`kernels/moe_gmm.py`,
`decode_*` tilings, up to 1024 rows), a gather of each row's expert
weights then an einsum (only where rows x expert bytes stay small), and torch
`_grouped_mm` (eager and CUDA graph) as the peer. Each figure is a ratio to the
touched-bytes floor: (distinct experts touched x expert bytes + activations) /
copy bandwidth measured in the same run; TFLOP/s for the large batches.

decode: the engine's decode step at context 2048 against (non-expert weights +
the distinct experts the batch's tokens touched, read from the step's own
per-expert loads + K/V) / copy bandwidth (`roofline.step_cost` with the measured
count); prints the touched-expert count and the uniform-routing expectation
E * (1 - (1 - k/E)^batch) per layer beside it.

decode and prefill take vLLM's parallelism flags (`-tp N`, `--enable-expert-parallel`,
`--enable-eplb --eplb-config JSON`) over this host's devices; figures are per device: the
floor counts a device's share of the weights and K/V and, under expert parallelism, the
experts touched on the busiest device (`device_touched`).

prefill: --prefill-batch prompts of --prefill-len tokens (max_tokens 1, prefix cache
reset, best of --reps after one warm call); MFU = achieved FLOP/s / the dense bf16
matmul rate measured in this process, with the FLOPs of the steps the engine ran
from the ACTIVE parameters (`roofline.ModelCost`: attention, router, top_k experts,
shared expert, dense layers; causal attention pairs; the LM head per sampled row).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from moe_gmm_bench import gmm_bench, save  # noqa: E402


def parallel_kwargs(args) -> dict:
    """The engine's parallelism flags as given (vLLM's names): tensor parallelism over this host's
    devices, whole experts per device, EPLB and its config."""
    kw = {}
    if args.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = args.tensor_parallel_size
    if args.enable_expert_parallel:
        kw["enable_expert_parallel"] = True
    if args.enable_eplb:
        kw["enable_eplb"] = True
        if args.eplb_config:
            kw["eplb_config"] = json.loads(args.eplb_config)
    return kw


def device_touched(loads: np.ndarray, runner) -> float:
    """Distinct (layer, expert) pairs a step read on its busiest device, from the step's rows per
    logical expert [Lm, E]: all of them on one device or with experts split along F (each device
    reads its slice of every touched expert, `ModelCost.expert_bytes` is the slice); under expert
    parallelism without EPLB device d holds experts d * E / N .. (d + 1) * E / N - 1
    (`parallel/experts.py`), so the floor is the device that touched the most; under EPLB
    (replicas placed at run time) the mean over devices, a balanced floor."""
    hit = loads.reshape(loads.shape[0], -1) > 0
    tp = getattr(runner, "tp", None)
    if tp is None or not tp.expert_parallel:
        return float(np.count_nonzero(hit))
    n = tp.tp
    if getattr(runner, "eplb", None) is not None:
        return float(np.count_nonzero(hit)) / n
    per = hit.reshape(hit.shape[0], n, -1).sum(axis=(0, 2))  # [N]: touched pairs a device
    return float(per.max())


def decode_bench(args) -> dict:
    import jax

    from bench_latency import copy_bandwidth, decode_steps, fill_random
    from jaxllm import LLM
    from jaxllm.benchmarks.roofline import ModelCost, step_cost
    from jaxllm.models import moe_model

    init = moe_model.MoeLlama.__init__
    # The step also returns each layer's per-expert row counts (as under EPLB): touched experts.
    moe_model.MoeLlama.__init__ = lambda self, *a, **kw: init(self, *a, **{**kw, "count_loads": True})
    C = copy_bandwidth(args.copy_gib)
    max_b = max(args.batch_size)
    max_len = args.input_len + args.num_iters + 8
    seqs = tuple(sorted({max(b, args.min_bucket) for b in args.batch_size}))
    llm = LLM(random_shape=args.random_shape, dtype="bfloat16", max_model_len=max_len, max_num_seqs=max_b,
              num_gpu_blocks_override=max_b * -(-max_len // 16) + 16, max_num_batched_tokens=max(seqs),
              token_buckets=seqs, seq_buckets=seqs,  # decode buckets only: fewer start-up compiles
              **parallel_kwargs(args))
    moe_model.MoeLlama.__init__ = init
    runner = llm.engine.runner
    loads: list = []
    after = runner._after_step  # EPLB's record / rebalance, kept

    def _after(aux):
        if aux:
            loads.append(aux[0])
        after(aux)
    runner._after_step = _after
    fill_random(runner)
    moe = runner.model_cfg.moe
    cost = ModelCost.of_runner(runner)  # experts as held; touched ones counted per step below
    rng = np.random.default_rng(0)
    chooser = getattr(runner, "gmm_chooser", None)
    res = {"C_bytes_per_s": C, "shape": args.random_shape, "weight_bytes": runner.weight_bytes,
           "parallel": parallel_kwargs(args), "devices": jax.device_count(),
           "expert_bytes_all": cost.all_expert_bytes, "expert_bytes_one": cost.expert_bytes, "rows": [],
           "gmm_choice": chooser.choice if chooser else None,
           "gmm_timings": chooser.timings if chooser else None}
    print("engine grouped matmul by measurement (rows -> impl):", res["gmm_choice"], flush=True)
    for b in args.batch_size:
        loads.clear()
        r = decode_steps(llm, b, args.input_len, args.num_iters, rng, args.profile_steps,
                         args.profile_dir)
        touched = [device_touched(np.asarray(jax.device_get(lo)), runner) for lo in loads[2:args.num_iters]]
        t_mean = float(np.mean(touched)) if touched else float("nan")
        step = (b, [(1, args.input_len, True)] * b)  # one new token per row at context input_len
        floor = step_cost(cost, step, touched=t_mean)[0] / C
        uniform = step_cost(cost, step)[0] / C
        row = {"batch": b, "ctx": args.input_len, "step_s": r["median_s"], "touched_experts": t_mean,
               "touched_uniform": cost.touched(b), "touched_of": len(moe.moe_layers) * cost.local_experts,
               "floor_s": floor, "x_floor": r["median_s"] / floor, "floor_uniform_s": uniform}
        res["rows"].append(row)
        where = ""
        if runner.tp is not None:
            n = runner.tp.tp
            where = (f" a device (mean of {n}: EPLB)" if getattr(runner, "eplb", None) is not None else
                     f" on the busiest of {n} devices" if runner.tp.expert_parallel else f" ({n} devices, each a slice)")
        print(f"decode b={b} ctx={args.input_len}: {r['median_s'] * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms "
              f"({row['x_floor']:.2f}x), touched experts{where} {t_mean:.0f} of {row['touched_of']} "
              f"(uniform routing: {row['touched_uniform']:.0f}, floor {uniform * 1e3:.2f} ms)", flush=True)
        if r.get("profile"):
            from trace_stats import print_summary
            row["profile"] = r["profile"]
            print_summary(r["profile"], top=12)
        save(res, args.output_json)
    res["compiles_after_warmup"] = llm.stats()["compiles_after_warmup"]
    return res


def prefill_bench(args) -> dict:
    from jaxllm import LLM, SamplingParams
    from jaxllm.benchmarks.roofline import ModelCost, StepRecorder, measure_rates, param_counts, run_floor

    rates = measure_rates(args.copy_gib)  # before the engine takes the memory
    F = rates["matmul_flops_per_s"]
    B, n = args.prefill_batch, args.prefill_len
    T = args.max_num_batched_tokens or min(B * n, 8192)
    rows = max(8, B)
    llm = LLM(random_shape=args.random_shape, dtype="bfloat16", max_model_len=n + 16, max_num_seqs=B,
              max_num_batched_tokens=T, token_buckets=(T,), seq_buckets=(rows,),
              num_gpu_blocks_override=B * -(-(n + 16) // 16) + 16, **parallel_kwargs(args))
    eng = llm.engine
    m = eng.model_cfg
    cost = ModelCost.of_runner(eng.runner)
    counts = param_counts(m)
    vocab = m.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, size=n).tolist()} for _ in range(B)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rec = StepRecorder(eng)
    times, steps = [], None
    for i in range(args.reps + 1):  # the first call is the warm one
        eng.kv.reset_prefix_cache()
        rec.clear()
        t = time.perf_counter()
        outs = llm.generate(prompts, one, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
        if i:
            times.append(dt)
            steps = rec.steps
    best = min(times)
    roof = run_floor(cost, steps, rates["copy_bytes_per_s"], F)
    flops = roof["flops"]  # the steps as the engine ran them: active params, attention pairs, LM head
    res = {"shape": args.random_shape, "batch": B, "len": n, "max_num_batched_tokens": T,
           "steps": len(steps), "tokens": sum(t for t, _ in steps), "elapsed_s": best, "all_s": times,
           "tokens_per_s": B * n / best, "flops": flops, "tflops": flops / best / 1e12,
           "mfu": flops / best / F, "mfu_spec": flops / best / (args.spec_tflops * 1e12),
           "floor_s": roof["floor_s"], "x_floor": best / roof["floor_s"], "rates": rates,
           "params_total": counts["total"], "params_active": counts["active"],
           "matmul_params_active": cost.matmul_params,
           "flops_basis": "active parameters" if m.moe is not None else "all parameters (dense)",
           "gmm_choice": eng.runner.gmm_chooser.choice if getattr(eng.runner, "gmm_chooser", None) else None,
           "compiles_after_warmup": llm.stats()["compiles_after_warmup"]}
    print(f"prefill {B} x {n} ({args.random_shape}, {res['steps']} steps of <= {T} tokens): "
          f"{best * 1e3:.1f} ms, {res['tokens_per_s']:.0f} tok/s, {res['tflops']:.1f} TFLOP/s on "
          f"{counts['active'] / 1e9:.3g}B active of {counts['total'] / 1e9:.3g}B params; matmul rate "
          f"{F / 1e12:.1f} TFLOP/s measured -> MFU {res['mfu']:.3f} ({res['mfu_spec']:.3f} of the "
          f"{args.spec_tflops:.0f} TFLOP/s spec)", flush=True)
    return res


def main() -> None:
    from jaxllm.cli import setup_logging

    setup_logging()  # the engine's start-up lines (kernel choices) in the log
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["gmm", "decode", "prefill"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 8192])
    p.add_argument("--random-shape", default="qwen3-30b-a3b",
                   help="the model shape (gmm: its layer's experts, unless given below)")
    p.add_argument("--experts", type=int, default=None, help="gmm: default the shape's")
    p.add_argument("--top-k", type=int, default=None, help="gmm: default the shape's")
    p.add_argument("--hidden", type=int, default=None, help="gmm: default the shape's")
    p.add_argument("--inter", type=int, default=None, help="gmm: default the shape's expert intermediate size")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--num-iters", type=int, default=20)
    p.add_argument("--min-bucket", type=int, default=2,
                   help="decode: the smallest token bucket (2: a batch of 1 padded to two tokens, as "
                        "the engine's default buckets run MoE models on a GPU since session 36; 1: a "
                        "bucket of its own, session 35's default; 8: padded to 8 tokens, as before)")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill: tokens per step (default: batch x len, at most 8192)")
    p.add_argument("--reps", type=int, default=3, help="prefill: timed calls after the warm one (best)")
    p.add_argument("--spec-tflops", type=float, default=989.4, help="the card's dense bf16 peak (H200)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="decode / prefill: devices of this host (attention tensor-parallel; experts "
                        "split along their intermediate dim unless --enable-expert-parallel)")
    p.add_argument("--enable-expert-parallel", action="store_true", help="whole experts per device")
    p.add_argument("--enable-eplb", action="store_true", help="expert-parallel load balancing")
    p.add_argument("--eplb-config", default=None,
                   help='JSON, vLLM\'s names: {"window_size": W, "step_interval": K, "num_redundant_experts": R}')
    p.add_argument("--profile-steps", type=int, default=0,
                   help="decode: this many more steps per batch under jax.profiler (trace_stats.py): "
                        "GPU busy vs wall, kernel time by kind, the costliest kernels")
    p.add_argument("--profile-dir", default="/tmp/jaxllm-moe-trace")
    p.add_argument("--output-json", default=None)
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the copy-bandwidth pass")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="gmm: GPU time per kernel name at <= 64 tokens (a profiler trace per variant)")
    p.add_argument("--impls", nargs="+", default=None,
                   help="gmm: time only the candidates whose names start so (XLA ragged_dot: \"ragged_dot\")")
    p.add_argument("--pairs", action="store_true",
                   help="gmm: also time each kernel with gate and up stored apart, as the engine calls it "
                        "(`<name>_pair`: one launch for both; `<name>_split`: two launches)")
    p.add_argument("--rotations", type=int, default=16,
                   help="gmm: routings timed in turn (<= 512 tokens), so experts come from HBM")
    args = p.parse_args()
    if args.what == "gmm":
        from jaxllm.models import registry
        from jaxllm.models.shapes import get_shape

        m = registry.config_from_hf(get_shape(args.random_shape))
        if m.moe is None:
            p.error(f"--random-shape {args.random_shape} is a dense model")
        for name, v in (("experts", m.moe.num_experts), ("top_k", m.moe.top_k), ("hidden", m.hidden_size),
                        ("inter", m.moe.moe_intermediate_size)):
            if getattr(args, name) is None:
                setattr(args, name, v)
    try:
        res = {"gmm": gmm_bench, "decode": decode_bench, "prefill": prefill_bench}[args.what](args)
    except Exception:
        traceback.print_exc()
        raise
    save(res, args.output_json)


if __name__ == "__main__":
    main()
