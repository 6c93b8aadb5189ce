"""Check and time the paged-attention kernels on the GPU; one device command.

    python3 scripts/bench_kernels.py [--batch 8,64,256] [--ctx 512,2048,8192] [--page 16]
        [--kernels ref,pallas,mosaic,jaxpa] [--smoke] [--mixed] [--out $OUT/bench_kernels.json]

For every (batch, context, page) decode case: Llama-3-8B attention heads (32 q, 8 kv,
head_dim 128), bf16, every request at the full context, pages shuffled in the pool.
Each kernel is first checked against the jnp reference (bf16 rel err < 1e-2): its
output memory is poisoned (a NaN array of the output's size is made and freed just
before the call, so the allocator hands that memory back) and the checked call uses
a second query set, so unwritten or stale rows fail. Then it is timed: L layers of
KV (L chosen so the pool is >= 4x the 60 MB L2, rotating like the layer scan) are
run back to back inside one jit, many jits queued per timed group, median of groups.
fraction-of-C = (KV bytes read + q read + out written) / time / C, with C the
device-to-device copy bandwidth measured in the same run (read + write bytes).
Kernels: ref = XLA gather-then-attend (ref.py); pallas = pallas_ragged (Triton);
mosaic = mosaic_decode (+ XLA combine when split); jaxpa = JAX's bundled Pallas
paged_attention (jax.experimental.pallas.ops.gpu.paged_attention).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import mosaic_decode, pallas_ragged, ref  # noqa: E402
from jaxllm.kernels.metadata import AttentionMetadata  # noqa: E402

H, K, D = 32, 8, 128
L2_BYTES = 60 * 2**20


def copy_bandwidth(gib: float = 4.0) -> dict:
    """C: device-to-device copy, bytes read + written per second (torch copy_ and XLA f32)."""
    res = {}
    n = int(gib * 2**30) // 2
    try:
        import torch
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        res["torch_copy"] = 2 * n * 2 / float(np.median(ts))
        del src, dst
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        res["torch_error"] = repr(e)
    x = jax.random.normal(jax.random.key(0), (n // 2,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001 + 1.0)
    res["xla_f32_ew"] = 2 * x.nbytes / time_fn(lambda: f(x), inner=5)
    del x
    res["C"] = res.get("torch_copy", res["xla_f32_ew"])
    return res


def time_fn(call, inner: int = 10, groups: int = 7) -> float:
    """Median seconds per call: `inner` async calls per timed group, after warm-up."""
    jax.block_until_ready(call())
    jax.block_until_ready(call())
    ts = []
    for _ in range(groups):
        t0 = time.perf_counter()
        outs = [call() for _ in range(inner)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) / inner)
    return float(np.median(ts))


def gpu_kernels(call, calls: int = 5) -> dict[str, float]:
    """Seconds of GPU time per call of each kernel name (from a jax.profiler trace; memcpys
    left out): the device cost without host launch/dispatch gaps, split by kernel."""
    import glob
    import tempfile
    jax.block_until_ready(call())
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    jax.block_until_ready([call() for _ in range(calls)])
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    per: dict[str, float] = {}
    for plane in data.planes:
        if plane.name.startswith("/device:GPU:0"):
            for line in plane.lines:
                if "Stream" in line.name:
                    for e in line.events:
                        if "emcpy" not in e.name:
                            per[e.name] = per.get(e.name, 0.0) + e.duration_ns * 1e-9 / calls
    if not per:
        raise RuntimeError(f"no GPU kernel events in planes {[p.name for p in data.planes]}")
    return per


def gpu_time(call, calls: int = 5) -> float:
    """Seconds of GPU kernel time per call (sum of kernel durations from a jax.profiler
    trace): the device cost without host launch/dispatch gaps."""
    return sum(gpu_kernels(call, calls).values())


MAX_LAYERS = 16


def decode_case(batch: int, ctx: int, page: int, seed: int = 0) -> dict:
    """Random bf16 pool with L layers, shuffled block tables, one decode token per request."""
    layer_bytes = batch * ctx * K * D * 2 * 2
    layers = int(min(MAX_LAYERS, max(1, -(-4 * L2_BYTES // layer_bytes))))
    ppr = -(-ctx // page)
    num_pages = batch * ppr + 8
    rng = np.random.default_rng(seed)
    tables = rng.permutation(num_pages)[:batch * ppr].reshape(batch, ppr).astype(np.int32)
    pos = np.full(batch, ctx - 1, np.int32)
    md = AttentionMetadata(
        positions=jnp.asarray(pos), token_req=jnp.arange(batch, dtype=jnp.int32),
        slot_mapping=jnp.asarray(tables[:, (ctx - 1) // page] * page + (ctx - 1) % page),
        block_tables=jnp.asarray(tables), seq_lens=jnp.full((batch,), ctx, jnp.int32),
        query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32),
        num_seqs=jnp.array([batch], jnp.int32))
    k1, k2 = jax.random.split(jax.random.key(seed))
    kv = jax.random.normal(k1, (layers, 2, K, num_pages, page, D), jnp.bfloat16)
    qs = jax.random.normal(k2, (layers + 1, batch, H, D), jnp.bfloat16)
    nbytes = layer_bytes + 2 * batch * H * D * 2
    return dict(kv=kv, qs=qs, md=md, layers=layers, nbytes=nbytes, tables=tables)


def kernel_fns(names: list[str], args) -> dict:
    """name -> fn(q, kv, layer, md). Variants: pallas:ROWS:KEYS:WARPS:STAGES,
    mosaic:SPLITS:STAGES:BLOCK_KEYS[:REDUCTION_SCRATCH_BYTES], mosaicraw:... (kernel only, no split combine; unchecked),
    noop (q + 1: the per-call launch floor)."""
    out = {}
    scale = D ** -0.5
    for name in names:
        kind, *parts = name.split(":")
        arg = lambda i, default: int(parts[i]) if len(parts) > i and parts[i] else default
        if kind == "ref":
            out[name] = functools.partial(ref.ragged_paged_attention, sm_scale=scale)
        elif kind == "noop":
            out[name] = lambda q, kv, layer, md, sm_scale=None: q + 1
        elif kind == "pallas":
            out[name] = functools.partial(
                pallas_ragged.ragged_paged_attention, sm_scale=scale,
                block_rows=arg(0, args.block_rows), block_keys=arg(1, args.block_keys),
                num_warps=arg(2, 4), num_stages=arg(3, 2))
        elif kind in ("mosaic", "mosaicraw"):
            out[name] = functools.partial(
                mosaic_decode.paged_decode_attention, sm_scale=scale,
                num_splits=arg(0, 0) or None, num_stages=arg(1, 0) or None,
                block_keys=arg(2, args.mosaic_block_keys), return_partials=kind == "mosaicraw",
                reduction_scratch_bytes=arg(3, -1) if arg(3, -1) >= 0 else None)
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(fn, case, want) -> float:
    """Poisoned, second-input check; returns rel err (inf if any NaN)."""
    kv, qs, md = case["kv"], case["qs"], case["md"]
    jf = jax.jit(fn)
    jax.block_until_ready(jf(qs[0], kv, jnp.int32(0), md))
    poison = jnp.full(qs[-1].shape, jnp.nan, qs.dtype)
    jax.block_until_ready(poison)
    del poison
    got = np.asarray(jf(qs[-1], kv, jnp.int32(0), md).astype(jnp.float32))
    return float("inf") if not np.isfinite(got).all() else rel_err(got, want)


def run_jaxpa(case, scale):
    """JAX's bundled Triton paged_attention on per-layer K/V arrays (same shuffled tables)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    ppr = case["tables"].shape[1]
    splits = next(s for s in (16, 8, 4, 2, 1) if ppr % s == 0)
    ks = [case["kv"][l, 0] for l in range(case["layers"])]
    vs = [case["kv"][l, 1] for l in range(case["layers"])]
    tables = jnp.asarray(case["tables"])
    lengths = case["md"].seq_lens
    fn = jax.jit(functools.partial(paged_attention, k_splits=splits))
    one = lambda q, l: fn(q * scale, ks[l], vs[l], tables, lengths)  # it applies no scale
    return one, ks, vs


