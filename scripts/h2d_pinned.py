"""Host-to-device copies from pinned host memory by granularity (issue 19's restore bandwidth).

    python3 scripts/h2d_pinned.py [--gib 2] [--block-mib 2]

The host KV tier holds one pinned array per block (Llama-3-8B: 2 MiB); a restore sends a
list of them. Timed here, same bytes, same run (median of 5 after a warm-up):
  one      one pinned array -> device (the link's rate: the reference);
  blocks   a list of per-block pinned arrays, one jax.device_put (what the tier does now);
  chunks   a list of 16-block pinned arrays (what a chunked tier would send);
  jit      per-block pinned arrays as arguments of a jitted program that moves them to the
           device and stacks them 16 at a time (XLA issues the copies inside one executable);
  numpy    the per-block list from numpy (pageable) arrays, for comparison.
Prints GB/s and each as a fraction of `one`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def timed(f, k: int = 5) -> float:
    jax.block_until_ready(f())
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    dev = jax.devices()[0]
    d_s = SingleDeviceSharding(dev, memory_kind="device")
    h_s = SingleDeviceSharding(dev, memory_kind="pinned_host")
    per = int(args.block_mib * 2**20) // 2  # bf16 elements per block
    n = int(args.gib * 2**30) // (per * 2)
    n -= n % args.chunk
    rng = np.random.default_rng(0)
    base = [rng.standard_normal(per).astype(jnp.bfloat16) for _ in range(8)]
    np_blocks = [base[i % 8] for i in range(n)]
    pin_blocks = [jax.device_put(b, h_s) for b in np_blocks]
    pin_chunks = [jax.device_put(np.stack(np_blocks[i:i + args.chunk]), h_s) for i in range(0, n, args.chunk)]
    pin_one = jax.device_put(np.concatenate(np_blocks), h_s)
    nbytes = n * per * 2

    @jax.jit
    def move16(*blocks):
        return jnp.stack([jax.device_put(b, d_s) for b in blocks])

    def jit_blocks():
        return [move16(*pin_blocks[i:i + args.chunk]) for i in range(0, n, args.chunk)]

    res = {"device": str(dev), "bytes": nbytes, "blocks": n, "block_bytes": per * 2, "chunk": args.chunk}
    for name, f in [("one", lambda: jax.device_put(pin_one, d_s)),
                    ("blocks", lambda: jax.device_put(pin_blocks, d_s)),
                    ("chunks", lambda: jax.device_put(pin_chunks, d_s)),
                    ("jit", jit_blocks),
                    ("numpy", lambda: jax.device_put(np_blocks, d_s))]:
        try:
            res[name + "_GBps"] = nbytes / timed(f) / 1e9
        except Exception as e:  # noqa: BLE001 - report, go on
            res[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    ref = res.get("one_GBps")
    for k in list(res):
        if k.endswith("_GBps") and ref:
            res[k.replace("_GBps", "_fraction_of_one")] = res[k] / ref
    print(json.dumps(res, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
