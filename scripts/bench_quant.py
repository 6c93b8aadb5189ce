"""GPU: quantized-weight matmuls and quantized-KV decode attention against their byte floors.

    python scripts/bench_quant.py matmul [--tokens 1 64 8192]   Llama-3-8B linears
    python scripts/bench_quant.py attention [--batch 64 --ctx 2048]

matmul: the four Llama-3-8B linear shapes (qkv, o, gate_up, down) at each token count, per
path: bf16 x @ W; fp8 W8A8 through XLA's fp8 dot (W stored [N, K], dynamic per-token
activation scales, per-channel weight scales; the compiled HLO is checked for the cuBLASLt
fp8 GEMM); int8 / int4 weight-only through XLA (dequantize-then-dot); int8 through JAX's
bundled Hopper mixed-type Mosaic kernel; int8 / int4 through jaxllm's Pallas (Triton) kernel
(`kernels/qmatmul.py`, decode-sized token counts: the engine's tiling and the first one); fp8
W8A8 through jaxllm's Mosaic GPU kernel (`kernels/qmatmul_mosaic.py`, <= 64 tokens, every
tiling the warm-up would offer); int4 g128, int8 and HF FP8 128 x 128 blocks (`--modes fp8b`)
through jaxllm's Mosaic GPU weight-only kernel (`kernels/qmatmul_int_mosaic.py`, its [N, K]
layout made once from the weight); fp8 W8A8 at prefill-sized token counts through jaxllm's
warp-specialized GEMM with the scales fused (`kernels/fp8_gemm_ws.py`, "fp8_w8a8_ws_*"); torch `_scaled_mm` fp8 (per-tensor and rowwise
scales) and torch bf16 as peers. Kernel time (profiler, launch gaps excluded), weights
rotated over several copies so L2 never holds them. Floors: weight bytes incl. scales over
4.25 TB/s and over C, the copy bandwidth measured in the same run; TFLOP/s where compute-bound.

attention: decode, one token per request, batch B at context ctx, Llama-3-8B heads
(32 q / 8 kv, D 128, 16-token pages): the Mosaic decode kernel (bf16 and fp8 pages) and the Pallas
kernel on bf16 / fp8 / int8 / int4 pages; each quantized run checked against the reference
on the same pages. Ratios are to the bf16 Mosaic kernel and to the pages' byte floor.
Every measurement is in its own try/except: one failure prints and the rest go on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_kernels import copy_bandwidth, decode_case, gpu_kernels, gpu_time, rel_err  # noqa: E402

from jaxllm.kernels import kv_quant, qmatmul  # noqa: E402
from jaxllm.kernels import fp8_gemm_ws as fg  # noqa: E402
from jaxllm.kernels import qmatmul_int_mosaic as qi  # noqa: E402
from jaxllm.kernels import qmatmul_mosaic as qm  # noqa: E402
from jaxllm.quantization.choice import num_sms  # noqa: E402
from jaxllm.quantization.kernels import fp8_w8a8, int8_mgpu, matmul, pallas_tiling  # noqa: E402
from jaxllm.quantization.quantize import (quantize_fp8, quantize_fp8_blocks, quantize_int4,  # noqa: E402
                                          quantize_int8)

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
HBM = 4.25e12
COPIES = 3  # weight sets rotated per call


SINK: dict = {"path": None, "rows": []}  # every row is saved as it comes: a timeout loses nothing


def record(row: dict) -> None:
    SINK["rows"].append(row)
    print(json.dumps(row), flush=True)
    if SINK["path"]:
        with open(SINK["path"], "w") as f:
            json.dump({"C": SINK.get("C"), "rows": SINK["rows"]}, f, indent=1)


def cycle_kernels(fn, xs, ws) -> dict[str, float]:
    """Kernel seconds per call by kernel name, cycling weight copies (so the L2 never holds W)."""
    it = [0]

    def call():
        it[0] += 1
        return fn(xs, ws[it[0] % len(ws)])
    return gpu_kernels(call, calls=len(ws))


def torch_time(fn, reps: int = 60) -> float:
    import torch
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def qbytes(q) -> int:
    """Bytes of a weight's arrays as stored (jnp.int4 packs two a byte; its `nbytes` says one)."""
    return sum(x.size // 2 if x.dtype in (jnp.int4, jnp.uint4) else x.nbytes for x in jax.tree.leaves(q))


def bench_matmul(tokens: list[int], C: float, tilings: str = "engine", modes=("fp8", "int8", "int4"),
                 peers: bool = True, only: tuple[str, ...] = ()) -> list[dict]:
    rows = []
    key = jax.random.key(0)
    for name, (K, N) in SHAPES.items():
        ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02
              for i in range(COPIES)]
        quant = {}
        for mode, qf in (("fp8", quantize_fp8), ("int8", quantize_int8), ("int4", quantize_int4)):
            if mode not in modes:
                continue
            try:
                quant[mode] = [jax.jit(lambda w, qf=qf: qf(w, jnp))(w) for w in ws]
            except Exception as e:  # noqa: BLE001
                print(f"{name} quantize {mode}: {e!r}", flush=True)
        if "fp8b" in modes:  # HF FP8 checkpoints' layout: weight-only, 128 x 128 block scales
            quant["fp8b"] = [jax.device_put(quantize_fp8_blocks(np.asarray(w.astype(jnp.float32))))
                             for w in ws]
        for M in tokens:
            x = jax.random.normal(jax.random.fold_in(key, 99), (M, K), jnp.bfloat16)
            flops = 2 * M * K * N
            act = M * K * 2 + M * N * 2
            paths = {"bf16": (lambda x, w: x @ w, ws, K * N * 2)}
            if "fp8" in quant:
                paths["fp8_w8a8_xla"] = (lambda x, w: fp8_w8a8(x, w), quant["fp8"], qbytes(quant["fp8"][0]))
            if "int8" in quant:
                paths["int8_w8a16_xla"] = (lambda x, w: matmul(x, w, "xla"), quant["int8"], qbytes(quant["int8"][0]))
                pairs = [(q, jnp.asarray(q.values.T)) for q in quant["int8"]]  # W^T stored once
                paths["int8_w8a16_mgpu"] = (lambda x, p: int8_mgpu(x, p[0], p[1]), pairs,
                                            qbytes(quant["int8"][0]))
            for mode, wa in (("int4", "w4a16"), ("fp8b", "w8a16")):
                if mode in quant:
                    paths[f"{mode}_{wa}_xla"] = (lambda x, w: matmul(x, w, "xla"), quant[mode], qbytes(quant[mode][0]))
            for mode in ("int8", "int4", "fp8", "fp8b"):  # jaxllm's Pallas (Triton) kernel (fp8: weight-only)
                if mode not in quant:
                    continue
                picked = pallas_tiling(x.shape, quant[mode][0])
                swept = qmatmul.TILINGS if tilings == "all" else (picked, qmatmul.TILINGS[0])
                for t in dict.fromkeys(t for t in swept if t is not None):
                    if qmatmul.unsupported(x.shape, quant[mode][0], t) is None:
                        wa = {"int8": "w8a16", "int4": "w4a16", "fp8": "w8a16", "fp8b": "w8a16"}[mode]
                        paths[f"{mode}_{wa}_pallas_{t.name}"] = (
                            lambda x, w, t=t: qmatmul.qmatmul(x, w, t), quant[mode], qbytes(quant[mode][0]))
            if "fp8" in quant and M <= qm.MAX_ROWS:  # jaxllm's Mosaic GPU fp8 W8A8 kernel, every tiling offered
                for t in qm.tilings_for(M, K, N, num_sms()):
                    paths[f"fp8_w8a8_mosaic_{t.name}"] = (
                        lambda x, w, t=t: qm.fp8_w8a8(x, w, t), quant["fp8"], qbytes(quant["fp8"][0]))
            if "fp8" in quant and M > qm.MAX_ROWS:  # jaxllm's warp-specialized fp8 GEMM, scales fused
                for t in fg.TILINGS + fg.CHAINED:
                    if t.unsupported(M, K, N) is None:
                        paths[f"fp8_w8a8_ws_{t.name}"] = (
                            lambda x, w, t=t: fg.fp8_w8a8(x, w, t), quant["fp8"], qbytes(quant["fp8"][0]))
            for mode in ("int4", "int8", "fp8b"):  # jaxllm's Mosaic GPU weight-only kernel ([N, K] layout)
                if mode not in quant or M > qi.MAX_ROWS or not qi.takes(quant[mode][0]):
                    continue
                try:
                    nk = [jax.jit(qi.to_nk)(q) for q in quant[mode]]
                    wa = {"int4": "w4a16", "int8": "w8a16", "fp8b": "w8a16"}[mode]
                    for t in qi.tilings_for(M, K, N, num_sms(), nk[0].kind):
                        paths[f"{mode}_{wa}_mosaic_{t.name}"] = (
                            lambda x, w, t=t: qi.int_matmul(x, w, t), nk, qbytes(nk[0]))
                except Exception as e:  # noqa: BLE001
                    print(f"{name} {mode} to_nk: {e!r}", flush=True)
            ref = None
            if only:  # bf16 stays: it is the reference the others' errors are taken against
                paths = {k: v for k, v in paths.items() if k == "bf16" or any(o in k for o in only)}
            for path, (fn, wl, wbytes) in paths.items():
                row = {"shape": name, "K": K, "N": N, "tokens": M, "path": path, "weight_bytes": wbytes}
                try:
                    f = jax.jit(fn)
                    out = f(x, wl[0]).astype(jnp.float32)
                    if path == "bf16":
                        ref = out
                    elif ref is not None:
                        q0 = wl[0][0] if isinstance(wl[0], tuple) else wl[0]
                        want = x.astype(jnp.float32) @ q0.dequantize(jnp.float32)
                        row["rel_err_vs_dequant"] = rel_err(out, want)
                    if path == "fp8_w8a8_xla":
                        hlo = f.lower(x, wl[0]).compile().as_text()
                        row["fp8_gemm_in_hlo"] = "f8e4m3" in hlo and ("cublas" in hlo.lower() or "gemm" in hlo.lower())
                        row["transpose_in_hlo"] = " transpose(" in hlo
                    per = cycle_kernels(f, x, wl)
                    t = sum(per.values())
                    if "pallas" in path or "mosaic" in path or "_ws_" in path:  # the kernel vs the XLA ops around it
                        own = ("qmatmul" if "pallas" in path else fg.KERNEL_NAME if "_ws_" in path else
                               qi.KERNEL_NAME if path.startswith("int") else qm.KERNEL_NAME)
                        row["kernel_s"] = sum(v for k, v in per.items() if own in k)
                        row["other_kernels"] = {k[:60]: round(v * 1e6, 2) for k, v in per.items()
                                                if own not in k}
                    floor = (wbytes + act) / HBM
                    row.update(seconds=t, x_floor_4_25=t / floor, x_floor_C=t / ((wbytes + act) / C),
                               tflops=flops / t / 1e12)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                record(row)
            if peers:
                rows += torch_peers(name, K, N, M, C)
    return rows


