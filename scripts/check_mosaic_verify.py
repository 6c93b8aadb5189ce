"""GPU check and timing of the Mosaic decode kernel on speculative-verification batches.

    python3 scripts/check_mosaic_verify.py [--batch 1 32 64] [--ctx 1024] [--k 4]
        [--inner 10] [--json $OUT/check_mosaic_verify.json]

B requests at context ctx each verify k drafts: k + 1 new tokens a request at consecutive
positions (B (k + 1) tokens, B (k + 1) request rows as the engine's row buckets give, so
T <= R: the decode kernel). Llama-3-8B heads (32 q / 8 kv, D 128), 16-token pages shuffled
in a bf16 pool of L layers (bench_kernels.decode_case's sizing). Kernels:
  * per_token: the decode kernel, every token on its own (each reads its context);
  * items: the same kernel with queries_per_item = k + 1 (a request's k + 1 tokens in one
    CTA's rows, its pages read once);
  * decode: one token per request (a plain decode step's attention), the bytes floor's peer.
Each is checked with its output memory poisoned against ref.py on a second query set (ok =
rel err < 1e-2) and timed as bench_kernels times (median wall-clock per layer call, us; GPU
kernel time from a profiler trace, gpu_us). x_decode = time / the plain decode step's time.
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

from bench_kernels import D, H, check, decode_case, gpu_time, time_fn  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import mosaic_decode, ref  # noqa: E402
from jaxllm.kernels.metadata import AttentionMetadata  # noqa: E402


def verify_metadata(tables: np.ndarray, new: int, ctx: int, page: int) -> AttentionMetadata:
    """`new` tokens a request (one per request row of `tables`) ending at position ctx - 1, in
    B * new request rows, as the engine's row buckets give B verified requests (T <= R)."""
    batch = tables.shape[0]
    pos = np.tile(np.arange(ctx - new, ctx), batch)
    req = np.repeat(np.arange(batch), new)
    rows = batch * new
    bt = np.zeros((rows, tables.shape[1]), np.int32)
    bt[:batch] = tables
    seq = np.zeros(rows, np.int32)
    seq[:batch] = ctx
    qsl = np.full(rows + 1, batch * new, np.int32)
    qsl[:batch + 1] = np.arange(batch + 1) * new
    return AttentionMetadata(
        positions=jnp.asarray(pos, jnp.int32), token_req=jnp.asarray(req, jnp.int32),
        slot_mapping=jnp.asarray(tables[req, pos // page] * page + pos % page, jnp.int32),
        block_tables=jnp.asarray(bt), seq_lens=jnp.asarray(seq), query_start_loc=jnp.asarray(qsl),
        num_seqs=jnp.array([batch], jnp.int32))


def verify_case(base: dict, k: int, ctx: int, page: int) -> dict:
    """base's pool and tables, k + 1 tokens a request ending at position ctx - 1."""
    md = verify_metadata(base["tables"], k + 1, ctx, page)
    q = jax.random.normal(jax.random.key(7), (base["layers"] + 1, md.positions.shape[0], H, D),
                          jnp.bfloat16)
    return dict(base, qs=q, md=md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "check_mosaic_verify.json"))
    a = p.parse_args()
    scale = D ** -0.5
    fns = {"per_token": functools.partial(mosaic_decode.paged_decode_attention, sm_scale=scale),
           "items": functools.partial(mosaic_decode.paged_decode_attention, sm_scale=scale,
                                      queries_per_item=a.k + 1)}
    rows, bad = [], []
    for b in a.batch:
        base = decode_case(b, a.ctx, 16)
        cases = {"decode": base, "verify": verify_case(base, a.k, a.ctx, 16)}
        times = {}
        for kname, cname in (("per_token", "decode"), ("per_token", "verify"), ("items", "verify")):
            case = cases[cname]
            name = "decode" if cname == "decode" else kname
            row = dict(batch=b, ctx=a.ctx, k=a.k, kernel=name, tokens=int(case["md"].positions.shape[0]),
                       layers=case["layers"], device=jax.devices()[0].device_kind, jax=jax.__version__)
            try:
                qs, kv, md, layers = case["qs"], case["kv"], case["md"], case["layers"]
                want = np.asarray(jax.jit(lambda q, kv, md: ref.ragged_paged_attention(
                    q, kv, jnp.int32(0), md, sm_scale=scale))(qs[-1], kv, md).astype(jnp.float32))
                fn = fns[kname]
                err = check(fn, case, want)
                row.update(rel_err=err, ok=err < 1e-2)
                f = jax.jit(lambda qs, kv, md, fn=fn: [fn(qs[l], kv, jnp.int32(l), md) for l in range(layers)])
                row["us"] = time_fn(lambda: f(qs, kv, md), inner=a.inner) / layers * 1e6
                try:
                    row["gpu_us"] = gpu_time(lambda: f(qs, kv, md)) / layers * 1e6
                except Exception as e:  # noqa: BLE001 - the wall-clock time stands alone
                    row["profile_error"] = repr(e)[-300:]
                times[name] = row
                for t in ("us", "gpu_us"):
                    if name != "decode" and t in row and t in times.get("decode", {}):
                        row[f"x_decode_{t}"] = row[t] / times["decode"][t]
                if name == "items" and "per_token" in times:
                    row["x_per_token_us"] = row["us"] / times["per_token"]["us"]
            except Exception as e:  # noqa: BLE001
                row["error"] = "".join(traceback.format_exception_only(type(e), e))[-1500:]
                traceback.print_exc()
            if not row.get("ok"):
                bad.append(f"b{b}/{name}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    print(f"summary: {len(rows) - len(bad)}/{len(rows)} cases ok" + (f"; failed: {bad}" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
