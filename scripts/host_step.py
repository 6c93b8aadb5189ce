"""Host time per engine step at a large batch, on a tiny model (on CPU the device work is small).

    python scripts/host_step.py --batch 256                # final outputs only (what LLM.generate asks for)
    python scripts/host_step.py --batch 256 --cumulative   # every step builds every request's output
    python scripts/host_step.py --batch 256 --profile      # and the host's top functions (cProfile)

`--batch` prompts of 32 tokens, `--max-tokens` greedy output tokens each (ignore_eos),
max_num_seqs = the batch, stepped as `LLM.generate` steps them; the two modes differ only in
`SamplingParams.output_kind`. Prints ms per step (wall / output tokens per request).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cumulative", action="store_true", help="per-step outputs (output_kind CUMULATIVE)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    kind = RequestOutputKind.CUMULATIVE if args.cumulative else RequestOutputKind.FINAL_ONLY
    llm = LLM(random_shape="tiny", max_model_len=512, max_num_seqs=args.batch, max_num_batched_tokens=2048)
    vocab = llm.engine.model_cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab - 10, size=32).tolist() for _ in range(args.batch)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, output_kind=kind)
    run(llm, prompts[:8], sp, "warm")
    prof = cProfile.Profile()
    t = time.perf_counter()
    if args.profile:
        prof.enable()
    run(llm, prompts, sp, "timed")
    prof.disable()
    dt = time.perf_counter() - t
    print(f"batch {args.batch}: {dt:.2f} s, {args.batch * args.max_tokens / dt:.0f} tok/s, "
          f"{dt / args.max_tokens * 1e3:.1f} ms per step ({kind.name.lower()})")
    if args.profile:
        pstats.Stats(prof).sort_stats("cumtime").print_stats(30)


if __name__ == "__main__":
    main()
