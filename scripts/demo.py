"""Offline generation with the embedded SmolLM2-135M-Instruct: text and tokens/s."""

import argparse
import time

from jaxllm import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain what a KV cache is in one paragraph.",
    "Write a haiku about the sea.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--random-shape", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, random_shape=args.random_shape,
              max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256)
    print(f"engine ready in {time.perf_counter() - t0:.1f}s")
    params = SamplingParams(temperature=0.0, max_tokens=96)
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for q, o in zip(QUESTIONS, outs):
        print(f"\n### {q}\n{o.outputs[0].text.strip()}")
    print(f"\n{len(outs)} requests, {n} tokens in {dt:.2f}s: {n / dt:.1f} output tokens/s "
          f"(compiles after warm-up: {llm.stats()['compiles_after_warmup']})")


if __name__ == "__main__":
    main()
