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
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))


def save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=float)


def timed(fn, *args, reps: int = 20) -> float:
    """Median seconds of fn(*args) (jitted; blocked on), after ~0.3 s of warm-up."""
    import jax

    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    while time.perf_counter() - t < 0.3:
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def looped(step, reps: int):
    """jit of `reps` dependent applications of step(x, *w) -> x (amortises dispatch)."""
    import jax

    def run(x, *w):
        return jax.lax.fori_loop(0, reps, lambda i, x: step(x, *w), x)
    return jax.jit(run)


def _routing(rng, T: int, k: int, E: int) -> np.ndarray:
    """Group sizes [E] of T random tokens' top-k experts (distinct per token)."""
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).reshape(-1)
    return np.bincount(ids, minlength=E).astype(np.int32)


def gmm_bench(args) -> dict:
    """Each variant is checked against XLA's ragged_dot first (bf16: rel. error <= 3e-2), then
    timed over `--rotations` routings in turn (different experts each call, so small batches'
    experts are read from HBM, not found in the 60 MB L2 from the call before). The "direct_*"
    variants (unsorted rows, `moe_gmm.direct_swiglu`) take the same rows by their expert ids;
    in the engine they also spare the sort and unsort, which this table does not time (the
    decode step does)."""
    import jax
    import jax.numpy as jnp

    from bench_latency import copy_bandwidth
    from jaxllm.models import gmm as gmm_impls
    from jaxllm.models import moe

    E, k, H, F = args.experts, args.top_k, args.hidden, args.inter
    C = copy_bandwidth(args.copy_gib)
    expert_bytes = (H * 2 * F + F * H) * 2
    res = {"C_bytes_per_s": C, "shape": dict(E=E, k=k, H=H, F=F), "random_shape": args.random_shape,
           "rotations": args.rotations, "rows": []}
    key = jax.random.key(0)
    w_gu = (jax.random.normal(key, (E, H, 2 * F), jnp.float32) / np.sqrt(H)).astype(jnp.bfloat16)
    w_d = (jax.random.normal(jax.random.key(1), (E, F, H), jnp.float32) / np.sqrt(F)).astype(jnp.bfloat16)
    w_pair = (jnp.array(w_gu[..., :F]), jnp.array(w_gu[..., F:]))  # the engine's layout: stored apart
    rng = np.random.default_rng(0)
    for T in args.tokens:
        M = T * k
        R = args.rotations if T <= 512 else 1
        sizes_np = np.stack([_routing(rng, T, k, E) for _ in range(R)])  # [R, E]
        sizes_r = jnp.asarray(sizes_np)
        sizes = sizes_r[0]
        touched = float(np.count_nonzero(sizes_np, axis=1).mean())
        x = (jax.random.normal(jax.random.key(2), (M, H), jnp.float32)).astype(jnp.bfloat16)
        floor = (touched * expert_bytes + 2 * M * H * 2 + M * 2 * F * 2) / C
        flops = 2 * M * H * 3 * F
        row = {"tokens": T, "rows": M, "touched_experts": touched, "floor_s": floor}
        reps = R * (1 if R > 1 else (10 if T <= 512 else 3))
        ref = jax.jit(lambda x, a, b, s: gmm_impls.swiglu(x, a, b, s, gmm_impls.ragged_dot_ref))(
            x, w_gu, w_d, sizes)
        # "direct_*" (unsorted rows, one slot a row): the same sorted rows given by their expert ids
        groups_r = jnp.asarray(np.stack([np.repeat(np.arange(E), s) for s in sizes_np]).astype(np.int32))
        variants = []  # (name, swiglu_of(x, a, b, routes), a: w_gu or the engine's (w_gate, w_up))
        for name, impl in gmm_impls.candidates(M, E, H, F).items():
            if args.impls and not name.startswith(tuple(args.impls)):
                continue
            if name.startswith("direct_"):
                mlp = impl.direct_mlp(M)

                def swiglu_of(x, a, b, s, mlp=mlp):  # s: the rows' expert ids here; a: (gate, up)
                    return mlp(x, a[0], a[1], b, s)  # (slicing w_gu here copied it every call)
                variants.append((name, swiglu_of, w_pair))
                continue

            def pair_of(x, a, b, s, impl=impl):  # as the engine calls it, gate and up stored apart
                return moe.expert_mlp(x, a[0], a[1], b, s, impl)
            if hasattr(impl, "swiglu"):  # "wsglu*": gate, up and silu(gate) * up in one launch,
                # the MLP in slot space (as `moe.experts` runs it), "_glu": then down as its own call
                def whole_of(x, a, b, s, mlp=impl.sorted_mlp(M)):
                    return mlp(x, a[0], a[1], b, s)
                variants += [(name, whole_of, w_pair), (name + "_glu", pair_of, w_pair)]
                continue

            def swiglu_of(x, a, b, s, impl=impl):
                return gmm_impls.swiglu(x, a, b, s, impl)
            variants.append((name, swiglu_of, w_gu))
            if hasattr(impl, "pair") and args.pairs:
                # As the engine calls it (models/moe.expert_mlp): `pair` multiplies gate and up
                # in one launch; "_split": two launches of the one-weight call.

                def split_of(x, a, b, s, impl=impl):
                    return moe.expert_mlp(x, a[0], a[1], b, s, lambda x, w, s: impl(x, w, s))
                variants += [(name + "_pair", pair_of, w_pair), (name + "_split", split_of, w_pair)]
        for name, swiglu_of, a_arg in variants:
            routes = groups_r if name.startswith("direct_") else sizes_r
            try:
                got = jax.jit(swiglu_of)(x, a_arg, w_d, routes[0])
                err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) /
                            jnp.linalg.norm(ref.astype(jnp.float32)))
                if not err <= 3e-2:  # NaN fails too: a wrong kernel is not timed
                    row[name] = {"error": f"wrong result: rel. error {err:.3g} vs ragged_dot"}
                    continue

                def run(x, w_gu, w_d, routes, swiglu_of=swiglu_of):
                    def body(i, x):
                        y = swiglu_of(x, w_gu, w_d, routes[i % R])
                        return y.astype(x.dtype) * 0.5 + x * 0.5
                    return jax.lax.fori_loop(0, reps, body, x)
                f = jax.jit(run)
                t = timed(f, x, a_arg, w_d, routes) / reps
                row[name] = {"s": t, "x_floor": t / floor, "tflops": flops / t / 1e12, "rel_err": err}
                if (T <= 64 or args.impls) and args.kernels and jax.default_backend() == "gpu":
                    try:  # where the time goes: GPU time per kernel name per step
                        from bench_kernels import gpu_kernels
                        per = gpu_kernels(lambda: f(x, a_arg, w_d, routes), calls=2)
                        row[name]["kernels_us"] = {k[:70]: round(v / reps * 1e6, 2) for k, v in
                                                   sorted(per.items(), key=lambda kv: -kv[1])[:8]}
                        row[name]["gpu_busy_s"] = sum(per.values()) / reps
                    except Exception as e:  # noqa: BLE001 - the timing above stands
                        row[name]["kernels_us"] = f"{type(e).__name__}: {e}"[:200]
            except Exception as e:  # one variant's failure must not lose the others
                row[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        if M <= 512:
            try:
                order = [np.repeat(np.arange(E), s) for s in sizes_np]  # each sorted row's expert
                row_ids_r = jnp.asarray(np.stack(order).astype(np.int32))

                def gather_run(x, w_gu, w_d, row_ids_r):
                    def body(i, x):
                        ids = row_ids_r[i % R]
                        gu = jnp.einsum("mh,mhf->mf", x, w_gu[ids])
                        g, u = jnp.split(gu, 2, axis=-1)
                        y = jnp.einsum("mf,mfh->mh", jax.nn.silu(g) * u, w_d[ids])
                        return y.astype(x.dtype) * 0.5 + x * 0.5
                    return jax.lax.fori_loop(0, reps, body, x)
                t = timed(jax.jit(gather_run), x, w_gu, w_d, row_ids_r) / reps
                row["gather"] = {"s": t, "x_floor": t / floor, "tflops": flops / t / 1e12}
            except Exception as e:
                row["gather"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        row["torch"] = torch_grouped(np.asarray(x.astype(jnp.float32)), np.asarray(w_gu.astype(jnp.float32)),
                                     np.asarray(w_d.astype(jnp.float32)), sizes_np, floor, flops)
        res["rows"].append(row)
        print(fmt_row(row), flush=True)
        save(res, args.output_json)
    return res


def torch_grouped(x, w_gu, w_d, sizes, floor, flops) -> dict:
    try:
        import torch
        import torch.nn.functional as Fn

        dev = "cuda"
        xt = torch.tensor(x, device=dev, dtype=torch.bfloat16)
        # _grouped_mm wants the second operand's last dim contiguous-by-column: transpose views.
        gu = torch.tensor(w_gu, device=dev, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
        dn = torch.tensor(w_d, device=dev, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
        sizes = np.atleast_2d(sizes)  # [R, E]: the routings, run in turn (as the JAX variants)
        offs_r = [torch.tensor(np.cumsum(s), device=dev, dtype=torch.int32) for s in sizes]
        R = len(offs_r)

        def run():  # each call's input the last one's output mixed in, as the JAX variants' loop
            x_ = xt  # (`y * 0.5 + x * 0.5`: an [M, H] pass both sides pay; XLA fuses the gather
            for offs in offs_r:  # of a slot-major output into it)
                h = torch._grouped_mm(x_, gu, offs=offs)
                g, u = h.chunk(2, dim=-1)
                y = torch._grouped_mm(Fn.silu(g) * u, dn, offs=offs)
                x_ = y * 0.5 + x_ * 0.5
            return x_

        out = {}
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); run(); b.record(); torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3 / R)
        t = statistics.median(ts)
        out["eager"] = {"s": t, "x_floor": t / floor, "tflops": flops / t / 1e12}
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                run()
            ts = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); g.replay(); b.record(); torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3 / R)
            t = statistics.median(ts)
            out["graph"] = {"s": t, "x_floor": t / floor, "tflops": flops / t / 1e12}
        except Exception as e:
            out["graph"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        return out
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:400]}


def fmt_row(row: dict) -> str:
    parts = [f"T={row['tokens']:5d} touched={row['touched_experts']:5.1f} floor={row['floor_s'] * 1e3:.3f}ms"]
    for name, r in row.items():
        if isinstance(r, dict):
            subs = r.items() if name == "torch" and "error" not in r else [(None, r)]
            for sub, v in subs:
                label = f"torch-{sub}" if sub else name
                if not isinstance(v, dict):
                    continue
                parts.append(f"{label}: {v['error'][:60]}" if "error" in v else
                             f"{label} {v['s'] * 1e3:.3f}ms ({v['x_floor']:.2f}x, {v['tflops']:.0f} TF/s)")
    return " | ".join(parts)


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
