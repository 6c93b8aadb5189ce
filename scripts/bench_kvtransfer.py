"""P/D transfer cost: pulling a prefilled prompt's KV from a producer engine vs recomputing it.

    python scripts/bench_kvtransfer.py --random-shape llama3-8b --input-len 4096

Two engines in one process on one device (producer and consumer `JaxTransferConnector`s,
each with its own transfer server and pool): the producer prefills a prompt (max_tokens 1,
do_remote_decode), the consumer decodes it from the returned parameters. Reported: the
pull time per 1k tokens of KV (the consumer connector's own timing, background thread),
the consumer's TTFT with the pull against its TTFT recomputing the same prompt, and the
pull bandwidth against a device-to-device copy of the same bytes in the same run. Both
first tokens must agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--random-shape", default="llama3-8b")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    import jax

    from jaxllm import LLM, SamplingParams

    max_len = args.input_len + 64
    blocks = -(-max_len // 16) + 16
    common = dict(random_shape=args.random_shape, max_model_len=max_len, max_num_seqs=1,
                  num_gpu_blocks_override=blocks, max_num_batched_tokens=args.chunk,
                  token_buckets=(16, args.chunk), seq_buckets=(1,), seed=0)
    conf = lambda role: {"kv_connector": "JaxTransferConnector", "kv_role": role,
                         "kv_connector_extra_config": {"timeout_s": 60}}
    prod = LLM(**common, kv_transfer_config=conf("kv_producer"))
    cons = LLM(**common, kv_transfer_config=conf("kv_consumer"))
    rng = np.random.default_rng(0)
    vocab = prod.engine.model_cfg.vocab_size
    res: dict = {"shape": args.random_shape, "input_len": args.input_len, "device": str(jax.devices()[0]),
                 "rows": []}

    def run(llm, prompt, n, params=None, rid="r"):
        e = llm.engine
        t0 = time.perf_counter()
        e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                      kv_transfer_params=params)
        last = None
        while e.has_unfinished_requests():
            for o in e.step():
                last = o
        return time.perf_counter() - t0, last

    try:
        for r in range(args.repeats):
            P, Q = (rng.integers(0, vocab, args.input_len).tolist() for _ in range(2))
            _, pre = run(prod, P, 1, {"do_remote_decode": True}, rid=f"p{r}")
            s0 = cons.stats()
            t_pull, out = run(cons, P, 1, pre.kv_transfer_params, rid=f"c{r}")
            s1 = cons.stats()
            t_cold, cold = run(cons, Q, 1, rid=f"q{r}")  # the same length, recomputed
            pull_s = s1["kv_transfer_pull_seconds"] - s0["kv_transfer_pull_seconds"]
            row = {"ttft_pull_s": t_pull, "ttft_recompute_s": t_cold, "ratio": t_pull / t_cold,
                   "pull_s": pull_s, "pull_s_per_1k_tokens": pull_s / (args.input_len / 1000),
                   "pulled_tokens": out.num_cached_tokens,
                   "same_first_token": out.outputs[0].token_ids == pre.outputs[0].token_ids}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        res["ratio_median"] = statistics.median(x["ratio"] for x in res["rows"])
        res["pull_s_per_1k_median"] = statistics.median(x["pull_s_per_1k_tokens"] for x in res["rows"])
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        print("transfer measurement failed:", res["error"], file=sys.stderr)
    try:  # the device-to-device copy of the same bytes, for the pull bandwidth's peer
        nbytes = args.input_len // 16 * prod.engine.connector.ctx.block_bytes
        x = jax.device_put(np.ones(nbytes // 2, np.uint16))
        copy = jax.jit(lambda a: a + 1)
        copy(x).block_until_ready()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            copy(x).block_until_ready()
            ts.append(time.perf_counter() - t0)
        res["d2d_copy_s"] = statistics.median(ts)
        if "pull_s_per_1k_median" in res:
            pull = res["pull_s_per_1k_median"] * args.input_len / 1000
            res["pull_GBps"] = nbytes / pull / 1e9
            res["d2d_GBps"] = 2 * nbytes / res["d2d_copy_s"] / 1e9  # read + write
    except Exception as e:
        res["copy_error"] = f"{type(e).__name__}: {e}"
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=2))
    print(f"\nTTFT with the pull / recomputed ({args.input_len} tokens): {res.get('ratio_median', float('nan')):.3f}; "
          f"pull {res.get('pull_s_per_1k_median', float('nan')) * 1e3:.2f} ms per 1k tokens")


if __name__ == "__main__":
    main()
