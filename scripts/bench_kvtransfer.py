"""P/D transfer cost and disaggregated decode ITL: pulling a prefilled prompt's KV from a
producer engine vs recomputing it.

    python scripts/bench_kvtransfer.py --random-shape llama3-8b --input-len 4096

Two engines in one process on one device (producer and consumer `JaxTransferConnector`s,
each with its own transfer server and pool), dummy weights of the named shape:

* transfer: the producer prefills a prompt (max_tokens 1, do_remote_decode), the consumer
  decodes it from the returned parameters. Reported: the pull time per 1k tokens of KV (the
  consumer connector's own timing, background thread), the consumer's TTFT with the pull
  against its TTFT recomputing a prompt of the same length, and the pull bandwidth against
  a device-to-device copy of the same bytes in the same run. Both first tokens must agree.
* ITL: the consumer decodes `--itl-streams` streams while `--itl-arrivals` long prompts
  arrive. Single server: the consumer prefills them itself (chunked, mixed into the decode
  steps). Disaggregated: the producer prefilled them before the phase (as another GPU
  would, meanwhile) and the consumer pulls their KV. Reported: the streams' inter-token
  latency p50 / p99 in both phases (the same engine, the same arrivals, fresh prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import numpy as np


def run(llm, prompt, n, params=None, rid="r"):
    from jaxllm import SamplingParams
    e = llm.engine
    t0 = time.perf_counter()
    e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                  kv_transfer_params=params)
    last = None
    while e.has_unfinished_requests():
        for o in e.step():
            last = o
    return time.perf_counter() - t0, last


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def itl_phase(cons, streams, arrivals, tokens, tag):
    """Inter-token gaps (s) of the streams while `arrivals` [(decode step, prompt, params)] join;
    the tokens the arrivals did not compute; the steps over 3x the median step."""
    from jaxllm import SamplingParams
    e = cons.engine
    ids = [f"{tag}s{i}" for i in range(len(streams))]
    for rid, p in zip(ids, streams):
        e.add_request(rid, p, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    seen = {rid: 0 for rid in ids}
    last: dict[str, float] = {}
    gaps: list[float] = []
    cached: dict[str, int] = {}  # arrival -> tokens it did not compute (pulled, or prefix hits)
    steps: list[tuple[float, bool]] = []  # (step s, a pull in flight at its start)
    todo, step, started = list(arrivals), 0, False
    while e.has_unfinished_requests():
        if started and todo and step >= todo[0][0]:
            _, p, params = todo.pop(0)
            e.add_request(f"{tag}a{step}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          kv_transfer_params=params)
        fetching, t_step = bool(getattr(e.connector, "_fetching", ())), time.perf_counter()
        outs = e.step()
        now = time.perf_counter()
        if started:
            steps.append((now - t_step, fetching))
        for o in outs:
            if o.request_id.startswith(f"{tag}a") and o.finished:
                cached[o.request_id] = o.num_cached_tokens
            if o.request_id in seen:
                n = len(o.outputs[0].token_ids)
                if n > seen[o.request_id]:
                    if o.request_id in last and started:
                        gaps.append((now - last[o.request_id]) / (n - seen[o.request_id]))
                    last[o.request_id], seen[o.request_id] = now, n
        if not started and len(last) == len(ids):  # every stream decoding: arrivals start
            started = True
        step += started
    med = float(np.median([x[0] for x in steps])) if steps else 0.0
    slow = [{"step_ms": round(d * 1e3, 1), "pull_in_flight": f} for d, f in steps if d > 3 * med]
    return gaps, sum(cached.values()), slow


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--random-shape", default="llama3-8b")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--itl-streams", type=int, default=8)
    p.add_argument("--itl-tokens", type=int, default=64, help="tokens each stream decodes")
    p.add_argument("--itl-arrivals", type=int, default=4)
    p.add_argument("--transport", default="{}", help="JSON merged into both connectors' extra config, "
                   "e.g. '{\"num_connections\": 8}' (jax_transfer.TRANSPORT)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    import jax

    from jaxllm import LLM

    S, L = 16, args.input_len
    cdiv = lambda a, b: -(-a // b)
    seqs = args.itl_streams + args.itl_arrivals
    blocks = (args.itl_arrivals + 1) * cdiv(L + 16, S) + args.itl_streams * cdiv(64 + args.itl_tokens, S) + 16
    common = dict(load_format="dummy", random_shape=args.random_shape, max_model_len=L + 64,
                  max_num_seqs=seqs, num_gpu_blocks_override=blocks, max_num_batched_tokens=args.chunk,
                  # the small buckets the engine's defaults have too: a pulled arrival's last 16 tokens
                  # beside the decode rows pad to 64, not to the chunk (a 2,048-token step)
                  token_buckets=tuple(sorted({16, 64, 256, args.chunk})),
                  seq_buckets=(16,) if seqs <= 16 else (seqs,), seed=0)
    conf = lambda role: {"kv_connector": "JaxTransferConnector", "kv_role": role,
                         "kv_connector_extra_config": {"timeout_s": 15, **json.loads(args.transport)}}
    t0 = time.perf_counter()
    prod = LLM(**common, kv_transfer_config=conf("kv_producer"))
    cons = LLM(**common, kv_transfer_config=conf("kv_consumer"))
    rng = np.random.default_rng(0)
    vocab = prod.engine.model_cfg.vocab_size
    draw = lambda n: rng.integers(0, vocab, n).tolist()
    res: dict = {"shape": args.random_shape, "input_len": L, "device": str(jax.devices()[0]),
                 "transport": json.loads(args.transport),
                 "engines_start_s": time.perf_counter() - t0, "block_bytes": prod.engine.connector.ctx.block_bytes,
                 "rows": []}
    print(f"engines ready in {res['engines_start_s']:.1f}s", flush=True)

    def save():  # after each part: a run cut short by its time limit keeps what it measured
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(res, f, indent=2)

    try:
        for r in range(args.repeats):
            P, Q = draw(L), draw(L)
            _, pre = run(prod, P, 1, {"do_remote_decode": True}, rid=f"p{r}")
            s0 = cons.stats()
            t_pull, out = run(cons, P, 1, pre.kv_transfer_params, rid=f"c{r}")
            s1 = cons.stats()
            t_cold, cold = run(cons, Q, 1, rid=f"q{r}")  # the same length, recomputed
            pull_s = s1["kv_transfer_pull_seconds"] - s0["kv_transfer_pull_seconds"]
            row = {"ttft_pull_s": t_pull, "ttft_recompute_s": t_cold, "ratio": t_pull / t_cold,
                   "pull_s": pull_s, "pull_s_per_1k_tokens": pull_s / (L / 1000),
                   "pulled_tokens": out.num_cached_tokens,
                   "same_first_token": out.outputs[0].token_ids == pre.outputs[0].token_ids}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            if not out.num_cached_tokens:  # each failed pull costs timeout_s: stop here
                raise RuntimeError("the pull failed (the consumer recomputed the prompt)")
        res["ratio_median"] = statistics.median(x["ratio"] for x in res["rows"][1:] or res["rows"])
        res["pull_s_per_1k_median"] = statistics.median(x["pull_s_per_1k_tokens"] for x in res["rows"][1:] or res["rows"])
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    save()
    try:  # the device-to-device copy of the same bytes, for the pull bandwidth's peer
        nbytes = L // S * res["block_bytes"]
        x = jax.device_put(np.ones(nbytes // 2, np.uint16))
        copy = jax.jit(lambda a: a + 1)
        copy(x).block_until_ready()
        ts = []
        for _ in range(5):
            t1 = time.perf_counter()
            copy(x).block_until_ready()
            ts.append(time.perf_counter() - t1)
        res["d2d_copy_s"] = statistics.median(ts)
        res["d2d_GBps"] = 2 * nbytes / res["d2d_copy_s"] / 1e9  # read + write
        if "pull_s_per_1k_median" in res:
            res["pull_GBps"] = nbytes / (res["pull_s_per_1k_median"] * L / 1000) / 1e9
            res["pull_fraction_of_d2d"] = res["pull_GBps"] / res["d2d_GBps"]
        del x
    except Exception as e:
        res["copy_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    save()
    try:  # decode ITL with prefills in the same engine vs prefilled elsewhere
        k = args.itl_arrivals
        at = [4 + i * max(1, (args.itl_tokens - 8) // max(k, 1)) for i in range(k)]
        streams = lambda: [draw(64) for _ in range(args.itl_streams)]
        single, _, slow_single = itl_phase(cons, streams(), [(a, draw(L), None) for a in at], args.itl_tokens, "i1")
        if "error" in res:
            raise RuntimeError("skipped: the pulls failed above")
        later = []
        for i, a in enumerate(at):  # the producer prefills first (another GPU would, meanwhile)
            prompt = draw(L)
            _, pre = run(prod, prompt, 1, {"do_remote_decode": True}, rid=f"ip{i}")
            later.append((a, prompt, pre.kv_transfer_params))
        disagg, pulled, slow_disagg = itl_phase(cons, streams(), later, args.itl_tokens, "i2")
        res["itl"] = {"single_p50_ms": pct(single, 50) * 1e3, "single_p99_ms": pct(single, 99) * 1e3,
                      "disagg_p50_ms": pct(disagg, 50) * 1e3, "disagg_p99_ms": pct(disagg, 99) * 1e3,
                      "gaps": [len(single), len(disagg)], "arrival_steps": at,
                      "largest_gaps_ms": {k: [round(g * 1e3, 1) for g in sorted(v)[-8:][::-1]]
                                          for k, v in (("single", single), ("disagg", disagg))},
                      "disagg_pulled_tokens": pulled}
        slow = lambda g: sum(x > 3 * pct(g, 50) for x in g) / max(1, args.itl_streams)
        res["itl"]["slow_steps"] = {"single": slow(single), "disagg": slow(disagg)}  # gaps > 3x p50, per stream
        res["itl"]["slow_step_detail"] = {"single": slow_single, "disagg": slow_disagg}  # steps > 3x median
        res["itl"]["p99_disagg_over_single"] = res["itl"]["disagg_p99_ms"] / res["itl"]["single_p99_ms"]
        print(json.dumps(res["itl"]), flush=True)
    except Exception as e:
        res["itl_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    res["compiles_after_warmup"] = {"producer": prod.stats()["compiles_after_warmup"],
                                    "consumer": cons.stats()["compiles_after_warmup"]}
    res["blocks_in_use_at_end"] = {n: e.runner.num_blocks - e.kv.num_free_blocks
                                   for n, e in (("producer", prod.engine), ("consumer", cons.engine))}
    save()
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=2))
    itl = res.get("itl", {})
    print(f"\nTTFT with the pull / recomputed ({L} tokens): {res.get('ratio_median', float('nan')):.3f}; "
          f"pull {res.get('pull_s_per_1k_median', float('nan')) * 1e3:.2f} ms per 1k tokens "
          f"({res.get('pull_fraction_of_d2d', float('nan')):.2f} of a device copy's bandwidth); decode ITL p99 "
          f"single {itl.get('single_p99_ms', float('nan')):.1f} ms vs disaggregated "
          f"{itl.get('disagg_p99_ms', float('nan')):.1f} ms")
    return 0 if not any(k.endswith("error") for k in res) else 1


if __name__ == "__main__":
    sys.exit(main())
