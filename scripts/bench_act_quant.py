"""The fused per-token fp8 quantization (jaxllm/kernels/act_quant.py) against what XLA makes of
the same ops, at prefill and decode row counts, Llama-3-8B widths; GPU kernel time from a
profiler trace (bench_kernels.gpu_kernels), and the bytes floor (read x once, write x_q and s).

    python scripts/bench_act_quant.py [--rows 16384 64 1] [--bw 4.8e12] [--output-json F]

Checks each kernel's output against the reference on the same inputs before timing (dequantized
rows within half an fp8 step of the float rows; scales within 1%)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import gpu_kernels  # noqa: E402

from jaxllm.kernels import act_quant as aq  # noqa: E402


def check(q, s, y) -> float:
    """Max error of the dequantized rows over the fp8 bound (<= 1 passes): half an e4m3 step
    (2^-4 relative) plus 2^-7 for bf16 roundings that XLA's ops and the kernel make apart
    (session 27's H100: silu * mul at up to 1.03x of this; XLA rounds silu's intermediates to
    bf16, the kernel keeps float32)."""
    y = np.asarray(y.astype(jnp.float32))
    s = np.asarray(s)
    deq = np.asarray(q.astype(jnp.float32)) * s
    bound = np.maximum(np.abs(y) * (2 ** -4 + 2 ** -7), s * 2 ** -9)
    return float((np.abs(deq - y) / bound).max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[16384, 64, 1])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--bw", type=float, default=4.8e12, help="HBM bytes/s (H200 4.8e12, H100 3.35e12)")
    p.add_argument("--output-json", default=None)
    a = p.parse_args()
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    rows_out = []
    for T in a.rows:
        ks = jax.random.split(jax.random.key(T), 3)
        x = (3 * jax.random.normal(ks[0], (T, a.hidden))).astype(jnp.bfloat16)
        w = (1 + 0.1 * jax.random.normal(ks[1], (a.hidden,))).astype(jnp.bfloat16)
        g = jax.random.normal(ks[2], (T, 2 * a.inter)).astype(jnp.bfloat16)
        gate, up = g[:, :a.inter], g[:, a.inter:]
        cases = {
            "norm": (jax.jit(lambda x, w: aq.norm_quant_ref(x, w, 1e-5)), jax.jit(lambda x, w: aq.norm_quant(x, w, 1e-5)),
                     (x, w), aq.rms_norm_ref(x, w, 1e-5), T * a.hidden * 3 + T * 4),
            "silu_mul": (jax.jit(aq.silu_mul_quant_ref), jax.jit(aq.silu_mul_quant), (gate, up),
                         jax.nn.silu(gate) * up, T * a.inter * 5 + T * 4),
        }
        for hold, warps in (("bfloat16", None), ("bfloat16", 8), ("float32", 8)):  # register variants
            cases[f"silu_mul[{hold},w{warps or aq.num_warps(a.inter)}]"] = (
                cases["silu_mul"][0], jax.jit(lambda g, u, h=hold, w=warps: aq.silu_mul_quant(g, u, hold=h, warps=w)),
                *cases["silu_mul"][2:])
        for name, (ref, ker, args, y, nbytes) in cases.items():
            err = check(*ker(*args), y)
            tr = sum(gpu_kernels(lambda: ref(*args), calls=20).values())
            tk = sum(gpu_kernels(lambda: ker(*args), calls=20).values())
            row = dict(op=name, rows=T, err_over_bound=round(err, 3), xla_us=round(tr * 1e6, 2),
                       kernel_us=round(tk * 1e6, 2), kernel_over_xla=round(tk / tr, 3),
                       floor_us=round(nbytes / a.bw * 1e6, 2), kernel_over_floor=round(tk / (nbytes / a.bw), 2))
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
