"""Where a step's time goes, from a `jax.profiler` trace (perfetto JSON).

`profile(fn, steps, log_dir)` runs `fn` `steps` times under `jax.profiler.trace`
and reads back the perfetto trace JSON the profiler writes beside its xplane
file. Per step it reports: wall time; GPU busy time (the union of kernel
intervals on device 0's streams, so overlapping kernels count once); kernel time
by kind (all-reduce and other collectives, attention, matmul, the rest); and the
host's largest Python-side spans (dispatch of the jitted step, sampling, ...).
Wall minus busy is time the GPU sat idle: host work, launch gaps or syncs.

    python scripts/trace_stats.py /tmp/trace 10   # summarise an existing trace dir
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import time

KINDS = (  # first match wins; names are lower-cased kernel or op names
    ("collective", ("all-reduce", "allreduce", "all_reduce", "nccl", "all-gather", "allgather",
                    "reduce-scatter", "collective")),
    # jaxllm's own matmul kernels are Mosaic / Pallas kernels too (jaxllm_fp8_matmul_*,
    # jaxllm_fp8_gemm_*, jaxllm_int_matmul_*, jaxllm_moe_decode_gmm_*): matmul, not attention
    ("matmul", ("jaxllm_fp8_", "jaxllm_int_matmul", "qmatmul", "gmm", "ragged_dot")),
    ("attention", ("mosaic", "attention", "paged", "pallas", "flash", "fmha", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "cublas", "sm90_xmma", "matmul", "dot", "wgmma")),
    # MoE routing and the rows' reordering (sort, top-k, scatters, gathers): many small kernels
    ("routing", ("sort", "topk", "top_k", "top-k", "scatter", "gather", "cub::")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def family_of(name: str) -> str:
    """A kernel's name without XLA's numbering ("loop_add_fusion_12" -> "loop_add_fusion",
    "fusion.3" -> "fusion"): the kernels a step launches, grouped by what made them."""
    return re.sub(r"(?:[_.]\d+)+$", "", name)[:90]


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def load_events(log_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict], steps: int, wall_s: float | None = None) -> dict:
    """Per-step figures (seconds) from trace events of `steps` steps."""
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpus = sorted(pid for pid, n in procs.items() if "/device:" in n and "CPU" not in n)
    out: dict = {"steps": steps, "devices": [procs[p] for p in gpus]}
    if wall_s is not None:
        out["wall_s"] = wall_s / steps
    # Kernels sit on "Stream" threads; other device threads ("XLA Ops", "XLA Modules")
    # restate the same time at op level and would count it twice.
    per_dev = []
    for pid in gpus:
        ks = [e for e in events if e.get("ph") == "X" and e["pid"] == pid
              and "stream" in threads.get((pid, e.get("tid")), "").lower()]
        by_kind: dict[str, float] = collections.defaultdict(float)
        by_name: dict[str, float] = collections.defaultdict(float)
        fam: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])  # count, time
        for e in ks:
            by_kind[kind_of(e["name"])] += e["dur"]
            by_name[e["name"]] += e["dur"]
            f = fam[family_of(e["name"])]
            f[0] += 1
            f[1] += e["dur"]
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in ks])
        span = (max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)) if ks else 0.0
        per_dev.append({
            "device": procs[pid], "kernels_per_step": len(ks) / steps,
            "busy_s": busy * 1e-6 / steps, "span_s": span * 1e-6 / steps,
            "by_kind_s": {k: v * 1e-6 / steps for k, v in sorted(by_kind.items())},
            "top_kernels_s": {n[:90]: v * 1e-6 / steps
                              for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]},
            # where a launch-bound step's kernels come from: (kernels, seconds) a step per family
            "families": {n: (c / steps, t * 1e-6 / steps)
                         for n, (c, t) in sorted(fam.items(), key=lambda kv: -kv[1][0])[:24]}})
    out["per_device"] = per_dev
    host = collections.defaultdict(float)
    for e in events:  # Python tracer spans ("$file:line fn") and jit dispatches, any host thread
        if e.get("ph") == "X" and "/host" in procs.get(e["pid"], "") and \
                (e["name"].startswith("$") or e["name"].startswith("PjitFunction")):
            host[e["name"]] += e["dur"]
    out["host_top_s"] = {n[:90]: v * 1e-6 / steps
                         for n, v in sorted(host.items(), key=lambda kv: -kv[1])[:12]}
    return out


def profile(fn, steps: int, log_dir: str, python_tracer: bool = True) -> dict:
    """Run fn() `steps` times under the profiler; summarise (never raises: errors are reported).

    `python_tracer=False` records no Python spans: the host then runs at its own speed (the
    tracer slows Python-heavy loops by ~1.6x), so GPU busy vs wall shows the real idle time;
    only C++ host spans (jit dispatches) are left in `host_top_s`."""
    import jax

    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 1 if python_tracer else 0
    try:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=opts):
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            wall = time.perf_counter() - t
        return summarize(load_events(log_dir), steps, wall)
    except Exception as e:  # a profiler missing on some platform must not lose the timings
        return {"error": f"{type(e).__name__}: {e}"}


def print_summary(s: dict, top: int = 0) -> None:
    """One line per device (wall, GPU busy, kernel time by kind, kernels per step), then its
    `top` costliest kernels (ms per step) and its `top` most launched kernel families
    (kernels and ms per step)."""
    if "error" in s:
        print(f"  profile: {s['error']}")
        return
    for d in s["per_device"]:
        kinds = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in d["by_kind_s"].items())
        print(f"  {d['device']}: wall {s.get('wall_s', 0) * 1e3:.2f} ms/step, GPU busy "
              f"{d['busy_s'] * 1e3:.2f} ms ({kinds}), {d['kernels_per_step']:.0f} kernels")
        for name, sec in list(d["top_kernels_s"].items())[:top]:
            print(f"    {sec * 1e3:8.3f} ms  {name}")
        if top and d.get("families"):
            print("    kernels a step by family: " + ", ".join(
                f"{n} {c:.0f} ({t * 1e3:.2f} ms)" for n, (c, t) in list(d["families"].items())[:top]))


if __name__ == "__main__":
    print(json.dumps(summarize(load_events(sys.argv[1]), int(sys.argv[2])), indent=2))
