"""Speculative decoding benchmarks: end-to-end speed-up, and the verification step's cost.

    # ngram on the embedded SmolLM2, prompts that ask to repeat a passage, batch 1
    python scripts/bench_spec.py e2e --batch-size 1 --max-tokens 192
    # a draft proposing random tokens (acceptance ~0): the overhead bound
    python scripts/bench_spec.py e2e --proposer random
    # a draft model: SmolLM2 drafting for itself, and a random-weight twin of it (acceptance ~0)
    python scripts/bench_spec.py e2e --proposer config random_draft --speculative-config \
        '{"method": "draft_model", "model": "default", "num_speculative_tokens": 4}'
    # one verification step with k = 4 drafts per row vs a plain decode step (random weights)
    python scripts/bench_spec.py step --random-shape llama3-8b --batch-size 1 32 --input-len 1024

Both modes use ONE engine built with `speculative_config`; its baseline runs with the
speculative hook detached (`engine.spec = None`), so it is exactly the plain engine
(async scheduling as --baseline-async; the speculative modes as --spec-async) on the same
weights and compiled steps, in the
same process. Figures are ratios against that baseline. With a draft model the baseline
also detaches the draft's shadow pass (`dispatcher.spec_hook`), and the prefix cache is
reset between modes (blocks computed without the shadow pass hold no draft K/V).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

PASSAGES = [
    "The river begins in the high meadows, where snow melts slowly through the spring and feeds a "
    "hundred small streams. By the time it reaches the valley it is wide and brown, carrying silt "
    "from the mountains to the farms below, and the towns along its banks have grown up around the "
    "mills and bridges that depend on its steady flow.",
    "A good recipe for bread needs only four things: flour, water, salt and yeast. Mix them, let the "
    "dough rest for an hour, fold it a few times, and let it rise again. Bake it in a very hot oven "
    "until the crust is dark and it sounds hollow when you tap the bottom of the loaf.",
    "In the early days of computing, programs were entered by hand using switches and punched cards. "
    "Each mistake meant starting again, so programmers checked their work on paper for hours before "
    "they were given a few precious minutes on the machine, which filled an entire room.",
    "The museum opens at nine in the morning and closes at six in the evening, except on Mondays, "
    "when it is closed all day. Tickets can be bought at the entrance or online, and children under "
    "twelve enter for free when they are accompanied by an adult.",
]


class RandomProposer:
    """Drafts of random token ids: acceptance near zero, the overhead of verification alone."""

    def __init__(self, k: int, vocab: int, seed: int = 0):
        self.k, self.vocab, self.rng = k, vocab, np.random.default_rng(seed)

    def propose(self, histories, k=None):
        caps = np.broadcast_to(np.asarray(self.k if k is None else k), (len(histories),))
        ids = self.rng.integers(0, self.vocab, size=(len(histories), self.k)).tolist()  # one draw
        return [row[:c] for row, c in zip(ids, caps.tolist())]


def repeat_prompts(llm, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    if tok is None or llm.engine.cfg.load_format == "dummy":  # random weights: random ids
        rng = np.random.default_rng(0)
        return [rng.integers(0, llm.engine.model_cfg.vocab_size, size=128).tolist() for _ in range(n)]
    out = []
    for i in range(n):
        text = " ".join(PASSAGES[(i + j) % len(PASSAGES)] for j in range(2))
        msgs = [{"role": "user", "content": f"Repeat the following passage exactly, word for word:\n\n{text}"}]
        out.append(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)))
    return out


def spec_counts(eng) -> tuple[int, int, int, int]:
    m = eng.spec_hook.metrics
    return m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, eng.spec_hook.num_overlapped


def use_mode(eng, mode: str) -> None:
    """A draft model's shadow pass runs only with it (and its weights are the random twin's
    under 'random_draft'); cached prefixes are dropped, having no draft K/V from plain runs."""
    if not hasattr(eng, "draft_weights"):  # not a draft model
        return
    own = eng.spec_hook.hook
    eng.flush()
    eng.dispatcher.spec_hook = None if mode == "plain" else own
    own.flat = eng.draft_weights["random" if mode == "random_draft" else "own"]
    eng.kv.reset_prefix_cache()


def run_e2e(llm, args) -> list[dict]:
    """Per batch: plain decoding, then each proposer under each --spec-async setting, their timed
    runs interleaved (a shared host's load hits every mode alike); a row per (proposer, setting)."""
    from jaxllm import SamplingParams
    eng = llm.engine
    rows = []
    p = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    runs = [(m, a) for m in args.proposer for a in args.spec_async]  # (proposer, "on" / "off")
    for b in args.batch_size:
        prompts = repeat_prompts(llm, b)
        modes = [("plain", args.baseline_async), *runs]
        times = {m: [] for m in modes}
        outs, counts = {}, {m: [0, 0, 0, 0] for m in modes}
        for rep in range(args.repeats + 1):
            for mode in modes:
                proposer, on = mode
                eng.flush()  # a step still in flight is read by the mode that launched it
                eng.spec = eng.spec_hook if proposer != "plain" else None
                if proposer != "plain":
                    eng.spec.proposer = eng.proposers[proposer]
                use_mode(eng, proposer)
                llm.engine.async_scheduling = on == "on"
                if rep == 0:  # warm
                    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
                    continue
                c = spec_counts(eng)
                t = time.perf_counter()
                outs[mode] = llm.generate(prompts, p, use_tqdm=False)
                times[mode].append(time.perf_counter() - t)
                counts[mode] = [x + y - z for x, y, z in zip(counts[mode], spec_counts(eng), c)]
        res = {}
        for mode in modes:
            ntok = sum(len(o.outputs[0].token_ids) for o in outs[mode])
            d, dt, a, ov = counts[mode]
            res[mode] = {"tok_s": ntok / statistics.median(times[mode]), "tokens": ntok,
                         "s": statistics.median(times[mode]), "ids": [o.outputs[0].token_ids for o in outs[mode]],
                         "drafts": d, "draft_tokens": dt, "accepted": a, "overlapped_steps": ov,
                         "mean_acceptance_length": 1 + a / d if d else None}
        eng.spec = eng.spec_hook
        use_mode(eng, args.proposer[0])
        plain = res[modes[0]]
        for mode in runs:
            r = res[mode]
            rows.append({"batch": b, "proposer": mode[0], "spec_async": mode[1], "plain_tok_s": plain["tok_s"],
                         "spec_tok_s": r["tok_s"], "speedup": r["tok_s"] / plain["tok_s"],
                         "mean_acceptance_length": r["mean_acceptance_length"],
                         "acceptance_rate": r["accepted"] / max(r["draft_tokens"], 1),
                         "overlapped_steps": r["overlapped_steps"],
                         "output_tokens": r["tokens"], "identical_greedy_output": plain["ids"] == r["ids"]})
    return rows


def run_step(llm, args) -> list[dict]:
    """Per batch: timed steps of plain decode, synchronous and with async scheduling, then of
    verification with k random drafts, synchronous and overlapped with the next step (the
    engine's default for greedy ngram/random drafts since session 16)."""
    from bench_latency import fill_random
    from jaxllm import SamplingParams
    from jaxllm.runtime.request import RequestStatus
    eng = llm.engine
    fill_random(eng.runner)
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch_size:
        row = {"batch": b, "ctx": args.input_len}
        for mode in ("plain", "plain_async", "spec", "spec_async"):
            eng.spec = eng.spec_hook if mode.startswith("spec") else None
            eng.async_scheduling = mode.endswith("_async")
            sched = eng.scheduler
            params = SamplingParams(temperature=0.0, max_tokens=args.num_iters + 20, ignore_eos=True)
            ids = []
            for i in range(b):
                rid = f"{mode}-b{b}-{i}"
                eng.add_request(rid, rng.integers(0, eng.model_cfg.vocab_size, size=args.input_len).tolist(), params)
                req = sched.waiting.pop()
                assert eng.kv.allocate_slots(req, args.input_len) is not None, "KV pool too small"
                req.num_computed_tokens = args.input_len - 1
                req.status = RequestStatus.RUNNING
                sched.running.append(req)
                ids.append(rid)
            if mode.startswith("spec"):
                eng.spec.propose(sched.running, eng.max_model_len)
            times = []
            prof = cProfile.Profile() if args.profile and not mode.endswith("_async") else None
            c = spec_counts(eng)
            for i in range(args.num_iters):
                if prof is not None and i == 2:  # after the first steps, as the median
                    prof.enable()
                t = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t)
            if prof is not None:
                prof.disable()
                print(f"== host profile, {mode} steps, batch {b} (cProfile, inflates Python time)")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
            if args.trace:  # GPU busy vs wall, kernel time by kind and the top kernels
                from trace_stats import print_summary, profile
                tr = profile(eng.step, 10, os.path.join(args.trace, f"{mode}_b{b}"), python_tracer=False)
                print(f"== trace, {mode} steps, batch {b}")
                print_summary(tr)
                for d in tr.get("per_device", []):
                    for name, sec in d["top_kernels_s"].items():
                        print(f"    {sec * 1e3:8.3f} ms  {name}")
                row[f"{mode}_trace"] = tr
            eng.flush()
            if mode.startswith("spec"):
                d, dt, a, ov = [y - z for y, z in zip(spec_counts(eng), c)]
                row[f"{mode}_drafts"], row[f"{mode}_accepted"], row[f"{mode}_overlapped_steps"] = d, a, ov
            eng.abort_request(ids)
            row[f"{mode}_step_s"] = statistics.median(times[2:])
        row["verify_x_plain"] = row["spec_step_s"] / row["plain_step_s"]
        row["verify_x_plain_async"] = row["spec_step_s"] / row["plain_async_step_s"]
        # The engine's default pair: both steps overlapped with the next (async scheduling).
        row["verify_async_x_plain_async"] = row["spec_async_step_s"] / row["plain_async_step_s"]
        rows.append(row)
    eng.spec = eng.spec_hook
    return rows


