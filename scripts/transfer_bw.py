"""Pull bandwidth of `jax.experimental.transfer` by transport setting (issue 19's P/D pull).

    python3 scripts/transfer_bw.py [--mib 512] [--chunk-mib 32] [--connections 1,2,4,8,16]

Two transfer servers in one process on one device, as scripts/bench_kvtransfer.py runs the
producer and consumer engines: the producer offers `--mib` of bf16 arrays of `--chunk-mib`
each (KV chunks: 16 blocks of a Llama-3-8B-shape pool are 32 MiB) with `await_pull`, the
consumer pulls them into its device memory. The servers' bulk transport is a set of socket
connections, one per transport address, used in parallel; each case is one setting of
(connections, transfer size, parallel copies, pinned bounce buffers). Timed: the pull until
every array is ready, median of 5 after a warm-up, every pulled array checked against its
source. Reference in the same run: a device-to-device copy of the same bytes. Prints GB/s,
each as a fraction of the copy; `--output-json` writes them.

`--interference N`: with N connections, what a pull does to the thread that drives the device,
as a decode step sees it: a loop of jitted steps (a bf16 [64, 4096] x [4096, 14336] matmul, about
a decode step's weight read per layer group) timed one by one on the main thread while the pull
runs on another thread, against the same loop with no pull; and the same for a loop of host-only
Python work (whether the pull holds the interpreter's lock), and for steps whose sampled tokens
come back to the host (whether their small copy waits behind the pull's device-to-host copies on
the same device, as when producer and consumer share one GPU) or whose inputs come from the host
(whether they wait behind the pull's host-to-device copies, as on a consumer's own GPU). Reported: median and max iteration.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def servers(src, conns: int, **kw):
    """A producer transfer server offering `src`, a consumer's connection to it, the pull specs."""
    from jax.experimental import transfer
    dev = src[0].devices().pop()
    addrs = ["127.0.0.1:0"] * conns
    prod = transfer.start_transfer_server(dev.client, "127.0.0.1:0", addrs, **kw)
    cons = transfer.start_transfer_server(dev.client, "127.0.0.1:0", addrs, **kw)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in src]
    return prod, cons.connect(prod.address()), specs


def pull_time(src, conns: int, xfer_mib: int, copies: int, pinned: bool, k: int = 5) -> float:
    prod, conn, specs = servers(src, conns, max_num_parallel_copies=copies, transfer_size=xfer_mib << 20,
                                supports_pinned_allocator=pinned)
    ts = []
    for uuid in range(k + 1):
        prod.await_pull(uuid, src)
        t0 = time.perf_counter()
        out = jax.block_until_ready(conn.pull(uuid, specs))
        ts.append(time.perf_counter() - t0)
    for a, b in zip(src, out):
        if not bool(jnp.array_equal(a, b)):
            raise AssertionError("a pulled array differs from its source")
    return statistics.median(ts[1:])


def interference(src, conns: int) -> dict:
    """Main-thread iteration times (device steps, host work) with and without a pull in flight."""
    import threading
    dev = src[0].devices().pop()
    prod, conn, specs = servers(src, conns)
    w = jax.random.normal(jax.random.key(1), (4096, 14336), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(2), (64, 4096), jnp.bfloat16)
    step = jax.jit(lambda x, w: (x @ w)[:, :4096] * 0.01)
    jax.block_until_ready(step(x, w))
    tok = jax.jit(lambda x, w: jnp.argmax(x @ w, axis=-1))  # a step that sends its tokens to the host
    np_tok = lambda: tok(x, w).__array__()
    np_tok()
    x_host = np.asarray(x)  # a step whose inputs come from the host (as the batch's metadata does)
    work = {"device": lambda: jax.block_until_ready(step(x, w)), "device_to_host": np_tok,
            "host_to_device": lambda: jax.block_until_ready(step(jax.device_put(x_host, dev), w)),
            "host": lambda: sum(i * i for i in range(2000))}
    out, uuid = {}, 1000
    for kind, f in work.items():
        for with_pull in (False, True):
            done = threading.Event()
            took = {}

            def puller(u=uuid):
                t = time.perf_counter()
                arrs = conn.pull(u, specs)
                took["call_ms"] = (time.perf_counter() - t) * 1e3
                jax.block_until_ready(arrs)
                took["pull_ms"] = (time.perf_counter() - t) * 1e3
                done.set()
            if with_pull:
                prod.await_pull(uuid, src)
                threading.Thread(target=puller).start()
            else:
                threading.Timer(0.2, done.set).start()
            its = []
            while not done.is_set():
                t = time.perf_counter()
                f()
                its.append((time.perf_counter() - t) * 1e3)
            uuid += 1
            row = {"iterations": len(its), "median_ms": statistics.median(its), "max_ms": max(its), **took}
            out[f"{kind}_{'pull' if with_pull else 'alone'}"] = row
            print(f"{kind:6s} {'with a pull' if with_pull else 'alone':11s}: " +
                  " ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--chunk-mib", type=int, default=32)
    p.add_argument("--connections", default="1,2,4,8,16")
    p.add_argument("--transfer-mib", default="256")
    p.add_argument("--copies", default="8")
    p.add_argument("--pinned", default="0", help="0, 1 or 0,1: pinned bounce buffers for the sockets")
    p.add_argument("--interference", type=int, default=0, help="connections for the interference test")
    p.add_argument("--output-json")
    a = p.parse_args()
    n = (a.chunk_mib << 20) // 2
    key = jax.random.key(0)
    src = [jax.random.normal(jax.random.fold_in(key, i), (n,), jnp.bfloat16) for i in range(a.mib // a.chunk_mib)]
    jax.block_until_ready(src)
    nbytes = sum(x.nbytes for x in src)
    copy = jax.jit(lambda xs: [x + 0 for x in xs])
    ts = []
    for _ in range(6):
        t0 = time.perf_counter()
        jax.block_until_ready(copy(src))
        ts.append(time.perf_counter() - t0)
    ref = nbytes / statistics.median(ts[1:]) / 1e9
    print(f"device {jax.devices()[0].device_kind}: {nbytes / 2**20:.0f} MiB in {len(src)} arrays; "
          f"device copy {ref:.1f} GB/s", flush=True)
    rows = []
    ints = lambda s: [int(x) for x in s.split(",")]
    for conns, xfer, copies, pinned in itertools.product(ints(a.connections), ints(a.transfer_mib),
                                                         ints(a.copies), ints(a.pinned)):
        try:
            t = pull_time(src, conns, xfer, copies, bool(pinned))
        except Exception as e:  # a setting the runtime refuses: recorded, the sweep goes on
            print(f"connections {conns} transfer {xfer} MiB copies {copies} pinned {pinned}: "
                  f"{type(e).__name__}: {e}", flush=True)
            continue
        gbs = nbytes / t / 1e9
        rows.append({"connections": conns, "transfer_mib": xfer, "copies": copies, "pinned": bool(pinned),
                     "ms": t * 1e3, "gb_s": gbs, "fraction_of_copy": gbs / ref})
        print(f"connections {conns:2d} transfer {xfer:4d} MiB copies {copies:2d} pinned {pinned}: "
              f"{t * 1e3:8.1f} ms {gbs:7.2f} GB/s ({gbs / ref:.4f} of the copy)", flush=True)
    res = {"bytes": nbytes, "device_copy_gb_s": ref, "rows": rows}
    if a.interference:
        res["interference"] = interference(src, a.interference)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
