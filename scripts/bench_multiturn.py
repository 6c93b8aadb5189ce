"""Multi-turn chat with a device KV pool far smaller than the working set: tiers on/off.

    python scripts/bench_multiturn.py --conversations 12 --turns 4 --pool-fraction 0.1

Each turn resends the whole conversation so far plus a new user message (random token
ids), for every conversation in turn (round-robin, one batch per turn), so the device
pool (sized to `--pool-fraction` of the final working set, at least one full sequence)
cannot keep the conversations between their turns. Runs the same workload without offload
and with a host tier (and, with --disk-dir, a disk tier behind it) and reports prefix hit
rate (device + external hit tokens over prompt tokens), throughput, and whether the
greedy outputs agree. Random weights; `--model` serves a real checkpoint instead, and
`--random-shape llama3-8b` a model of that shape with dummy weights in bfloat16 (the GPU run:
`bash scripts/gpu_multiturn.sh`).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SMALL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=512,
             intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0)


def build(args, **offload):
    from jaxllm import LLM

    S = 16
    conv_len = args.turns * (args.user_tokens + args.output_tokens)
    max_len = conv_len + S
    working_blocks = args.conversations * -(-conv_len // S)
    pool = max(-(-max_len // S), int(args.pool_fraction * working_blocks))
    # As many running conversations as the pool holds at full length: no preemption thrash,
    # so what the tiers change is only the recompute of earlier turns.
    seqs = args.max_num_seqs or max(1, pool // -(-max_len // S))
    kw = dict(max_model_len=max_len, max_num_seqs=seqs, max_num_batched_tokens=args.chunk,
              num_gpu_blocks_override=pool, seed=1, **offload)
    if args.model:
        llm = LLM(args.model, dtype="float32", **kw)
    elif args.random_shape:  # bfloat16 unless --dtype (float32: where bf16 near-ties flip argmaxes)
        llm = LLM(load_format="dummy", random_shape=args.random_shape,
                  **({"dtype": args.dtype} if args.dtype else {}), **kw)
    else:
        llm = LLM(hf_config=SMALL, dtype="float32", **kw)
    info = {"offload": offload or None, "pool_blocks": pool, "max_num_seqs": seqs,
            "working_set_blocks": working_blocks}
    return llm, info


def workload(args, llm, seed: int, logprobs: int | None = None) -> dict:
    """One pass of every conversation's turns; new token ids per seed (no hits across seeds).
    `logprobs`: also each output position's top logprobs ("logprobs", per output)."""
    from jaxllm import SamplingParams

    vocab = llm.engine.model_cfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True, logprobs=logprobs)
    rng = np.random.default_rng(seed)
    hist = [[] for _ in range(args.conversations)]
    prompt_tokens = gen_tokens = 0
    outs, lps = [], []
    s0 = llm.stats()
    t0 = time.perf_counter()
    for _ in range(args.turns):
        prompts = [h + rng.integers(3, vocab, args.user_tokens).tolist() for h in hist]
        res = llm.generate(prompts, params, use_tqdm=False)
        for i, (p, r) in enumerate(zip(prompts, res)):
            ids = list(r.outputs[0].token_ids)
            hist[i] = p + ids
            prompt_tokens += len(p)
            gen_tokens += len(ids)
            outs.append(ids)
            if logprobs:
                lps.append([sorted(d.values(), key=lambda x: -x.logprob)[:2] for d in r.outputs[0].logprobs])
    wall = time.perf_counter() - t0
    s1 = llm.stats()
    conn = llm.engine.connector
    loads = [t for t in getattr(conn, "load_log", ()) if t.get("admitted", 0) >= time.time() - wall - 1]
    marks = ("dispatched", "issued", "copied", "ready", "written")  # ms after admission, median of the last 64
    load_ms = {m: round(float(np.median([(t[m] - t["admitted"]) * 1e3 for t in loads if t.get(m)])), 2)
               for m in marks if any(t.get(m) for t in loads)}
    io = {k[len("kv_offload_"):]: round(v - (0 if k.endswith("max_seconds") else s0.get(k, 0)), 4) for k, v in s1.items()
          if k.startswith("kv_offload_") and k.endswith(("seconds", "bytes")) and "capacity" not in k}
    dev = s1["prefix_cache_hits"] - s0["prefix_cache_hits"]
    ext = s1.get("external_prefix_cache_hits", 0) - s0.get("external_prefix_cache_hits", 0)
    return {"prompt_tokens": prompt_tokens, "generated_tokens": gen_tokens, "wall_s": wall,
            "device_hit_tokens": dev, "external_hit_tokens": ext,
            "hit_rate": (dev + ext) / prompt_tokens, "tokens_per_s": (prompt_tokens + gen_tokens) / wall,
            "output_tokens_per_s": gen_tokens / wall, "offload_io": io, "load_ms": load_ms, "outputs": outs, **({"logprobs": lps} if logprobs else {})}


