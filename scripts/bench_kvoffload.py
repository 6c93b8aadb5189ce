"""TTFT of a long prompt served from the host KV tier vs recomputed, and restore bandwidth.

    python scripts/bench_kvoffload.py --random-shape llama3-8b --input-len 16384

Stall: `--streams` requests decode while P, just evicted, comes back from the host tier;
the largest gap between their tokens with the asynchronous load vs the inline one (the
copies of the inline load hold up the step that needs them; the asynchronous ones run
behind decode steps).

One engine with an OffloadingConnector (host tier): prompt P is computed cold (TTFT
recompute), a second prompt Q of the same length evicts P from the device pool, then P
again is served from the host tier (TTFT restore, same call: generate one token), its
blocks loaded asynchronously (the default: the request waits beside the batch while the
copies run); then once more, evicted again, with the connector's inline load (written
before the step) for comparison. The restored first tokens must equal the recomputed one. Restore bandwidth: the engine's own
block writes (KVOps.write_blocks, host arrays -> device pages) of P's blocks, timed to
completion, against a plain host-to-device copy of the same bytes in one array
(jax.device_put of a numpy array) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import numpy as np


def ttft(llm, prompt, params):
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return time.perf_counter() - t0, out


def stall(llm, P, streams, tokens, load_async):
    """Gaps (s) between the streams' tokens while P, just evicted, comes back from the host tier."""
    from jaxllm import SamplingParams
    e = llm.engine
    e.connector.load_async = load_async
    try:
        ids = [f"st{load_async}{i}" for i in range(len(streams))]
        for rid, sp in zip(ids, streams):
            e.add_request(rid, sp, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        seen, last, gaps, added, steps = {r: 0 for r in ids}, {}, [], False, 0
        while e.has_unfinished_requests():
            if len(last) == len(ids) and not added and (steps := steps + 1) >= 4:
                e.add_request(f"P{load_async}", P, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                added = True
            outs = e.step()
            now = time.perf_counter()
            for o in outs:
                n = len(o.outputs[0].token_ids)
                if o.request_id in seen and n > seen[o.request_id]:
                    if o.request_id in last:
                        gaps.append((now - last[o.request_id]) / (n - seen[o.request_id]))
                    last[o.request_id], seen[o.request_id] = now, n
        return gaps
    finally:
        e.connector.load_async = True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--random-shape", default="llama3-8b")
    p.add_argument("--input-len", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--cpu-gib", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, default=4, help="decoding streams while P is restored")
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    import jax

    from jaxllm import LLM, SamplingParams

    S = 16
    max_len = args.input_len + 64
    blocks = -(-max_len // S)
    t_start = time.perf_counter()
    stream_blocks = args.streams * -(-(32 + args.stream_tokens) // S)
    seqs = args.streams + 1
    llm = LLM(load_format="dummy", random_shape=args.random_shape, max_model_len=max_len, max_num_seqs=seqs,
              num_gpu_blocks_override=blocks + 8 + stream_blocks, max_num_batched_tokens=args.chunk,
              token_buckets=(16, args.chunk), seq_buckets=(max(8, seqs),), kv_offload_cpu_gib=args.cpu_gib)
    eng = llm.engine
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = eng.model_cfg.vocab_size
    res: dict = {"shape": args.random_shape, "input_len": args.input_len, "device": str(jax.devices()[0]),
                 "block_bytes": eng.connector.ctx.block_bytes, "rows": [],
                 "engine_start_s": time.perf_counter() - t_start}
    print(f"engine ready in {res['engine_start_s']:.1f}s", flush=True)
    def save():  # after each part: a run cut short by its time limit keeps what it measured
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(res, f, indent=2)

    try:
        for r in range(args.repeats):
            P, Q = (rng.integers(0, vocab, args.input_len).tolist() for _ in range(2))
            t_cold, out_cold = ttft(llm, P, one)
            ttft(llm, Q, one)  # evicts P from the device pool; P waits in the host tier
            s0 = llm.stats()
            t_host, out_host = ttft(llm, P, one)
            s1 = llm.stats()
            ttft(llm, Q, one)  # P out of the device pool again
            eng.connector.load_async = False
            try:
                t_inline, out_inline = ttft(llm, P, one)
            finally:
                eng.connector.load_async = True
            row = {"ttft_recompute_s": t_cold, "ttft_host_s": t_host, "ratio": t_host / t_cold,
                   "ttft_host_inline_s": t_inline, "ratio_inline": t_inline / t_cold,
                   "cached_tokens": out_host.num_cached_tokens,
                   "external_hit_tokens": s1["external_prefix_cache_hits"] - s0["external_prefix_cache_hits"],
                   "same_token": out_cold.outputs[0].token_ids == out_host.outputs[0].token_ids
                   == out_inline.outputs[0].token_ids}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
        res["ttft_ratio_median"] = statistics.median(r["ratio"] for r in res["rows"])
        res["ttft_ratio_inline_median"] = statistics.median(r["ratio_inline"] for r in res["rows"])
    except Exception as e:
        res["ttft_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    save()

    try:  # the batch runs on while P loads (async) vs waits for the inline load
        P = rng.integers(0, vocab, args.input_len).tolist()
        ttft(llm, P, one)
        out = {}
        for mode in (True, False):
            eng.kv.reset_prefix_cache()  # the device forgets P entirely: all of it from the host tier
            streams = [rng.integers(0, vocab, 32).tolist() for _ in range(args.streams)]
            h0 = llm.stats()["external_prefix_cache_hits"]
            g = stall(llm, P, streams, args.stream_tokens, mode)
            out["async" if mode else "inline"] = {"max_gap_ms": max(g) * 1e3, "p50_gap_ms": statistics.median(g) * 1e3,
                                                  "gaps": len(g),
                                                  "external_hit_tokens": llm.stats()["external_prefix_cache_hits"] - h0}
        out["max_gap_async_over_inline"] = out["async"]["max_gap_ms"] / out["inline"]["max_gap_ms"]
        res["stall"] = out
        print(json.dumps(out), flush=True)
    except Exception as e:
        res["stall_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    save()

    try:  # restore bandwidth vs a plain host-to-device copy of the same bytes
        n = min(blocks, eng.runner.num_blocks) - 8
        shape, dtype = eng.kv_ops.block_shape, eng.runner.kv_pages.dtype
        distinct = [np.asarray(rng.standard_normal(shape), dtype=dtype) for _ in range(8)]
        host = [distinct[i % 8] for i in range(n)]  # random data, drawn quickly (the copies are the same)
        flat = np.concatenate([h.reshape(-1) for h in host])
        nbytes = flat.nbytes
        ids = list(range(n))

        def restore():
            eng.runner.kv_pages = eng.kv_ops.write_blocks(eng.runner.kv_pages, host, ids)
            eng.runner.kv_pages.block_until_ready()

        def h2d():
            jax.device_put(flat).block_until_ready()

        def timed(f, k=5):
            f()
            ts = []
            for _ in range(k):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        def h2d_pieces():  # the same bytes as restore moves them: one array per block
            jax.block_until_ready(eng.kv_ops.put_blocks(host))

        t_r, t_c, t_p = timed(restore), timed(h2d), timed(h2d_pieces)
        check = np.asarray(eng.runner.kv_pages[:, :, :, 5])  # block 5 as restored
        ok = bool(np.array_equal(check.astype(np.float32), host[5].astype(np.float32)))
        res.update({"restore_bytes": nbytes, "restore_s": t_r, "h2d_s": t_c,
                    "restore_GBps": nbytes / t_r / 1e9, "h2d_GBps": nbytes / t_c / 1e9,
                    "restore_fraction_of_h2d": t_c / t_r, "h2d_pieces_GBps": nbytes / t_p / 1e9,
                    "restore_exact": ok})
    except Exception as e:
        res["bandwidth_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    res["compiles_after_warmup"] = llm.stats()["compiles_after_warmup"]
    save()
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=2))
    print(f"\nTTFT host tier / recompute (median, {args.input_len} tokens): "
          f"{res.get('ttft_ratio_median', float('nan')):.3f} asynchronous load, "
          f"{res.get('ttft_ratio_inline_median', float('nan')):.3f} inline (target <= 0.25); restore bandwidth "
          f"{res.get('restore_fraction_of_h2d', float('nan')):.2f} of host-to-device (target >= 0.7)")


    return 0 if not any(k.endswith("error") for k in res) else 1


if __name__ == "__main__":
    sys.exit(main())