def bench_case(batch, ctx, page, names, args, C) -> dict:
    case = decode_case(batch, ctx, page)
    kv, qs, md, L = case["kv"], case["qs"], case["md"], case["layers"]
    scale = D ** -0.5
    want = np.asarray(jax.jit(functools.partial(ref.ragged_paged_attention, sm_scale=scale))(
        qs[-1], kv, jnp.int32(0), md).astype(jnp.float32))
    row = dict(batch=batch, ctx=ctx, page=page, layers=L, bytes=case["nbytes"], kernels={})
    fns = kernel_fns([n for n in names if n != "jaxpa"], args)
    for name in names:
        res = {}
        try:
            if name == "jaxpa":
                one, ks, vs = run_jaxpa(case, scale)
                got = np.asarray(one(qs[-1], 0).astype(jnp.float32))
                res["rel_err"] = rel_err(got, want)
                qsl = [qs[l] for l in range(L)]
                allf = lambda: [one(qsl[l], l) for l in range(L)]
                t = time_fn(allf, inner=args.inner) / L
                del ks, vs
            else:
                fn = fns[name]
                unchecked = name.startswith(("mosaicraw", "noop"))
                res["rel_err"] = 0.0 if unchecked else check(fn, case, want)
                f = jax.jit(lambda qs, kv, md: [fn(qs[l], kv, jnp.int32(l), md) for l in range(L)])
                t = time_fn(lambda: f(qs, kv, md), inner=args.inner) / L
                if args.profile:
                    try:
                        g = gpu_time(lambda: f(qs, kv, md)) / L
                        res.update(gpu_us=g * 1e6, gpu_frac_C=case["nbytes"] / g / C)
                    except Exception as e:  # noqa: BLE001
                        res["profile_error"] = repr(e)[-500:]
            res.update(us=t * 1e6, frac_C=case["nbytes"] / t / C, ok=res["rel_err"] < 1e-2)
        except Exception as e:  # noqa: BLE001
            res["error"] = "".join(traceback.format_exception_only(type(e), e))[-2000:]
            traceback.print_exc()
        row["kernels"][name] = res
        print(f"  B={batch} ctx={ctx} S={page} {name}: {res}", flush=True)
    del case, kv, qs
    return row


