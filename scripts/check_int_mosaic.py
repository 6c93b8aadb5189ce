"""Run the Mosaic GPU weight-only matmul (kernels/qmatmul_int_mosaic.py) on the GPU, each case in
its own process (a device fault ends the process that hit it, not the sweep), against x @ the
dequantized weight. Prints one line a case: ok / wrong (rel err) / fault (the last error line).

    python scripts/check_int_mosaic.py [--kinds int4 int8 fp8] [--rows 1 8 64] [--shape 4096x6144]
    python scripts/check_int_mosaic.py --one int4 1 mi_64s8k4 4096 6144   # one case, in-process
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one(kind: str, rows: int, tiling: str, K: int, N: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.kernels import qmatmul_int_mosaic as qi
    from jaxllm.quantization.quantize import quantize_fp8_blocks, quantize_int4, quantize_int8

    rng = np.random.default_rng(rows)
    w = (rng.standard_normal((K, N)) * 0.05 + 0.1).astype(np.float32)
    q = {"int4": lambda: quantize_int4(w, group=128, search=False), "int8": lambda: quantize_int8(w),
         "fp8": lambda: quantize_fp8_blocks(w, 128, 128)}[kind]()
    nk = jax.tree.map(jnp.asarray, qi.to_nk(q))
    x = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
    y = jax.jit(lambda x, w: qi.int_matmul(x, w, qi.Tiling.parse(tiling)))(x, nk)
    y = np.asarray(jax.block_until_ready(y), np.float32)
    want = np.asarray(x, np.float32) @ np.asarray(nk.dequantize(jnp.float32))
    err = float(np.abs(y - want).max() / np.abs(want).max())
    return {"kind": kind, "rows": rows, "tiling": tiling, "rel_err": err, "ok": bool(err < 2e-2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kinds", nargs="+", default=["int8", "fp8", "int4"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 64])
    p.add_argument("--shape", default="4096x6144", help="KxN")
    p.add_argument("--timeout", type=int, default=120)
    p.add_argument("--max-tilings", type=int, default=2, help="per kind and row count")
    p.add_argument("--json", default=None)
    p.add_argument("--one", nargs=5, default=None, metavar=("KIND", "ROWS", "TILING", "K", "N"))
    a = p.parse_args()
    if a.one:
        k, r, t, K, N = a.one
        print("RESULT " + json.dumps(one(k, int(r), t, int(K), int(N))), flush=True)
        return
    from jaxllm.kernels import qmatmul_int_mosaic as qi

    K, N = (int(v) for v in a.shape.split("x"))
    out = []
    for kind in a.kinds:
        for rows in a.rows:
            for t in qi.tilings_for(rows, K, N, 132, kind)[:a.max_tilings]:
                cmd = [sys.executable, __file__, "--one", kind, str(rows), t.name, str(K), str(N)]
                try:
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                    res = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
                    if res:
                        row = json.loads(res[-1][7:])
                    else:
                        errs = [ln for ln in (r.stderr + r.stdout).splitlines()
                                if "Error" in ln or "error" in ln][-3:]
                        row = {"kind": kind, "rows": rows, "tiling": t.name, "ok": False,
                               "fault": " | ".join(e[-200:] for e in errs) or f"rc={r.returncode}"}
                except subprocess.TimeoutExpired:
                    row = {"kind": kind, "rows": rows, "tiling": t.name, "ok": False, "fault": "timeout"}
                out.append(row)
                print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
