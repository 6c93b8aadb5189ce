"""The kernels of one engine step as XLA compiles it for a Hopper GPU, on a machine without one.

XLA's GPU compiler runs ahead of time on the CPU when given a device description (a
"deviceless" topology, `jax.experimental.topologies`): the step is lowered for cuda and compiled
for an H100 / H200 as on the card, autotuning aside. What comes out is the step's schedule:
every fusion, custom call (jaxllm's Pallas / Mosaic kernels, cuBLAS GEMMs) and copy, each one
kernel launch. Counted here by family, with loops multiplied by their trip counts, that is the
"kernels a step" of a GPU profile (`trace_stats.py`) before any device time is spent: launch-bound
steps (batch-1 decode: 495 kernels a bf16 Llama-3-8B step, 784 with fp8 weights, 1,650 for
Qwen3-30B-A3B) can be cut down here and only confirmed on the card.

Needs jax's cuda plugin beside jax (`pip install "jax[cuda13]==<jax version>"`: ~4 GB, not a
project dependency) and no GPU:

    JAX_PLATFORMS=cpu python scripts/aot_kernels.py --shape llama3-8b --quantization fp8 \
        --tokens 1 --context 2048 [--path mosaic] [--dump step.hlo]

Kernel choices that the engine measures at warm-up are fixed by flags here: `--path` for the
quantized matmuls (the first candidate path of `choice.candidates` with that prefix, per
layout), `--gmm` for the MoE grouped matmul (a `gmm.candidates` name). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
DUMP = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"aot_kernels_{os.getpid()}")
# XLA writes each compiled module's thunk sequence here (read back by `thunks`).
os.environ["XLA_FLAGS"] = (f"--xla_dump_to={DUMP} --xla_dump_hlo_module_re=.*step_flat.* "
                           + os.environ.get("XLA_FLAGS", "")).strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxllm.benchmarks.kernel_count import count, thunks  # noqa: E402

# An H100 SXM as XLA describes it (`GpuTargetConfigProto`); --target h200 changes the memory.
TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: %(bw)d l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: %(mem)d shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 13 minor: 0 }
device_description_str: "%(name)s"
"""
TARGETS = {"h100": dict(bw=3352320000000, mem=84929347584, name="NVIDIA H100 80GB HBM3"),
           "h200": dict(bw=4800000000000, mem=150754820096, name="NVIDIA H200")}

def topology(target: str):
    import importlib.util
    from jax.experimental import topologies
    if importlib.util.find_spec("jax_plugins") is None or not any(
            importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)):
        raise SystemExit("aot_kernels: jax's cuda plugin is not installed; "
                         f'pip install "jax[cuda13]=={jax.__version__}" (no GPU needed)')
    return topologies.get_topology_desc(platform="cuda", target_config=TARGET % TARGETS[target],
                                        topology="1x1x1")


def pretend_gpu(devices) -> None:
    """The project's device checks (`jax.devices()[0]`, `jax.default_backend()`) see the target:
    trace-time kernel choices then take their Hopper branches."""
    jax.devices = lambda *a, **k: list(devices)
    jax.default_backend = lambda: "gpu"


