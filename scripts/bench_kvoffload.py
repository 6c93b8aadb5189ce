"""TTFT of a long prompt served from the host KV tier vs recomputed, and restore bandwidth.

    python scripts/bench_kvoffload.py --random-shape llama3-8b --input-len 16384

Stall: `--streams` requests decode while P, just evicted, comes back from the host tier;
the largest gap between their tokens with the asynchronous load vs the inline one (the
copies of the inline load hold up the step that needs them; the asynchronous ones run
behind decode steps).

One engine with an OffloadingConnector (host tier). Each repeat takes a fresh prompt P:
computed cold (TTFT recompute); its saves to the host tier are drained (timed: the save
throughput) and the device prefix cache is reset, so P is wholly in the host tier and
nowhere on the device; then P is served from the host tier (TTFT restore, same call:
generate one token), its blocks loaded asynchronously (the default: the request waits
beside the batch while the copies run), with where its time went (admission, copies
issued, copies done, reported ready, scheduled, first token, and the engine steps in
between); then once more, reset again, with the connector's inline load (written before
the step) for comparison. Every timed call starts with no saves in flight; one more restore
("contended") runs right after another prompt R was computed, with R's saves in flight
(its ratio is to R's TTFT): with `save_copies_ahead` 2 (2 chunks' device-to-host copies
started ahead of the saver: the numpy tier's default) and with all of them started at once
(the pinned tier's default). Each restore
must load all of P's full blocks but the last from the host tier (`all_from_host`) and
give the recomputed first token. Restore bandwidth: the engine's own
block writes (KVOps.write_blocks, host arrays -> device pages) of P's blocks, timed to
completion, against a plain host-to-device copy of the same bytes in one array
(jax.device_put of a numpy array) measured in the same run; and both again from pinned host
memory (blocks as the host tier holds them by default; one array copied from pinned memory).
`--pin-host-memory off`: the host tier in numpy arrays (the connector's `pin_host_memory`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import numpy as np

from stack_sampler import StackSampler


def ttft(llm, prompt, params):
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return time.perf_counter() - t0, out


def from_host(llm, rid, prompt, params):
    """TTFT of prompt from the host tier, driving the engine's steps: (seconds, output, where
    its time went: ms since arrival, and the steps taken)."""
    e = llm.engine
    t0, w0 = time.perf_counter(), time.time()
    e.add_request(rid, prompt, params)
    out, starts = None, []
    while e.has_unfinished_requests():
        starts.append(time.time())
        for o in e.step():
            if o.request_id == rid and o.finished:
                out = o
    took = time.perf_counter() - t0
    log = [t for t in e.connector.load_log if t["request_id"] == rid] if hasattr(e.connector, "load_log") else []
    m = out.metrics
    br = {"steps": len(starts)}
    marks = {"first_scheduled": m.first_scheduled_time, "first_token": m.first_token_time}
    if log:
        marks.update({k: log[-1].get(k) for k in ("admitted", "dispatched", "issued", "issued_end", "copied", "ready", "written")})
        br["copy_s"], br["load_bytes"] = log[-1].get("copy_s"), log[-1].get("bytes")
    done = getattr(e.connector, "last_save_done", None)
    if done is not None and done >= w0:  # another prompt's saves finished during this restore
        marks["last_save_done"] = done
        if log[-1].get("copied") is not None and m.first_scheduled_time is not None:
            br["steps_copied_to_scheduled"] = sum(log[-1]["copied"] <= s <= m.first_scheduled_time for s in starts)
            br["steps_while_loading"] = sum(log[-1]["admitted"] <= s < log[-1]["copied"] for s in starts)
    br.update({f"{k}_ms": round((v - w0) * 1e3, 2) for k, v in marks.items() if v is not None})
    return took, out, br


def drained(llm):
    """Wait for the saves queued so far; their seconds."""
    t0 = time.perf_counter()
    llm.engine.flush_kv()
    return time.perf_counter() - t0


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
    p.add_argument("--pin-host-memory", choices=["on", "off"], default="on",
                   help="the host tier's blocks in pinned host memory (the connector's default) or numpy")
    p.add_argument("--stack-depth", type=int, default=5, help="frames kept per sampled stack (contended restores)")
    p.add_argument("--stack-top", type=int, default=5, help="stacks reported per thread")
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
              token_buckets=(16, args.chunk), seq_buckets=(max(8, seqs),),
              kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"cpu_gib": args.cpu_gib,
                                                                "pin_host_memory": args.pin_host_memory == "on"}})
    eng = llm.engine
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = eng.model_cfg.vocab_size
    res: dict = {"shape": args.random_shape, "input_len": args.input_len, "device": str(jax.devices()[0]),
                 "host_tier_pinned": eng.connector.pinned(),
                 "block_bytes": eng.connector.ctx.block_bytes, "rows": [],
                 "engine_start_s": time.perf_counter() - t_start}
    print(f"engine ready in {res['engine_start_s']:.1f}s", flush=True)
    def save():  # after each part: a run cut short by its time limit keeps what it measured
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(res, f, indent=2)

    full = (args.input_len - 1) // S * S  # tokens a restore loads (the last one is computed)

    def hits():
        return llm.stats()["external_prefix_cache_hits"]

    try:
        drained(llm)
        for r in range(args.repeats):
            P = rng.integers(0, vocab, args.input_len).tolist()  # fresh: never seen before
            t_cold, out_cold = ttft(llm, P, one)
            save_s = drained(llm)  # P wholly in the host tier
            eng.kv.reset_prefix_cache()  # and nowhere on the device
            h0 = hits()
            t_host, out_host, br = from_host(llm, f"host{r}", P, one)
            h1 = hits()
            drained(llm)
            eng.kv.reset_prefix_cache()
            eng.connector.load_async = False
            try:
                t_inline, out_inline = ttft(llm, P, one)
            finally:
                eng.connector.load_async = True
            h2 = hits()
            drained(llm)
            row = {"ttft_recompute_s": t_cold, "ttft_host_s": t_host, "ratio": t_host / t_cold,
                   "ttft_host_inline_s": t_inline, "ratio_inline": t_inline / t_cold,
                   "cached_tokens": out_host.num_cached_tokens, "external_hit_tokens": h1 - h0,
                   "external_hit_tokens_inline": h2 - h1, "all_from_host": h1 - h0 == full == h2 - h1,
                   "save_drain_s": save_s, "same_token": out_cold.outputs[0].token_ids
                   == out_host.outputs[0].token_ids == out_inline.outputs[0].token_ids, "restore": br}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
        res["ttft_ratio_median"] = statistics.median(r["ratio"] for r in res["rows"])
        res["ttft_ratio_inline_median"] = statistics.median(r["ratio_inline"] for r in res["rows"])
        res["all_from_host"] = all(r["all_from_host"] for r in res["rows"])
    except Exception as e:
        res["ttft_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    save()

    try:  # the same restore with a fresh prompt's saves (its whole KV, device to host) in flight
        P = rng.integers(0, vocab, args.input_len).tolist()
        ttft(llm, P, one)
        drained(llm)
        res["contended"] = {}
        for ahead in (2, None):  # bounded (the numpy tier's default), all at once (the pinned tier's)
            eng.connector.save_copies_ahead = ahead
            R = rng.integers(0, vocab, args.input_len).tolist()
            t_r, _ = ttft(llm, R, one)  # R's saves are queued as it finishes: not drained
            eng.kv.reset_prefix_cache()
            h0 = hits()
            eng.connector.io["kv_offload_save_issue_max_seconds"] = 0.0  # (the max over this restore)
            io0 = dict(eng.connector.io)
            with StackSampler(depth=args.stack_depth) as sampler:  # where each thread waits
                t_c, out_c, br = from_host(llm, f"contended{ahead}", P, one)
            io = {k[len("kv_offload_"):]: round(v - (0 if k.endswith("max_seconds") else io0[k]), 4)
                  for k, v in eng.connector.io.items() if k.startswith("kv_offload_save_")}
            row = {"save_copies_ahead": ahead, "ttft_host_s": t_c, "ratio": t_c / t_r, "save_io": io,
                   "external_hit_tokens": hits() - h0, "save_drain_after_s": drained(llm), "restore": br,
                   "stacks": sampler.summary(top=args.stack_top)}
            res["contended"]["bounded" if ahead else "all"] = row
            print(json.dumps(row), flush=True)
            eng.kv.reset_prefix_cache()  # (P's device blocks: the next restore loads it all again)
        eng.connector.save_copies_ahead = "auto"
    except Exception as e:
        res["contended_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    save()

    try:  # the batch runs on while P loads (async) vs waits for the inline load
        P = rng.integers(0, vocab, args.input_len).tolist()
        ttft(llm, P, one)
        out = {}
        for mode in (True, False):
            drained(llm)  # P's saves done: all of it in the host tier
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
        if eng.kv_ops.pinned_sharding is not None:  # the same from pinned host memory
            from jaxllm.engine.kv_ops import ChunkRow
            C = eng.kv_ops.chunk
            chunks = [jax.device_put(np.stack([host[min(i + j, n - 1)] for j in range(C)]),
                      eng.kv_ops.pinned_chunk_sharding) for i in range(0, n, C)]
            host_chunked = [ChunkRow(chunks[i // C], i % C) for i in range(n)]  # as the tier saves them
            pinned = [eng.kv_ops.pin_block(h) for h in distinct]
            host_blocks = [pinned[i % 8] for i in range(n)]  # one pinned array per block
            flat_pinned = jax.device_put(flat, eng.kv_ops.pinned_sharding)

            def restore_from(blocks):
                eng.runner.kv_pages = eng.kv_ops.write_blocks(eng.runner.kv_pages, blocks, ids)
                eng.runner.kv_pages.block_until_ready()

            def h2d_pinned():
                jax.device_put(flat_pinned, eng.kv_ops.device_sharding).block_until_ready()

            t_rp = timed(lambda: restore_from(host_chunked))
            t_rb = timed(lambda: restore_from(host_blocks))
            t_cp = timed(h2d_pinned)
            check = np.asarray(eng.runner.kv_pages[:, :, :, 5])
            res.update({"restore_pinned_GBps": nbytes / t_rp / 1e9, "h2d_pinned_GBps": nbytes / t_cp / 1e9,
                        "restore_pinned_fraction_of_h2d_pinned": t_cp / t_rp,
                        "restore_pinned_blocks_GBps": nbytes / t_rb / 1e9,
                        "restore_pinned_exact": bool(np.array_equal(check.astype(np.float32),
                                                                    host[5].astype(np.float32)))})
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
    for i, r in enumerate(res["rows"]):
        print(f"repeat {i}: TTFT host/recompute {r['ratio']:.3f} ({r['ttft_host_s'] * 1e3:.1f} / "
              f"{r['ttft_recompute_s'] * 1e3:.1f} ms), inline {r['ratio_inline']:.3f}, "
              f"{r['external_hit_tokens']} tokens from the host tier, restore {r['restore']}")
    for k, c in res.get("contended", {}).items():
        print(f"contended, another prompt's saves in flight ({k}: save_copies_ahead "
              f"{c['save_copies_ahead']}): TTFT host/recompute {c['ratio']:.3f}, "
              f"{c['external_hit_tokens']} tokens from the host tier, restore {c['restore']}")
        for name, t in c["stacks"]["threads"].items():
            if name.startswith(("jaxllm", "MainThread")):
                print(f"  {name}: {t['samples']} samples; " + " | ".join(
                    f"{x['share']:.2f} {' < '.join(x['stack'][:3])}" for x in t["top"][:3]))
    print(f"\nTTFT ratio host/recompute (median, {args.input_len} tokens): "
          f"{res.get('ttft_ratio_median', float('nan')):.3f} asynchronous load, "
          f"{res.get('ttft_ratio_inline_median', float('nan')):.3f} inline (target <= 0.25); restore bandwidth "
          f"{res.get('restore_fraction_of_h2d', float('nan')):.2f} of host-to-device (target >= 0.7); from pinned "
          f"memory {res.get('restore_pinned_fraction_of_h2d_pinned', float('nan')):.2f} of a pinned host-to-device copy")


    ok = not any(k.endswith("error") for k in res) and res.get("all_from_host", False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
