"""GPU check of the Mosaic decode kernel on quantized KV pages; one JSON line per case, then a
line a case ("case ...") and a summary.

    python3 scripts/check_mosaic_quant.py [--batch 64] [--ctx 2048] [--formats fp8,fp8_e5m2,int8,int4]
        [--inner 10] [--json $OUT/check_mosaic_quant.json] [--sweep 1:2,1:3:2,...]

Decode, one new token per request, B requests at context ctx, Llama-3-8B heads (32 q / 8 kv,
D 128), 16-token pages shuffled in the pool (bench_kernels.decode_case). Cases: the Mosaic
kernel on the bf16 pages (the baseline), then for each page format the Mosaic decode kernel
reads (fp8 = e4m3, fp8_e5m2, int8, int4) the Pallas kernel, the Mosaic kernel (the V tile converted while
the QK wgmma runs: `early_v_convert`, the default) and mosaic_late_v (converted after) on the same
quantized pages (bench_quant.quantized_kv), and on fp8 (e4m3) pages mosaic_qk8 (`qk_fp8`: the query
rounded to e4m3, the QK wgmma on the K tile as copied, only V converted; checked against ref.py on
that rounded query, `fp8_q_err` = what the rounding costs against the exact query). Each case is
  * checked: output memory poisoned and a second query set (bench_kernels.check) against
    ref.py on the pages upcast to bf16 (exact for fp8; int8 / int4 pages: ref.py dequantizes
    them itself, in float32); ok = rel err < 1e-2;
  * timed like bench_kernels: the kernel over the pool's L layers in one jit, median
    wall-clock per call of groups of calls ended by jax.block_until_ready (us), and the GPU
    kernel time from a profiler trace (gpu_us); x_bf16_* = time / the bf16 Mosaic kernel's,
    x_pallas_* = the Mosaic kernel's time / the Pallas kernel's on the same pages;
    frac_C = bytes read and written / time / C (copy bandwidth measured here).
--sweep SPLITS:STAGES[:DEQ],... adds the Mosaic kernel at those split and pipeline-stage counts
("mosaic_s<S>n<N>[d<DEQ>]"; the default is decode_schedule.default_config's): fewer stages leave
room for more CTAs an SM, more splits give more CTAs; DEQ > 0 has the producer warpgroup convert
quantized tiles into a DEQ-deep f16 ring (`deq_stages`; bf16 pages take only the DEQ 0 entries,
as they have nothing to convert). A failing case prints its error in its line and the others go
on. About a minute on an H200.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_kernels import (D, H, K, check, copy_bandwidth, decode_case, gpu_time,  # noqa: E402
                           kernel_fns, time_fn)
from bench_quant import quantized_kv  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import mosaic_decode, ref  # noqa: E402

MOSAIC_FORMATS = ("fp8", "fp8_e5m2", "int8", "int4")  # page formats mosaic_decode reads besides bf16


def upcast_reference(case: dict, kv, qk8: bool = False) -> np.ndarray:
    """ref.py on the pages upcast to bf16 (int8 / int4 pages as they are: ref.py dequantizes
    them), for the query set `check` uses; qk8: that query rounded as the `qk_fp8` kernel
    rounds it (mosaic_decode.q_fp8, its base-2 scale undone by sm_scale ln 2)."""
    up = kv if kv.dtype in (jnp.bfloat16, jnp.uint8) else kv.astype(jnp.bfloat16)
    q, scale = case["qs"][-1], D ** -0.5
    if qk8:
        q, scale = mosaic_decode.q_fp8(q, scale).astype(jnp.float32), float(np.log(2.0))
    return np.asarray(jax.jit(lambda q, kv: ref.ragged_paged_attention(
        q, kv, jnp.int32(0), case["md"], sm_scale=scale))(q, up).astype(jnp.float32))


def run_case(fn, case: dict, kv, want, row_bytes: int, inner: int, C: float) -> dict:
    """Check `fn` on these pages against `want` (poisoned output), then time it."""
    qs, md, layers = case["qs"], case["md"], case["layers"]
    err = check(fn, dict(case, kv=kv), want)
    f = jax.jit(lambda qs, kv, md: [fn(qs[l], kv, jnp.int32(l), md) for l in range(layers)])
    us = time_fn(lambda: f(qs, kv, md), inner=inner) / layers * 1e6
    nbytes = int(jnp.sum(md.seq_lens)) * K * 2 * row_bytes + 2 * qs[0].size * 2  # KV, q and out
    row = dict(rel_err=err, ok=err < 1e-2, us=us, frac_C=nbytes / (us * 1e-6) / C)
    try:
        row["gpu_us"] = gpu_time(lambda: f(qs, kv, md)) / layers * 1e6
    except Exception as e:  # noqa: BLE001 - the wall-clock time stands alone
        row["profile_error"] = repr(e)[-300:]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--formats", default=",".join(MOSAIC_FORMATS))
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--sweep", default="", help="SPLITS:STAGES[:DEQ] entries for extra Mosaic cases")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                  "check_mosaic_quant.json"))
    a = p.parse_args()
    C = copy_bandwidth(2.0)["C"]
    case = decode_case(a.batch, a.ctx, 16)
    fns = kernel_fns(["mosaic", "pallas"], argparse.Namespace(
        block_rows=64, block_keys=64, mosaic_block_keys=64))
    fns["mosaic_late_v"] = functools.partial(fns["mosaic"], early_v_convert=False)
    # e4m3 pages only: q rounded to e4m3, the QK wgmma on the K tile as copied (checked against
    # the reference on that rounded q; `fp8_q_err` = what the rounding costs against exact q)
    fns["mosaic_qk8"] = functools.partial(fns["mosaic"], qk_fp8=True)
    head = dict(batch=a.batch, ctx=a.ctx, page=16, heads=f"{H}/{K}x{D}", layers=case["layers"],
                device=jax.devices()[0].device_kind, jax=jax.__version__, C=C)
    rows, times, pages = [], {}, {}  # (format, kernel) -> {"us", "gpu_us"}; format -> pages
    sweep, converts = [], set()  # converts: the entries with DEQ > 0 (nothing to do on bf16)
    for spec in filter(None, a.sweep.split(",")):
        s_, n_, d_ = ([int(v) for v in spec.split(":")] + [0])[:3]
        sweep.append(f"mosaic_s{s_}n{n_}" + (f"d{d_}" if d_ else ""))
        fns[sweep[-1]] = functools.partial(fns["mosaic"], num_splits=s_, num_stages=n_, deq_stages=d_)
        if d_:
            converts.add(sweep[-1])
    plan = [("bf16", k) for k in ["mosaic"] + sweep if k not in converts] + [
        (f, k) for f in a.formats.split(",") for k in ["pallas", "mosaic", "mosaic_late_v"] + sweep
        + (["mosaic_qk8"] if f == "fp8" else [])]
    for fmt, kname in plan:
        row = dict(head, kv=fmt, kernel=kname)
        try:
            if fmt not in pages:  # one pool and one reference per format
                pages.clear()
                kv, row_bytes = quantized_kv(case["kv"], "auto" if fmt == "bf16" else fmt)
                pages[fmt] = (kv, upcast_reference(case, kv), row_bytes)
            kv, want, row_bytes = pages[fmt]
            if kname == "mosaic_qk8":
                want, exact = upcast_reference(case, kv, qk8=True), want
                row["fp8_q_err"] = float(np.linalg.norm(want - exact) / np.linalg.norm(exact))
            row.update(run_case(fns[kname], case, kv, want, row_bytes, a.inner, C))
            times[fmt, kname] = {t: row[t] for t in ("us", "gpu_us") if t in row}
            for t, v in times[fmt, kname].items():
                for tag, other in (("bf16", ("bf16", "mosaic")), ("pallas", (fmt, "pallas"))):
                    if other != (fmt, kname) and t in times.get(other, {}):
                        row[f"x_{tag}_{t}"] = v / times[other][t]
        except Exception as e:  # noqa: BLE001
            row["error"] = "".join(traceback.format_exception_only(type(e), e))[-1500:]
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    nan = float("nan")
    for r in rows:  # one line a case, readable in a device call's output
        print(f"case {r['kv']:>8} {r['kernel']:<16} ok={r.get('ok')} err={r.get('rel_err', nan):.1e} "
              f"q_err={r.get('fp8_q_err', nan):.1e} gpu_us={r.get('gpu_us', nan):7.1f} "
              f"x_bf16={r.get('x_bf16_gpu_us', r.get('x_bf16_us', nan)):5.2f} "
              f"frac_C={r.get('frac_C', nan):.2f} {r.get('error', '')[-300:]}")
    bad = [f"{r['kv']}/{r['kernel']}" for r in rows if not r.get("ok")]
    print(f"summary: {len(rows) - len(bad)}/{len(rows)} cases ok" + (f"; failed: {bad}" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
