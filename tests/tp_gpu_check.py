"""Tensor parallelism on real accelerators: tp=N vs tp=1 greedy ids, and 2 processes x 1 GPU.

Not collected by pytest (CI has no GPU); run by hand on a machine with >= 2 GPUs:

    python tests/tp_gpu_check.py single            # tp=1 vs tp=2 (and 4 if present), both dtypes
    python tests/tp_gpu_check.py multi             # spawns 2 processes, one GPU each, vs tp=2

Prints one JSON line per run. The model is random (numpy seed) with head_dim 64,
which the Mosaic decode kernel needs, and 8 query / 2 KV heads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KW = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
          seq_buckets=(8,), kv_cache_memory_bytes=1 << 30)


def model():
    from tp_worker import tiny_model
    return tiny_model("llama", 8, 2, seed=3, vocab=1024, hidden=512, inter=1024, layers=4,
                      head_dim=64)


def prompts():
    import numpy as np
    rng = np.random.default_rng(0)
    return [rng.integers(0, 1024, size=n).tolist() for n in (5, 17, 40, 100)]


def generate(llm) -> list[list[int]]:
    from jaxllm import SamplingParams
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def single() -> None:
    import jax

    from jaxllm import LLM

    cfg, w = model()
    sizes = [n for n in (1, 2, 4) if n <= jax.device_count()]
    for dtype in ("float32", "bfloat16"):
        for backend in (None, "reference"):
            ref = None
            for tp in sizes:
                t0 = time.perf_counter()
                llm = LLM(hf_config=cfg, weights=w, dtype=dtype, tensor_parallel_size=tp,
                          attention_backend=backend, **KW)
                ids = generate(llm)
                ref = ref or ids
                same = sum(a == b for x, y in zip(ids, ref) for a, b in zip(x, y))
                print(json.dumps(dict(dtype=dtype, backend=backend or "auto", tp=tp,
                                      match=f"{same}/{sum(map(len, ref))}",
                                      compiles_after_warmup=llm.stats()["compiles_after_warmup"],
                                      device_bytes=llm.engine.runner.device_bytes,
                                      num_blocks=llm.engine.runner.num_blocks,
                                      seconds=round(time.perf_counter() - t0, 1))), flush=True)
                del llm


def multi_child(pid: int, port: int) -> None:
    from jaxllm import LLM
    from jaxllm.engine.multihost import run_follower

    cfg, w = model()
    dist = dict(distributed_coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                tensor_parallel_size=2, dtype="float32", **KW)
    if pid:
        run_follower(hf_config=cfg, weights=w, **dist)
        return
    llm = LLM(hf_config=cfg, weights=w, **dist)
    ids = generate(llm)
    print(json.dumps(dict(multi_ids=ids, compiles_after_warmup=llm.stats()["compiles_after_warmup"])))


def multi() -> None:
    from jaxllm import LLM

    port = 23456
    # One device per child: one GPU each (or, on CPU, one host device each).
    env = lambda i: dict(os.environ, CUDA_VISIBLE_DEVICES=str(i), XLA_FLAGS="")  # noqa: E731
    logs = os.environ.get("TP_LOG_DIR", "/tmp")
    errs = [open(os.path.join(logs, f"child{i}.err"), "w") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, "child", str(i), str(port)], env=env(i),
                              stdout=subprocess.PIPE, stderr=errs[i], text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=int(os.environ.get("TP_CHILD_TIMEOUT", "500"))) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    leader = json.loads(outs[0][0].strip().splitlines()[-1])
    cfg, w = model()
    ids = generate(LLM(hf_config=cfg, weights=w, dtype="float32", tensor_parallel_size=2, **KW))
    print(json.dumps(dict(multi_equals_single=leader["multi_ids"] == ids,
                          leader_compiles_after_warmup=leader["compiles_after_warmup"],
                          returncodes=[p.returncode for p in procs])))


if __name__ == "__main__":
    if sys.argv[1] == "child":
        import faulthandler
        faulthandler.dump_traceback_later(int(os.environ.get("TP_CHILD_TIMEOUT", "500")) - 20)
        multi_child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        {"single": single, "multi": multi}[sys.argv[1]]()
