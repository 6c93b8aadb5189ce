"""float32 greedy ids of a SmolLM2-shaped model on this machine vs stored CPU ids.

The weights are drawn from a fixed numpy seed (the real SmolLM2 GGUF, 98 MB, is
too large to carry to the GPU machine), so CPU and GPU run the identical model.

    python scripts/gpu_parity.py --write scripts/data/smollm2_cpu_ids.json   # on the CPU
    python scripts/gpu_parity.py --check scripts/data/smollm2_cpu_ids.json   # on the GPU
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))


def run(backend: str | None) -> list[list[int]]:
    from shapes import SMOLLM2_135M, seeded_weights

    from jaxllm import LLM, SamplingParams

    # Untied head: with random tied embeddings the model just repeats its input token,
    # which would make a weak comparison.
    cfg = dict(SMOLLM2_135M, tie_word_embeddings=False)
    llm = LLM(hf_config=cfg, weights=seeded_weights(cfg), dtype="float32",
              max_model_len=256, max_num_seqs=8, token_buckets=(16, 64), seq_buckets=(8,),
              attention_backend=backend, kv_cache_memory_bytes=1 << 30)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, size=n).tolist() for n in (5, 17, 33, 64, 100)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["compiles_after_warmup"] == 0
    ids = [o.outputs[0].token_ids for o in outs]
    del llm  # free its KV pages before the next backend's engine sizes its own
    import gc
    gc.collect()
    return ids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--write")
    p.add_argument("--check")
    p.add_argument("--backends", nargs="*", default=[None])
    args = p.parse_args()
    if args.write:
        with open(args.write, "w") as f:
            json.dump(run(None), f)
        return
    ref = json.load(open(args.check))
    ok = True
    for b in args.backends:
        b = None if b in (None, "auto") else b
        ids = run(b)
        same = ids == ref
        ok &= same
        n = sum(x == y for a, r in zip(ids, ref) for x, y in zip(a, r))
        print(f"backend={b}: {'IDENTICAL' if same else 'DIFFERENT'} ({n}/{sum(map(len, ref))} tokens equal)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