def margins(args, a: dict, b: dict) -> dict:
    """Where the two engines' greedy outputs first differ, with identical inputs (every earlier
    turn of that conversation agreed): the top-1 minus top-2 logprob there, in each run, against
    the same margin over all positions (how flat the logits are), and the largest difference
    between the runs' logprobs of the same token before the divergence (the numeric noise)."""
    C, at, alls, noise, agreed = args.conversations, [], [], 0.0, [True] * args.conversations
    for k, (x, y) in enumerate(zip(a["outputs"], b["outputs"])):
        c, lx, ly = k % C, a["logprobs"][k], b["logprobs"][k]
        alls += [t[0].logprob - t[1].logprob for t in lx if len(t) > 1]
        if not agreed[c]:
            continue  # its history differs: later turns say nothing about numerics
        j = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        for i in range(len(x) if j is None else j):
            noise = max(noise, abs(lx[i][0].logprob - ly[i][0].logprob))
        if j is not None:
            agreed[c] = False
            at.append({"turn": k // C, "position": j, "margin_a": lx[j][0].logprob - lx[j][1].logprob,
                       "margin_b": ly[j][0].logprob - ly[j][1].logprob})
    q = lambda v, f: float(np.quantile(v, f)) if v else None  # noqa: E731
    return {"divergences": len(at), "at_divergence": at,
            "margin_at_divergence_max": max((max(d["margin_a"], d["margin_b"]) for d in at), default=None),
            "margin_all_p10_p50": [q(alls, 0.1), q(alls, 0.5)], "same_token_logprob_diff_max": noise}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--random-shape", default=None, help="a named shape with dummy weights (e.g. llama3-8b)")
    p.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument("--dtype", default=None, help="with --random-shape: the model's dtype (default bfloat16)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.1)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: what the pool holds")
    p.add_argument("--cpu-gib", type=float, default=1.0)
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--save-copies-ahead", nargs="+", default=None,
                   help="one tier engine per value (\"auto\", an integer, or \"all\"): the host tier's "
                        "save_copies_ahead; default: one tier engine with the connector's default")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--margins", action="store_true",
                   help="one more, untimed pass with top-2 logprobs: the logit margins where the outputs diverge")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    tier = {"kv_offload_cpu_gib": args.cpu_gib}
    if args.disk_dir:
        tier["kv_offload_disk_dir"] = args.disk_dir
    variants = [tier]
    if args.save_copies_ahead:  # the same tier through an explicit connector config, per value
        variants = [{"kv_transfer_config": {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
                "cpu_gib": args.cpu_gib, **({"disk_dir": args.disk_dir} if args.disk_dir else {}),
                "save_copies_ahead": None if v == "all" else v if v == "auto" else int(v)}}}
            for v in args.save_copies_ahead]
    engines = [build(args)] + [build(args, **v) for v in variants]
    runs = [[] for _ in engines]
    same, agree = True, [0] * args.turns  # per turn: conversations whose outputs are identical
    for rep in range(args.repeats):  # alternate the two engines: a noisy machine hits both alike
        pair = [workload(args, llm, seed=rep) for llm, _ in engines]
        a, b = pair[0].pop("outputs"), pair[1].pop("outputs")
        for extra in pair[2:]:
            extra.pop("outputs")
        same &= a == b
        for k, (x, y) in enumerate(zip(a, b)):  # outputs run turn by turn, conversations within
            agree[k // args.conversations] += x == y
        for i, r in enumerate(pair):
            runs[i].append(r)
    rows = []
    for (_, info), rs in zip(engines, runs):
        best = min(rs, key=lambda r: r["wall_s"])
        rows.append({**info, **best, "wall_s_all": [r["wall_s"] for r in rs]})
    result = {"args": vars(args), "rows": rows, "same_outputs": same,
              # a conversation that diverges once differs in every later turn (its history differs)
              "identical_by_turn": [n / (args.conversations * args.repeats) for n in agree],
              "speedup": rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"],
              "speedups": [r["tokens_per_s"] / rows[0]["tokens_per_s"] for r in rows[1:]]}
    if args.margins:
        pair = [workload(args, llm, seed=args.repeats, logprobs=2) for llm, _ in engines[:2]]
        result["margins"] = margins(args, *pair)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    for r in rows:
        sca = ((r["offload"] or {}).get("kv_transfer_config") or {}).get("kv_connector_extra_config", {})
        label = "device only" if not r["offload"] else "tiers" + (
            f" (save_copies_ahead {sca['save_copies_ahead']})" if "save_copies_ahead" in sca else "")
        print(f"{label:12s} hit rate {r['hit_rate']:.3f}  "
              f"{r['tokens_per_s']:.0f} tok/s ({r['output_tokens_per_s']:.1f} out tok/s)  best of "
              f"{args.repeats}: {r['wall_s']:.1f}s (all: {', '.join(f'{w:.1f}' for w in r['wall_s_all'])})"
              + (f"; offload io {r['offload_io']}; loads, ms after admission {r['load_ms']}" if r["offload"] else ""))
    print(f"speedup with tiers {result['speedup']:.2f}x, identical greedy outputs: {same} (fraction by turn: "
          f"{', '.join(f'{x:.2f}' for x in result['identical_by_turn'])})")
    if args.margins:
        m = result["margins"]
        print(f"margins: {m['divergences']} divergences with identical inputs, top-1 minus top-2 logprob there "
              f"at most {m['margin_at_divergence_max']}; over all positions p10 / p50 {m['margin_all_p10_p50']}; "
              f"same token's logprob differs by at most {m['same_token_logprob_diff_max']:.3g} before a divergence")


if __name__ == "__main__":
    main()
