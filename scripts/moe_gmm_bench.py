"""`bench_moe.py gmm`: one MoE layer's expert matmuls on rows sorted by expert (XLA's
`ragged_dot`, JAX's bundled `ragged_dot_mgpu`, jaxllm's kernels, a gather then einsum, torch's
`_grouped_mm`) against the touched-bytes floor; the timing helpers it shares with the script."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np


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