def smoke(names, args) -> list:
    """Small shapes, every GQA ratio, ragged contexts, padding token: rel err vs ref."""
    out = []
    rng = np.random.default_rng(1)
    for group, kvh, page in ((4, 2, 16), (8, 1, 16), (1, 4, 32)):
        ctxs = [1, 17, 200, 63, 129]
        ppr = [-(-c // page) for c in ctxs]
        num_pages = sum(ppr) + 4
        perm = rng.permutation(num_pages)
        tables = np.zeros((len(ctxs) + 1, max(ppr) + 1), np.int32)
        i = 0
        for r, n in enumerate(ppr):
            tables[r, :n] = perm[i:i + n]
            i += n
        pos = np.array([c - 1 for c in ctxs] + [-1], np.int32)  # last token = padding
        md = AttentionMetadata(
            positions=jnp.asarray(pos), token_req=jnp.array(list(range(len(ctxs))) + [0], jnp.int32),
            slot_mapping=jnp.zeros(len(pos), jnp.int32), block_tables=jnp.asarray(tables),
            seq_lens=jnp.array(ctxs + [0], jnp.int32),
            query_start_loc=jnp.array(list(range(len(ctxs) + 1)) + [len(ctxs)], jnp.int32),
            num_seqs=jnp.array([len(ctxs)], jnp.int32))
        kv = jnp.asarray(rng.standard_normal((2, 2, kvh, num_pages, page, 128)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((len(pos), kvh * group, 128)), jnp.bfloat16)
        want = np.asarray(ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.1),
                          np.float32)
        fns = kernel_fns([n for n in names if n.split(":")[0] in ("ref", "pallas", "mosaic")], args)
        for name, fn in fns.items():
            for ns in ((1, 2) if name.startswith("mosaic") else (None,)):
                kw = dict(num_splits=ns) if ns else {}
                tag = f"G={group} K={kvh} S={page} {name}{'' if ns is None else f' splits={ns}'}"
                try:
                    got = np.asarray(jax.jit(functools.partial(fn, sm_scale=0.1, **kw))(
                        q, kv, jnp.int32(1), md).astype(jnp.float32)) if name != "ref" else want
                    err = rel_err(got, want) if np.isfinite(got).all() else float("inf")
                    pad0 = bool((got[-1] == 0).all())
                    print(f"smoke {tag}: rel_err={err:.2e} pad_zero={pad0}", flush=True)
                    out.append(dict(tag=tag, rel_err=err, pad_zero=pad0))
                except Exception as e:  # noqa: BLE001
                    msg = "".join(traceback.format_exception_only(type(e), e))[-3000:]
                    print(f"smoke {tag}: ERROR {msg}", flush=True)
                    out.append(dict(tag=tag, error=msg))
    return out


def mixed_case(args, C) -> dict:
    """Prefill/mixed step: 4 chunks of 512 new tokens + 60 decode rows, all at context 2048."""
    ctx, page, chunk, n_pre, n_dec = 2048, 16, 512, 4, 60
    case = decode_case(n_pre + n_dec, ctx, page, seed=5)
    new = [chunk] * n_pre + [1] * n_dec
    pos = np.concatenate([np.arange(ctx - n, ctx) for n in new]).astype(np.int32)
    req = np.repeat(np.arange(len(new)), new).astype(np.int32)
    pad = -len(pos) % 64
    md = AttentionMetadata(
        positions=jnp.asarray(np.concatenate([pos, -np.ones(pad, np.int32)])),
        token_req=jnp.asarray(np.concatenate([req, np.zeros(pad, np.int32)])),
        slot_mapping=jnp.zeros(len(pos) + pad, jnp.int32), block_tables=case["md"].block_tables,
        seq_lens=case["md"].seq_lens, query_start_loc=jnp.asarray(np.cumsum([0] + new), jnp.int32),
        num_seqs=case["md"].num_seqs)
    q = jax.random.normal(jax.random.key(9), (len(pos) + pad, H, D), jnp.bfloat16)
    kv, L = case["kv"], case["layers"]
    want = np.asarray(ref.ragged_paged_attention(q, kv, jnp.int32(0), md, sm_scale=D ** -0.5),
                      np.float32)
    row = dict(kind="mixed", tokens=len(pos) + pad, kernels={})
    names = [n for n in args.kernels.split(",") if n.startswith(("ref", "pallas"))]
    for name, fn in kernel_fns(names, args).items():
        try:
            got = np.asarray(jax.jit(fn)(q, kv, jnp.int32(0), md).astype(jnp.float32))
            f = jax.jit(lambda q, kv, md: [fn(q, kv, jnp.int32(l), md) for l in range(L)])
            t = time_fn(lambda: f(q, kv, md), inner=3, groups=5) / L
            row["kernels"][name] = dict(us=t * 1e6, rel_err=rel_err(got, want),
                                        frac_C=case["nbytes"] / t / C)
        except Exception as e:  # noqa: BLE001
            row["kernels"][name] = dict(error=repr(e)[-1500:])
        print(f"  mixed {name}: {row['kernels'][name]}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p.add_argument("--batch", type=ints, default=[8, 64, 256])
    p.add_argument("--ctx", type=ints, default=[512, 2048, 8192])
    p.add_argument("--page", type=ints, default=[16])
    p.add_argument("--kernels", default="ref,pallas,mosaic,jaxpa",
                   help="comma list; mosaic:SPLITS:STAGES:BLOCK_KEYS picks a variant")
    p.add_argument("--block-rows", type=int, default=64)
    p.add_argument("--block-keys", type=int, default=64)
    p.add_argument("--mosaic-block-keys", type=int, default=64)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--profile", action="store_true", help="also GPU kernel time from a trace")
    p.add_argument("--max-layers", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="small-shape correctness first")
    p.add_argument("--mixed", action="store_true", help="also time the prefill/mixed case")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--prefill", action="store_true",
                   help="prefill attention only (scripts/bench_prefill.py): paged kernels vs peers")
    p.add_argument("--prefill-cases", default="2048,8192,32768,ragged8,mixed")
    p.add_argument("--prefill-kernels",
                   default="mosaic,pallas,jax_cudnn,jax_mgpu,torch_cudnn,torch_flash")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_kernels.json"))
    args = p.parse_args()
    names = args.kernels.split(",")
    global MAX_LAYERS
    MAX_LAYERS = args.max_layers
    dev = jax.devices()[0]
    result = dict(device=str(dev.device_kind), jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv[1:], rows=[])
    save = lambda: json.dump(result, open(args.out, "w"), indent=1)
    if args.prefill:
        from bench_prefill import run_prefill
        result["prefill"] = run_prefill(args)
        save()
        return
    if args.smoke:
        result["smoke"] = smoke(names, args)
        save()
    bw = copy_bandwidth(args.copy_gib)
    C = bw["C"]
    result["bandwidth"] = bw
    print(f"copy bandwidth: {bw}", flush=True)
    if args.mixed:
        result["mixed"] = mixed_case(args, C)
        save()
    for page in ([] if args.no_sweep else args.page):
        for batch in args.batch:
            for ctx in args.ctx:
                result["rows"].append(bench_case(batch, ctx, page, names, args, C))
                save()
    print(f"\nC = {C / 1e12:.2f} TB/s ({dev.device_kind}, jax {jax.__version__}); "
          "cells: fraction of C (us); GPU kernel time with --profile, else wall time per call; "
          "'!' = failed check, 'E' = error")
    print(f"{'B':>4} {'ctx':>5} {'S':>3} " + " ".join(f"{n:>17}" for n in names))
    for row in result["rows"]:
        cells = []
        for n in names:
            r = row["kernels"].get(n, {})
            if "error" in r:
                cells.append(f"{'E':>17}")
            else:
                flag = "" if r.get("ok") else "!"
                frac, us = (r["gpu_frac_C"], r["gpu_us"]) if "gpu_us" in r else (r["frac_C"], r["us"])
                cells.append(f"{frac:>6.3f} ({us:>7.1f}){flag:1}")
        print(f"{row['batch']:>4} {row['ctx']:>5} {row['page']:>3} " + " ".join(cells))


if __name__ == "__main__":
    main()
