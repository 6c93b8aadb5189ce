"""Correctness of the Mosaic prefill kernel on the GPU, with the error located.

    python3 scripts/check_prefill.py [--variants mosaic,mosaic:64:4,mosaic_wg,jax_mgpu]
    python3 scripts/check_prefill.py --kv-cache-dtype fp8 fp8_e5m2   # the same cases on fp8 pages
    python3 scripts/check_prefill.py --kv-cache-dtype int8 int4      # ... on int8 / int4 pages

Each case (ragged requests, chunks over a cached prefix, decode rows, GQA 1/4/8, page sizes
16-128) runs every variant twice: with random q, and with q = 0 (uniform attention over the
visible keys: isolates the V/mask/PV path from the QK path). Outputs poisoned (NaN) first.
Per case: rel err vs the float32 reference (`ref.py` on upcast inputs), NaN rows (unwritten),
and where the error sits: per query head in the group, per request, per row index mod 128.
With `--kv-cache-dtype`, each case also runs on its pages stored in that format (fp8: scale 1.0;
int8 / int4: per-token scales in the pages; `bench_prefill.page_case`), against the reference on
the same stored pages (int pages the kernel's copies cannot move, e.g. int8 pages of 64 keys at
D = 128, report the kernel's refusal). A variant without `:BK:stages` takes the kernel's default
block (128 keys for bf16 pages, 64 for fp8 and int pages at D = 128).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_prefill import make_case, page_case  # noqa: E402
from jaxllm.kernels import mosaic_prefill, ref  # noqa: E402

CASES = {  # name: (contexts, new tokens, pad tokens, (H, K), page)
    "one256_g1_p128": ([256], [256], 0, (8, 8), 128),
    "one256_g1_p16": ([256], [256], 0, (8, 8), 16),
    "one256_g4_p16": ([256], [256], 0, (32, 8), 16),
    "one300_g4_p64": ([300], [300], 4, (32, 8), 64),
    "mixed_g4_p16": ([300, 20, 9, 1000, 77], [300, 1, 9, 333, 1], 5, (32, 8), 16),
    "mixed_g1_p16": ([129, 64, 700], [129, 1, 200], 3, (8, 8), 16),
    "mixed_g8_p32": ([515, 33, 2], [515, 1, 2], 0, (64, 8), 32),
}


def variant(name: str):
    kind, *parts = name.split(":")
    if kind == "pallas":  # the portable ragged kernel (reads every page format): a harness check
        from jaxllm.kernels import pallas_ragged
        return jax.jit(lambda q, kv, md: pallas_ragged.ragged_paged_attention(
            q, kv, jnp.int32(0), md, sm_scale=0.1))
    if kind == "twin":  # the portable twin: a check of this harness
        from jaxllm.kernels import pallas_prefill
        return jax.jit(lambda q, kv, md: pallas_prefill.ragged_prefill_attention(
            q, kv, jnp.int32(0), md, sm_scale=0.1))
    bk, st = (int(parts[0]), int(parts[1])) if parts else (None, 2)
    sem = "Warpgroup" if kind == "mosaic_wg" else None
    f = functools.partial(mosaic_prefill.ragged_prefill_attention, sm_scale=0.1,
                          block_keys=bk, num_stages=st, semantics=sem)
    return jax.jit(lambda q, kv, md: f(q, kv, jnp.int32(0), md))


def locate(got, want, case) -> dict:
    real = case["real"]
    g, w = got[:real].astype(np.float64), want[:real].astype(np.float64)
    nan_rows = np.nonzero(~np.isfinite(got).all(axis=(1, 2)))[0]
    g = np.where(np.isfinite(g), g, 1e3)
    d = np.linalg.norm(g - w, axis=2) / (np.linalg.norm(w, axis=2) + 1e-9)  # [T, H]
    H, K = got.shape[1], case["kv"].shape[2]
    G = H // K
    bad = d > 0.05
    out = dict(rel_err=float(np.linalg.norm(g - w) / np.linalg.norm(w)),
               nan_rows=len(nan_rows), nan_first=nan_rows[:8].tolist(),
               pad_nonzero=bool(np.abs(np.nan_to_num(got[real:], nan=1.0)).sum() > 0),
               bad_frac=float(bad.mean()),
               err_by_g=[float(np.median(d[:, k * G:(k + 1) * G].reshape(real, G)[:, j]))
                         for k in (0,) for j in range(G)],
               err_by_kvh=[float(np.median(d[:, k * G:(k + 1) * G])) for k in range(K)])
    qs = np.cumsum([0] + case["news"])
    out["err_by_req"] = [float(np.median(d[qs[r]:qs[r + 1]])) for r in range(len(case["news"]))]
    rowmod = np.arange(real) % 128
    out["bad_by_row_mod128_in16"] = [float(bad[(rowmod // 16) == b].mean()) for b in range(8)]
    out["bad_rows_first"] = np.nonzero(bad.any(axis=1))[0][:12].tolist()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="mosaic,mosaic:64:4")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8", "fp8_e5m2", "int8", "int4"],
                   help="page formats to run every case on")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "check_prefill.json"))
    args = p.parse_args()
    res = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=[])
    for cname in args.cases.split(","):
        ctx, new, pad, heads, page = CASES[cname]
        base = make_case(ctx, page, seed=3, news=new, pad_tokens=pad, heads=heads)
        cases = {f: page_case(base, f) for f in args.kv_cache_dtype}  # pages converted once a format
        for fmt, zero_q in [(f, z) for f in args.kv_cache_dtype for z in (False, True)]:
            case = cases[fmt]
            q = jnp.zeros_like(case["q"]) if zero_q else case["q"]
            kv = case["kv"]  # int pages: the reference dequantizes them as the kernels do
            want = np.asarray(ref.ragged_paged_attention(
                q.astype(jnp.float32), kv if kv.dtype == jnp.uint8 else kv.astype(jnp.float32),
                jnp.int32(0), case["md"], sm_scale=0.1))
            for vname in args.variants.split(","):
                tag = f"{cname} {'q=0' if zero_q else 'q~N'} {vname}" + ("" if fmt == "auto" else f" {fmt}")
                try:
                    fn = variant(vname)
                    jax.block_until_ready(fn(q, case["kv"], case["md"]))
                    poison = jnp.full(q.shape, jnp.nan, q.dtype)
                    jax.block_until_ready(poison)
                    del poison
                    got = np.asarray(fn(q, case["kv"], case["md"]).astype(jnp.float32))
                    row = dict(tag=tag, **locate(got, want, case))
                except Exception:  # noqa: BLE001
                    row = dict(tag=tag, error=traceback.format_exc()[-2500:])
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                json.dump(res, open(args.out, "w"), indent=1)
    print("\nsummary (rel err, NaN rows, bad fraction):")
    for r in res["rows"]:
        print(f"  {r['tag']:42s} " + (f"E {r['error'].splitlines()[-1][:100]}" if "error" in r else
                                      f"{r['rel_err']:.2e} nan={r['nan_rows']} bad={r['bad_frac']:.2f}"))


if __name__ == "__main__":
    main()