def main() -> None:
    from jaxllm.cli import setup_logging

    setup_logging()  # the engine's start-up lines (kernel choices) in the log
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["e2e", "step"])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--random-shape", default=None)
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    p.add_argument("--proposer", nargs="+", choices=["config", "random", "random_draft"], default=["config"],
                   help="config: the speculative_config's method; random: drafts of random tokens "
                        "(acceptance ~0, the overhead bound); random_draft: the draft model's "
                        "programs with random weights (acceptance ~0: the draft loop's overhead "
                        "bound); step mode uses the first")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--input-len", type=int, default=1024, help="step mode: cached context per row")
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="step mode: a jax.profiler trace of 10 more steps per mode, summarised "
                        "(scripts/trace_stats.py)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="step mode: print the top N host functions (cProfile) of the sync plain "
                        "and speculative steps")
    p.add_argument("--baseline-async", choices=["on", "off"], default="on")
    p.add_argument("--spec-async", choices=["on", "off"], nargs="+", default=["on"],
                   help="e2e: async scheduling for the speculative modes, each value a run of each "
                        "proposer (on: the engine's default; steps verifying greedy drafts of a "
                        "host-side proposer overlap the next, spec/shift.py)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="e2e mode: a KV pool of this many blocks, not one sized from memory (a small "
                        "model's pool fills the GPU, and compiling against it is slow)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--seq-buckets", type=int, nargs="+", default=None)
    p.add_argument("--token-buckets", type=int, nargs="+", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    from jaxllm import LLM
    spec_cfg = json.loads(args.speculative_config)
    if spec_cfg.get("model") == "default":  # the embedded SmolLM2 GGUF
        from jaxllm.models.loader import embedded_model_path
        spec_cfg["model"] = embedded_model_path()
    k = spec_cfg["num_speculative_tokens"]
    max_b = max(args.batch_size)
    kw = dict(dtype=args.dtype, max_num_seqs=max_b, speculative_config=spec_cfg,
              tensor_parallel_size=args.tensor_parallel_size)
    if args.random_shape:
        kw.update(random_shape=args.random_shape, load_format="dummy")
    if args.mode == "step":
        max_len = args.input_len + (args.num_iters + 12) * (k + 1) + 16  # + 10 traced steps
        kw.update(max_model_len=max_len, num_gpu_blocks_override=3 * max_b * -(-max_len // 16) + 16,
                  max_num_batched_tokens=args.max_num_batched_tokens or max(256, max_b * (k + 1)))
    else:
        if args.max_num_batched_tokens:
            kw.update(max_num_batched_tokens=args.max_num_batched_tokens)
        if args.num_gpu_blocks:
            kw.update(num_gpu_blocks_override=args.num_gpu_blocks)
    for name in ("seq_buckets", "token_buckets"):
        if getattr(args, name):
            kw[name] = tuple(getattr(args, name))
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    eng = llm.engine
    eng.spec_hook = eng.spec
    eng.proposers = {"config": eng.spec.proposer, "random": RandomProposer(k, eng.model_cfg.vocab_size)}
    own = eng.spec.hook
    if spec_cfg["method"] == "draft_model":  # a draft model: its weights, and a random-weight twin's (same programs)
        from jaxllm.spec.draft_model import DraftModelProposer, load_draft
        hf, _ = load_draft(spec_cfg["model"], "dummy", None)
        twin = DraftModelProposer(hf, None, k=k, dtype=own.dtype, num_blocks=1, block_size=own.block_size,
                                  max_blocks=own.max_blocks, max_copies=1, num_host_blocks=0, kv=None,
                                  no_ids=own.no_ids, seq_buckets=own.seq_buckets, seed=1,
                                  tp=args.tensor_parallel_size)
        eng.draft_weights = {"own": own.flat, "random": twin.flat}
        eng.proposers["random_draft"] = own
    elif "random_draft" in args.proposer:
        raise SystemExit("--proposer random_draft needs a draft_model speculative_config")
    eng.spec.proposer = eng.proposers[args.proposer[0]]
    import jax
    result = {"mode": args.mode, "model": args.model or args.random_shape or "SmolLM2-135M-Instruct (embedded)",
              "speculative_config": spec_cfg, "proposer": args.proposer, "device": str(jax.devices()[0]),
              "tensor_parallel_size": args.tensor_parallel_size,
              "start_s": time.perf_counter() - t0}
    result["rows"] = run_e2e(llm, args) if args.mode == "e2e" else run_step(llm, args)
    st = llm.stats()
    result["compiles_after_warmup"] = st["compiles_after_warmup"]
    result["spec_metrics"] = {k_: v for k_, v in st.items() if k_.startswith("spec_decode")}
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
