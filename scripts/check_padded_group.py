"""GPU check of the Mosaic decode kernel on a group that is no power of two (SmolLM2-135M: 9 q /
3 kv heads, D 64), padded to 4 query heads per KV head (`jaxllm.kernels.padded_group`).

    python3 scripts/check_padded_group.py [--json $OUT/check_padded_group.json]

B decode tokens at context 512 (and B requests verifying k = 4 drafts), 16-token pages shuffled
in a bf16 pool; the padded kernel against ref.py with its output poisoned (ok = rel err < 1e-2),
and both timed per layer (GPU kernel time from a profiler trace). The engine with and without
it: scripts/check_decode_shapes.py --engine."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_kernels import check, gpu_time  # noqa: E402
from check_mosaic_verify import verify_metadata  # noqa: E402
from jaxllm.kernels import mosaic_decode, padded_group, ref  # noqa: E402

K, G, D, PAGE = 3, 3, 64, 16


def case(batch: int, ctx: int, new: int, layers: int = 8) -> dict:
    ppr = -(-ctx // PAGE)
    rng = np.random.default_rng(0)
    tables = rng.permutation(batch * ppr + 8)[:batch * ppr].reshape(batch, ppr).astype(np.int32)
    md = verify_metadata(tables, new, ctx, PAGE)
    k1, k2 = jax.random.split(jax.random.key(1))
    kv = jax.random.normal(k1, (layers, 2, K, batch * ppr + 8, PAGE, D), jnp.bfloat16)
    qs = jax.random.normal(k2, (layers + 1, batch * new, K * G, D), jnp.bfloat16)
    return dict(kv=kv, qs=qs, md=md, layers=layers)


def kernel_rows() -> list[dict]:
    scale = D ** -0.5
    rows = []
    for batch, new in ((1, 1), (8, 1), (64, 1), (8, 5)):
        c = case(batch, 512, new)
        fns = {"reference": functools.partial(ref.ragged_paged_attention, sm_scale=scale),
               "padded_mosaic": functools.partial(
                   padded_group, functools.partial(mosaic_decode.paged_decode_attention,
                                                   queries_per_item=new), sm_scale=scale)}
        want = np.asarray(jax.jit(fns["reference"])(c["qs"][-1], c["kv"], jnp.int32(0), c["md"]).astype(jnp.float32))
        times = {}
        for name, fn in fns.items():
            row = dict(batch=batch, new_tokens=new, ctx=512, kernel=name)
            try:
                err = check(fn, c, want)
                row.update(rel_err=err, ok=err < 1e-2)
                f = jax.jit(lambda qs, kv, md, fn=fn: [fn(qs[l], kv, jnp.int32(l), md) for l in range(c["layers"])])
                row["gpu_us"] = gpu_time(lambda: f(c["qs"], c["kv"], c["md"])) / c["layers"] * 1e6
                times[name] = row["gpu_us"]
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[-800:]
            rows.append(row)
            print(json.dumps(row), flush=True)
        if len(times) == 2:
            print(f"  padded / reference kernel time: {times['padded_mosaic'] / times['reference']:.3f}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "check_padded_group.json"))
    a = p.parse_args()
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "kernel": kernel_rows()}
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    bad = [r for r in res["kernel"] if not r.get("ok")]
    print(f"summary: {len(res['kernel']) - len(bad)}/{len(res['kernel'])} kernel cases ok")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