def option(text: str) -> tuple[str, object]:
    """"name=value" -> (name, value): true / false as bools, integers as ints."""
    name, _, v = text.partition("=")
    low = v.lower()
    return name, (low == "true") if low in ("true", "false") else int(v) if v.lstrip("-").isdigit() else v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--quantization", default=None, choices=[None, "fp8", "int8", "int4"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=1, help="the step's token bucket")
    ap.add_argument("--rows", type=int, default=None, help="its request bucket (default: tokens)")
    ap.add_argument("--context", type=int, default=2048, help="max_model_len")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--path", default="mosaic", help="quantized matmul path prefix (xla, pallas, mosaic, mosaic_nk)")
    ap.add_argument("--gmm", default=None, help="MoE grouped matmul (a gmm.candidates name)")
    ap.add_argument("--gemv", default=None,
                    help="a kernels/gemv.py tiling name for every dense linear of a <= 2-token step, as "
                         "the warm-up's measurement (models/gemv_choice.py) would choose it")
    ap.add_argument("--scan", action="store_true", help="the scanned layout (the engine unrolls on GPUs)")
    ap.add_argument("--target", default="h100", choices=sorted(TARGETS))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--option", action="append", type=option,
                    help="an XLA compiler option for the step, name=value (repeatable)")
    ap.add_argument("--dump", default=None, help="write the compiled module's text here")
    args = ap.parse_args()

    topo = topology(args.target)
    pretend_gpu(topo.devices)
    try:
        out = compile_step(args, topo)
    finally:
        import shutil
        shutil.rmtree(DUMP, ignore_errors=True)
    print(json.dumps(out))


