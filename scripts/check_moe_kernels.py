"""Session 33's kernels on a GPU, at Qwen3-30B-A3B's shapes, batch 1 in its bucket of 8 tokens:
each checked against the XLA path it replaces, then both timed as chained loops
(`kernels/timing.py`, the engine warm-up's method; the loop's own cost per call printed as
`floor`):

- router: `moe_router.route_tokens` with the RMSNorm (one kernel; and `split`: H cut over
  `default_splits` programs, then a routing launch) vs XLA's RMSNorm, router GEMM, softmax / top-k
  and masking;
- rope_write: `rope_write.rope_write` (head norms, RoPE, K/V write) vs XLA's;
- direct grouped matmul (`moe_gmm.direct_swiglu`, gate/up + down of 8 tokens x top-8) with one
  CTA an item vs persistent CTAs (`ctas`) vs each slot's one row on the CUDA cores (`row_*`, and
  down alone that way: `+down_row_*`), with 1 and with 8 real tokens.

    python3 scripts/check_moe_kernels.py [--json out.json] [--tokens 8] [--cases router rope_write gmm]

One line per case: ok (within tolerance of the XLA path), us per call. Exit status 1 if any
case is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.engine.kernel_probes import xla_rope_write  # noqa: E402
from jaxllm.kernels import moe_gmm, moe_router, rope_write  # noqa: E402
from jaxllm.kernels.timing import loop_floor, time_checked  # noqa: E402
from jaxllm.models.llama import rms_norm  # noqa: E402

T, H, E, K_TOP, F = 8, 2048, 128, 8, 768  # Qwen3-30B-A3B, a batch-1 bucket
NH, NK, D = 32, 4, 128
BF = jnp.bfloat16
INTERPRET = os.environ.get("CHECK_INTERPRET") == "1"  # a CPU smoke run of this script


def flat(*xs) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in xs])


def router_case(rng, real: int) -> tuple[dict, tuple]:
    x = jnp.asarray(rng.standard_normal((T, H)) * 2, BF)
    w = jnp.asarray(rng.standard_normal((H, E)) / np.sqrt(H), BF)
    ln = jnp.asarray(rng.standard_normal(H) * 0.1 + 1, BF)
    valid = jnp.arange(T) < real

    def kernel(x, w, ln, valid, splits=1):
        return flat(*moe_router.route_tokens(x, w, valid, K_TOP, "softmax", True, interpret=INTERPRET,
                                             rms_norm=(ln, 1e-6), splits=splits))

    def split(x, w, ln, valid):
        return kernel(x, w, ln, valid, moe_router.default_splits(H, E))

    def xla(x, w, ln, valid):
        h = rms_norm(x, ln, 1e-6)
        wts, ids = moe_router.route_tokens_ref(h, w, valid, K_TOP, "softmax", True)
        return flat(wts, ids, h)
    return {"xla": xla, "kernel": kernel, "split": split}, (x, w, ln, valid)


def rope_case(rng, real: int) -> tuple[dict, tuple]:
    qkv = jnp.asarray(rng.standard_normal((T, (NH + 2 * NK) * D)), BF)
    qn, kn = (jnp.asarray(rng.standard_normal(D) * 0.1 + 1, BF) for _ in range(2))
    pages = jnp.zeros((2, 2, NK, 16, 16, D), BF)
    slots = jnp.where(jnp.arange(T) < real, jnp.arange(T) * 5, -1).astype(jnp.int32)
    pos = jnp.where(jnp.arange(T) < real, 1000 + jnp.arange(T), -1).astype(jnp.int32)
    inv = (1.0 / 1e6 ** (np.arange(0, D, 2) / D)).astype(np.float32)

    def kernel(qkv, qn, kn, pages):
        q, p = rope_write.rope_write(qkv, (NH, NK), qn, kn, 1e-6, pos, inv, pages, jnp.int32(1), slots,
                                     interpret=INTERPRET)
        return flat(jnp.where((pos >= 0)[:, None, None], q, 0), p)

    def xla(qkv, qn, kn, pages):
        q, p = xla_rope_write(qkv, (NH, NK), qn, kn, 1e-6, pos, inv, pages, jnp.int32(1), slots)
        return flat(jnp.where((pos >= 0)[:, None, None], q, 0), p)
    return {"xla": xla, "kernel": kernel}, (qkv, qn, kn, pages)


def gmm_case(rng, real: int) -> tuple[dict, tuple]:
    x = jnp.asarray(rng.standard_normal((T, H)), BF)
    wg, wu = (jnp.asarray(rng.standard_normal((E, H, F)) / np.sqrt(H), BF) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, H)) / np.sqrt(F), BF)
    ids = np.stack([rng.choice(E, K_TOP, replace=False) for _ in range(T)])
    ids[real:] = E  # padding tokens, as the router kernel gives them
    groups = jnp.asarray(ids.reshape(-1), jnp.int32)
    live = (groups < E)[:, None]
    plain = next(t for t in moe_gmm.TILINGS if t.block_m == 16 and t.block_n == 128 and t.k_splits == 4
                 and not t.ctas)
    rows = [t for t in moe_gmm.TILINGS if t.block_m == 1]  # a slot's one row on the CUDA cores
    row1 = next(t for t in rows if t.k_splits == 1)
    row2 = next(t for t in rows if t.k_splits == 2)
    best = next(t for t in rows if t.name == "row_64x64k4")  # session 37's H200 warm-up choice
    fns = {}
    # (gate/up tiling, down tiling or None: the same)
    for t, d in ((plain, None), (next(t for t in moe_gmm.TILINGS if t.ctas), None), *((r, None) for r in rows),
                 (plain, row1), (best, row1), (best, row2)):
        name = t.name + (f"+down_{d.name}" if d else "")
        fns[name] = lambda x, wg, wu, wd, g, t=t, d=d: flat(jnp.where(
            live, moe_gmm.direct_swiglu(x, wg, wu, wd, g, t, interpret=INTERPRET, down_tiling=d), 0))
    return fns, (x, wg, wu, wd, groups)


def main() -> None:
    global T
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=T, help="the step's token bucket")
    ap.add_argument("--cases", nargs="+", default=["router", "rope_write", "gmm"])
    args = ap.parse_args()
    T = args.tokens
    rng = np.random.default_rng(0)
    floor = loop_floor(jnp.zeros((T, H), BF), reps=args.reps)
    print(f"floor {floor * 1e6:.1f} us per chained call (the loop's own cost)", flush=True)
    rows, bad = [], 0
    cases = [c for c in (("router", router_case), ("rope_write", rope_case), ("gmm", gmm_case))
             if c[0] in args.cases]
    for name, make in [c for c in cases if c[0] != "gmm"] if INTERPRET else cases:
        for real in sorted({1, T}):
            fns, a = make(rng, real)
            ref = np.asarray(jax.jit(next(iter(fns.values())))(*a))
            tol = 1e-2 if name != "gmm" else 2e-2
            times = time_checked(fns, a, args.reps, name, f" ({real} real)", tol=tol, catch=True,
                                 ref=ref, chain=20)
            for impl in fns:
                ok = impl in times
                bad += not ok
                row = dict(case=name, real=real, impl=impl, ok=ok,
                           us=round(times[impl] * 1e6, 2) if ok else None)
                rows.append(row)
                print(f"{name:10s} real={real} {impl:28s} ok={ok} "
                      f"us={row['us'] if ok else '-'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(floor_us=floor * 1e6, rows=rows, device=str(jax.devices()[0])), f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
