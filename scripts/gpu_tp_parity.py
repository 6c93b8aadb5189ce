"""float32 greedy ids at tensor_parallel_size N vs 1, on the GPUs of this machine.

Random weights from the engine's seeded init, which gives the same values however
the weights are split, so tp=1 and tp=N run the identical model. Shapes:
"smollm2-like" (SmolLM2-135M's hidden size, layers and vocabulary, but 8 query /
2 KV heads of 64, since tp=2 must divide the query heads and SmolLM2 has 9) and
"llama3-8b", and "qwen3-moe-4l" (Qwen3-30B-A3B's layer, 128 experts top-8, four layers:
~10 GB of float32 experts; "tiny-moe" checks the wiring on forced CPU devices). With `--ep`, every tp > 1 also runs with
`enable_expert_parallel` (whole experts per device, all-to-all dispatch): issue 15's
expert parallelism against one device on GPUs. One JSON line per (shape, backend, tp, ep).

    python scripts/gpu_tp_parity.py --tp 1 2 --shapes smollm2-like llama3-8b
    python scripts/gpu_tp_parity.py --tp 1 2 --shapes qwen3-moe-4l --ep
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))


def shape(name: str) -> dict:
    from shapes import LLAMA3_8B, SMOLLM2_135M

    from jaxllm.models.shapes import QWEN3_30B_A3B, TINY_MOE
    if name == "tiny-moe":  # the wiring, on forced CPU devices
        return TINY_MOE
    if name == "smollm2-like":
        return dict(SMOLLM2_135M, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    if name == "qwen3-moe-4l":
        return dict(QWEN3_30B_A3B, num_hidden_layers=4)
    return {"llama3-8b": LLAMA3_8B}[name]


def run(cfg: dict, tp: int, backend: str | None, ep: bool = False) -> tuple[list[list[int]], dict]:
    from jaxllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(hf_config=cfg, dtype="float32", tensor_parallel_size=tp, attention_backend=backend,
              enable_expert_parallel=ep,
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
              seq_buckets=(8,), kv_cache_memory_bytes=1 << 30)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg["vocab_size"], size=n).tolist() for n in (5, 17, 33, 64, 100)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    info = {"compiles_after_warmup": llm.stats()["compiles_after_warmup"],
            "device_bytes": llm.engine.runner.device_bytes, "seconds": round(time.perf_counter() - t0, 1)}
    ids = [o.outputs[0].token_ids for o in outs]
    del llm, outs
    gc.collect()
    return ids, info


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shapes", nargs="+", default=["smollm2-like", "llama3-8b"])
    p.add_argument("--backends", nargs="+", default=["auto"])
    p.add_argument("--ep", action="store_true", help="each tp > 1 also with enable_expert_parallel")
    args = p.parse_args()
    ok = True
    for name in args.shapes:
        for backend in args.backends:
            ref = None
            runs = [(tp, ep) for tp in args.tp for ep in ((False, True) if args.ep and tp > 1 else (False,))]
            for tp, ep in runs:
                ids, info = run(shape(name), tp, None if backend == "auto" else backend, ep)
                ref = ref or ids
                same = sum(a == b for x, y in zip(ids, ref) for a, b in zip(x, y))
                ok &= ids == ref
                print(json.dumps(dict(shape=name, backend=backend, tp=tp, ep=ep,
                                      match=f"{same}/{sum(map(len, ref))}", **info)), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