def compile_step(args, topo) -> dict:
    import numpy as np
    from flax import nnx

    from jaxllm.engine.device_batch import Batch
    from jaxllm.engine.runner import ModelRunner, pick_attention
    from jaxllm.kernels import gemv, kv_quant
    from jaxllm.models import gemv_choice, registry
    from jaxllm.models.params import set_value, value
    from jaxllm.models.shapes import get_shape
    from jaxllm.quantization import choice
    from jaxllm.quantization.quantize import LINEAR_PARAMS, QUANTIZERS

    hf = get_shape(args.shape)
    entry = registry.resolve(hf)
    cfg = registry.config_from_hf(hf)
    dtype = jnp.bfloat16
    hooks = {}
    if cfg.moe is not None:
        from jaxllm.models import gmm as gmm_mod
        from jaxllm.models.moe import experts
        import functools
        chooser = gmm_mod.Chooser()
        if args.gmm is not None:
            M = args.tokens * cfg.moe.top_k
            H, F = cfg.hidden_size, cfg.moe.moe_intermediate_size
            chooser.impls.update(gmm_mod.candidates(M, cfg.moe.num_experts, H, F, platform="gpu"))
            base = args.gmm.split("+")[0]  # "<direct>+down_<tiling>": its down launch retiled
            chooser.impls.update(gmm_mod.down_variants(base, chooser.impls[base], H, F))
            chooser.choice[M] = args.gmm
        hooks["experts_fn"] = functools.partial(experts, gmm=chooser)
        from jaxllm.kernels import moe_router
        if moe_router.enabled():  # as the engine's runner (JAXLLM_MOE_ROUTER: split unless set)
            hooks["router_fn"] = moe_router.route_small
    from jaxllm.kernels import rope_write
    if rope_write.enabled():  # as the engine's runner on one GPU (JAXLLM_ROPE_WRITE=kernel)
        hooks["rope_write_fn"] = rope_write.rope_write_small
    attn = pick_attention(None, "gpu", 1)

    def make():
        m = entry.model_cls(cfg, dtype, rngs=nnx.Rngs(0), attention_fn=attn, **hooks)
        m.calibrate_kv = False
        return m

    graphdef, params = nnx.split(nnx.eval_shape(make))
    if args.quantization:
        layers = params["layers"]
        quantize = lambda w: jax.lax.map(lambda wl: QUANTIZERS[args.quantization](wl, jnp), w)  # noqa: E731
        for name in LINEAR_PARAMS:
            if name in layers:
                set_value(layers[name], jax.eval_shape(quantize, value(layers[name])))
    layer_params = None
    if not args.scan:  # the engine's unrolled layout; the stacks left as empty placeholders
        layer_params = jax.eval_shape(lambda p: entry.split_layers(p, cfg, shards=1), params)
        for group in ("layers", "experts"):  # as the splits leave them (MoE: "experts" too)
            for var in params.get(group, {}).values():
                set_value(var, jax.ShapeDtypeStruct((0,), value(var).dtype))
    T, R = args.tokens, args.rows or args.tokens
    if args.quantization:
        pick_paths(choice, (params, layer_params), [T], args.path)
        if choice.NK_LAYOUTS:
            params, layer_params = jax.eval_shape(choice.relayout, (params, layer_params))
    if args.gemv is not None and T <= gemv.MAX_ROWS:  # every dense linear at this bucket takes it
        for K, N, dt in gemv_choice.dense_shapes(layer_params):
            if gemv.BY_NAME[args.gemv].fits(K, N):
                gemv_choice._CHOICE[(K, N, T, dt)] = args.gemv

    r = ModelRunner.__new__(ModelRunner)
    r.graphdef, r.dtype, r.block_size, r.tp, r.calibrate_kv = graphdef, dtype, args.block_size, None, False
    r.max_rows, r.spec_width, r.num_traces, r.capture, r.eplb = R, 0, 0, (), None
    step_params = params if layer_params is None else (params, layer_params)
    flat, r._params_def = jax.tree.flatten(step_params)
    s = jax.sharding.SingleDeviceSharding(topo.devices[0])
    put = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
    kv_dtype, kv_width = kv_quant.page_layout(args.kv_cache_dtype, dtype, cfg.head_dim)
    max_blocks = -(-args.context // args.block_size)
    pages = put(jax.ShapeDtypeStruct((cfg.num_layers, 2, cfg.num_kv_heads, args.num_blocks,
                                      args.block_size, kv_width), kv_dtype))
    i32 = lambda *shape: put(jax.ShapeDtypeStruct(shape, jnp.int32))  # noqa: E731
    batch = Batch(i32(5, T), i32(R, max_blocks + 3), 0)
    lowered = jax.jit(r._step_flat, donate_argnums=(1,)).lower(
        [put(a) for a in flat], pages, batch, i32(R))
    compiled = lowered.compile(dict(args.option or []))
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(hlo)
    kernels = count(hlo)
    written = count(hlo, weight="bytes")
    import glob
    # after XLA's thunk passes (command buffers formed); without any, the plain sequence
    seq = (sorted(glob.glob(os.path.join(DUMP, "*step_flat*thunk_sequence_after_thunk_passes.txt")))
           or sorted(glob.glob(os.path.join(DUMP, "*step_flat*thunk_sequence.txt"))))
    launches = thunks(open(seq[-1]).read()) if seq else {"launches": None}
    return {"shape": args.shape, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
            "tokens": T, "rows": R, "layout": "scan" if args.scan else "unrolled",
            "target": args.target, "paths": sorted(set(choice._MEASURED.values())),
            "kernels": sum(kernels.values()), **launches,
            "families": dict(kernels.most_common(args.top)),
            # MB each family's results hold a step (in-place cache updates left out)
            "written_mb": {k: round(v / 2**20, 1) for k, v in written.most_common(args.top)},
            "weight_bytes": int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in flat)),
            # XLA's own accounting of the step (what the pool sizing reads on the card)
            "temp_mb": round(mem.temp_size_in_bytes / 2**20, 1) if mem else None,
            "output_mb": round(mem.output_size_in_bytes / 2**20, 1) if mem else None}


def pick_paths(choice, trees, rows: list[int], prefix: str) -> None:
    """What the warm-up's measurement would set, fixed: each quantized layout's first candidate
    path starting with `prefix` ("xla" where none does), at each row count."""
    from jaxllm.quantization.kernels import NK_PATH
    for w in choice.quantized_leaves(*trees):
        w2 = choice.two_d(w)
        for M in rows:
            x_shape = (M, w2.shape[-2])
            paths = [p for p in choice.candidates(x_shape, w2) if p.startswith(prefix)]
            path = paths[0] if paths else "xla"
            if path.startswith(NK_PATH):
                choice.NK_LAYOUTS.add(choice.layout_key(x_shape, w2)[:-1])
            choice._MEASURED[choice.layout_key(x_shape, w2)] = path


if __name__ == "__main__":
    main()