def torch_peers(name: str, K: int, N: int, M: int, C: float) -> list[dict]:
    out = []
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return [{"shape": name, "tokens": M, "path": "torch", "error": repr(e)}]
    Mp = max(16, -(-M // 16) * 16)  # cuBLASLt fp8 wants multiples of 16
    act = M * K * 2 + M * N * 2
    try:
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        x = torch.randn(Mp, K, device="cuda", dtype=torch.bfloat16)
        w8 = [w.to(torch.float8_e4m3fn) for w in ws]
        x8 = x.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda", dtype=torch.float32)
        sa, sb = torch.ones(Mp, 1, device="cuda"), torch.ones(1, N, device="cuda")
        i = [0]

        def nxt(lst):
            i[0] += 1
            return lst[i[0] % len(lst)]
        cases = {
            "torch_bf16": (lambda: x[:M] @ nxt(ws).t(), K * N * 2),
            "torch_fp8_tensor": (lambda: torch._scaled_mm(x8, nxt(w8).t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.bfloat16), K * N),
            "torch_fp8_rowwise": (lambda: torch._scaled_mm(x8, nxt(w8).t(), scale_a=sa, scale_b=sb,
                                                           out_dtype=torch.bfloat16), K * N + 4 * N),
        }
        for path, (fn, wbytes) in cases.items():
            row = {"shape": name, "K": K, "N": N, "tokens": M, "path": path, "weight_bytes": wbytes}
            try:
                t = torch_time(fn)
                row.update(seconds=t, x_floor_4_25=t / ((wbytes + act) / HBM),
                           x_floor_C=t / ((wbytes + act) / C), tflops=2 * M * K * N / t / 1e12)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out.append(row)
            record(row)
        del ws, w8
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        out.append({"shape": name, "tokens": M, "path": "torch", "error": repr(e)})
    return out


def quantized_kv(kv_bf16: jax.Array, fmt: str) -> tuple[jax.Array, int]:
    """The bf16 pool's pages stored as `fmt` ("auto": as they are) and the bytes of one
    stored K or V row."""
    dtype, width = kv_quant.page_layout(fmt, jnp.bfloat16, kv_bf16.shape[-1])
    kv = kv_bf16 if fmt == "auto" else jax.jit(lambda k: kv_quant.encode(k, dtype, width))(kv_bf16)
    return kv, width * jnp.dtype(dtype).itemsize


def bench_attention(batch: int, ctx: int, C: float) -> list[dict]:
    from jaxllm.kernels import mosaic_decode, pallas_ragged, ref

    case = decode_case(batch, ctx, 16)
    kv_bf16, qs, md, layers = case["kv"], case["qs"], case["md"], case["layers"]
    scale = 128 ** -0.5
    rows, base = [], None
    for fmt in ("auto", "fp8", "int8", "int4"):
        try:
            kv, row_bytes = quantized_kv(kv_bf16, fmt)
        except Exception as e:  # noqa: BLE001
            rows.append({"kv": fmt, "error": repr(e)})
            continue
        page_bytes = batch * ctx * 8 * 2 * row_bytes
        kernels = {"pallas": lambda q, kv, l: pallas_ragged.ragged_paged_attention(q, kv, l, md, sm_scale=scale)}
        if fmt in ("auto", "fp8", "int8", "int4"):  # the formats the Mosaic decode kernel reads
            kernels["mosaic"] = lambda q, kv, l: mosaic_decode.paged_decode_attention(q, kv, l, md, sm_scale=scale)
        want = jax.jit(lambda q, kv: ref.ragged_paged_attention(q, kv, jnp.int32(0), md, sm_scale=scale))(qs[0], kv)
        for kname, fn in kernels.items():
            row = {"kv": fmt, "kernel": kname, "batch": batch, "ctx": ctx, "page_bytes": page_bytes}
            try:
                f = jax.jit(fn)
                row["rel_err_vs_ref_same_pages"] = rel_err(f(qs[0], kv, jnp.int32(0)), want)
                it = [0]

                def call():
                    it[0] += 1
                    return f(qs[it[0] % (layers + 1)], kv, jnp.int32(it[0] % layers))
                t = gpu_time(call, calls=2 * layers + 2)
                row.update(seconds=t, x_floor_C=t / (page_bytes / C))
                if fmt == "auto" and kname == "mosaic":
                    base = t
                if base:
                    row["x_bf16_mosaic"] = t / base
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
            rows.append(row)
            record(row)
        del kv
    return rows


def main() -> None:
    from jaxllm.cli import setup_logging

    setup_logging()  # the engine's start-up lines (kernel choices) in the log
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["matmul", "attention"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 8192])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--json", default=None)
    p.add_argument("--tilings", choices=["engine", "all"], default="engine",
                   help="matmul: jaxllm's Pallas kernel in the engine's tiling and the first, or every tiling")
    p.add_argument("--modes", nargs="+", default=["fp8", "int8", "int4"],
                   help="matmul: weight formats (fp8 per channel W8A8, int8, int4 g128, fp8b: HF FP8 blocks)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="matmul: which Llama-3-8B linears")
    p.add_argument("--no-peers", action="store_true", help="matmul: leave out the torch peers")
    p.add_argument("--paths", nargs="+", default=[],
                   help="matmul: only the paths whose names contain one of these (e.g. mosaic xla); bf16 always")
    a = p.parse_args()
    C = copy_bandwidth(2.0)["C"]
    SINK.update(path=a.json, C=C)
    print(f"C = {C / 1e12:.2f} TB/s", flush=True)
    for name in [n for n in SHAPES if n not in a.shapes]:
        del SHAPES[name]
    rows = (bench_matmul(a.tokens, C, a.tilings, a.modes, not a.no_peers, tuple(a.paths)) if a.what == "matmul"
            else bench_attention(a.batch, a.ctx, C))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"C": C, "rows": rows}, f, indent=1)
    print("\nsummary")
    for r in rows:
        if "error" in r:
            print(f"  {r.get('shape', r.get('kv'))} {r.get('tokens', '')} {r.get('path', r.get('kernel'))}: "
                  f"ERROR {r['error'][:120]}")
        elif a.what == "matmul":
            kern = f" kernel {r['kernel_s'] * 1e6:.1f} us" if "kernel_s" in r else ""
            print(f"  {r['shape']:>8} M={r['tokens']:<5} {r['path']:<34} {r['seconds'] * 1e6:9.1f} us "
                  f"{r['x_floor_4_25']:6.2f}x floor(4.25) {r['x_floor_C']:6.2f}x floor(C) "
                  f"{r['tflops']:7.1f} TFLOP/s{kern}")
        else:
            print(f"  kv={r['kv']:<5} {r['kernel']:<7} {r['seconds'] * 1e6:8.1f} us  "
                  f"{r['x_floor_C']:5.2f}x floor  {r.get('x_bf16_mosaic', float('nan')):5.2f}x bf16 mosaic  "
                  f"err {r['rel_err_vs_ref_same_pages']:.1e}")


if __name__ == "__main__":
    main()
