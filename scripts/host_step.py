"""Host time per engine step at a large batch, on a tiny model (on CPU the device work is small).

    python scripts/host_step.py --batch 256                # final outputs only (what LLM.generate asks for)
    python scripts/host_step.py --batch 256 --cumulative   # every step builds every request's output
    python scripts/host_step.py --batch 256 --profile      # and the host's top functions (cProfile)
    python scripts/host_step.py --batch 64 --vocab 128256 --structured json   # JSON-schema rows

`--vocab N` gives the tiny model a vocabulary of N ids (a config-only folder, dummy weights, the
byte-level fallback tokenizer), so per-row work that scales with the vocabulary (the structured
outputs bitmask) is sized as on a real model; `--structured json` puts every request under
bench_serving's JSON schema (temperature 1 then, so the grammar is exercised; compare with
`--temperature 1` without it).

`--segments` times the engine thread's parts of a step (schedule, launch, process, and in them
the waits for the device and for the dispatch thread) and the dispatch thread's `_run`, by
wrapping those methods: ms per step each (nested parts overlap their callers).

`--batch` prompts of 32 tokens, `--max-tokens` output tokens each (ignore_eos), max_num_seqs =
the batch, stepped as `LLM.generate` steps them; `--cumulative` and the default differ only in
`SamplingParams.output_kind`. Prints ms per step (wall / output tokens per request).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import RequestOutputKind


def run(llm: LLM, prompts: list[list[int]], sp: SamplingParams, tag: str) -> None:
    eng = llm.engine
    for i, ids in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", ids, sp)
    while eng.has_unfinished_requests():
        eng.step()


def segment_timers(eng) -> collections.Counter:
    """Wrap the step's parts (engine thread, dispatch thread) to sum their seconds by name."""
    from jaxllm.engine import dispatch, sampler
    from jaxllm.structured import manager

    acc: collections.Counter = collections.Counter()

    def wrap(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t
        setattr(obj, name, timed)

    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng.scheduler, "update", "scheduler.update")
    wrap(eng, "_launch", "launch")
    wrap(eng, "_process", "process")
    wrap(sampler.PendingSample, "fetch", "process: wait for the device")
    wrap(dispatch.Launched, "result", "process: wait for the dispatch thread")
    wrap(manager.StructuredManager, "advance", "matchers advance")
    wrap(manager.StructuredManager, "hand_off", "mask hand-off")
    wrap(dispatch.Dispatcher, "_run", "dispatch thread: _run")
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cumulative", action="store_true", help="per-step outputs (output_kind CUMULATIVE)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size of the tiny model")
    p.add_argument("--structured", choices=["none", "json"], default="none")
    p.add_argument("--temperature", type=float, default=None, help="default 0, or 1 with --structured")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval (s); the server sets 0.0005 (jaxllm/server/args.py)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs (fresh prompts each)")
    p.add_argument("--segments", action="store_true", help="ms per step in the step's parts")
    args = p.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    kind = RequestOutputKind.CUMULATIVE if args.cumulative else RequestOutputKind.FINAL_ONLY
    kw = dict(max_model_len=512, max_num_seqs=args.batch, max_num_batched_tokens=2048)
    if args.vocab is None:
        llm = LLM(random_shape="tiny", **kw)
    else:
        from jaxllm.models.shapes import get_shape
        folder = tempfile.mkdtemp(prefix="host_step_")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dict(get_shape("tiny"), vocab_size=args.vocab), f)
        llm = LLM(model=folder, load_format="dummy", **kw)
    vocab = llm.engine.model_cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab - 10, size=32).tolist() for _ in range(args.batch)]
    temperature = args.temperature if args.temperature is not None else float(args.structured != "none")
    extra = {}
    if args.structured == "json":
        from jaxllm.sampling_params import StructuredOutputsParams
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_serving import STRUCTURED_SCHEMA
        extra["structured_outputs"] = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True, output_kind=kind,
                        seed=0, **extra)
    acc = segment_timers(llm.engine) if args.segments else None
    run(llm, prompts[:8], sp, "warm")
    for rep in range(args.repeat):
        if acc is not None:
            acc.clear()
        prof = cProfile.Profile()
        t = time.perf_counter()
        if args.profile:
            prof.enable()
        run(llm, prompts if rep == 0 else [rng.integers(10, vocab - 10, size=32).tolist()
                                          for _ in range(args.batch)], sp, f"timed{rep}")
        prof.disable()
        dt = time.perf_counter() - t
        report(args, kind, vocab, temperature, dt, prof)
        for name, sec in sorted((acc or {}).items(), key=lambda kv: -kv[1]):
            print(f"  {name:38s} {sec / args.max_tokens * 1e3:6.2f} ms per step")


def report(args, kind, vocab, temperature, dt, prof) -> None:
    print(f"batch {args.batch}: {dt:.2f} s, {args.batch * args.max_tokens / dt:.0f} tok/s, "
          f"{dt / args.max_tokens * 1e3:.1f} ms per step ({kind.name.lower()}, vocab {vocab}, "
          f"structured {args.structured}, temperature {temperature:g})")
    if args.profile:
        pstats.Stats(prof).sort_stats("cumtime").print_stats(30)


if __name__ == "__main__":
    main()
