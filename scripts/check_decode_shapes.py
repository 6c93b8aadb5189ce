"""GPU check of the Mosaic decode kernel across head shapes, against ref.py (poisoned output),
and the engine on the small models' shapes with and without it:

    python3 scripts/check_decode_shapes.py [--engine] [--no-kernels]

Kernel: (K kv heads, G query heads per KV head, head dim D) in Llama-3-8B's (8, 4, 128),
Llama-3.2-1B's (8, 4, 64), SmolLM2's (3, 3, 64) padded to G = 4 (`kernels.padded_group`), and
(3, 3, 128) padded; bf16 pages, fp8 pages at (8, 4, 128) / (8, 4, 64), int4 pages at (8, 4, 128),
(8, 4, 64) and (3, 3, 64) padded, int8 at (8, 4, 128) / (8, 4, 64) (int pages: the byte copies and
register dequantization of mosaic_kv_quant.py; int4 at D = 64 has its own staging tiles); B decode
tokens at context 512 (B = 1: one 64-key block per split; B = 8 and 64: several blocks per CTA),
16-token pages. One JSON line per case; ok = rel err < 1e-2 (fp8: < 5e-2), against the
reference on the same stored pages.

--engine: `LLM(random_shape=...)` for llama3.2-1b and smollm2-135m (dummy weights, bf16),
greedy decoding of 128 tokens from 64-token prompts at batch 1 and 8, with decode steps on the
Mosaic decode kernel (the default) and with them on the prefill/mixed path's kernel or the
reference as before (`kernels.decode_head_dim_ok` patched to False); tok/s of each and whether
the greedy tokens agree (and
where each request's first differ).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import check_padded_group as cpg  # noqa: E402
from bench_kernels import check  # noqa: E402
import jaxllm.kernels as kernels  # noqa: E402
from jaxllm.kernels import kv_quant, mosaic_decode, ref  # noqa: E402


def kernel_rows() -> int:
    bad = 0
    shapes = [(8, 4, 128, "bf16"), (8, 4, 64, "bf16"), (3, 3, 64, "bf16"), (3, 3, 128, "bf16"),
              (8, 4, 128, "fp8"), (8, 4, 64, "fp8"), (8, 4, 128, "int4"), (8, 4, 64, "int4"),
              (3, 3, 64, "int4"), (8, 4, 128, "int8"), (8, 4, 64, "int8")]
    for K, G, D, pages in shapes:
        cpg.K, cpg.G, cpg.D = K, G, D
        scale = D ** -0.5
        kernel = functools.partial(mosaic_decode.paged_decode_attention, sm_scale=scale)
        fn = kernel if G & (G - 1) == 0 else functools.partial(kernels.padded_group, kernel, sm_scale=scale)
        for batch in (1, 8, 64):
            c = cpg.case(batch, 512, 1, layers=2)
            if pages == "fp8":
                c["kv"] = c["kv"].astype(jnp.float8_e4m3fn)
            elif pages in ("int8", "int4"):
                dtype, width = kv_quant.page_layout(pages, c["kv"].dtype, D)
                c["kv"] = kv_quant.encode(c["kv"], dtype, width)
            want = np.asarray(jax.jit(functools.partial(ref.ragged_paged_attention, sm_scale=scale))(
                c["qs"][-1], c["kv"], jnp.int32(0), c["md"]).astype(jnp.float32))
            tol = 5e-2 if pages == "fp8" else 1e-2
            row = dict(K=K, G=G, D=D, pages=pages, batch=batch)
            try:
                err = check(fn, c, want)
                row.update(rel_err=round(err, 5), ok=err < tol)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[-500:]
            bad += not row.get("ok")
            print(json.dumps(row), flush=True)
    return bad


def engine_rows() -> None:
    from jaxllm import LLM, SamplingParams
    on = kernels.decode_head_dim_ok
    for shape in ("llama3.2-1b", "smollm2-135m"):
        toks = {}
        for mode in ("decode_kernel", "before"):
            kernels.decode_head_dim_ok = on if mode == "decode_kernel" else (lambda *a: False)
            t0 = time.perf_counter()  # the routing is read when the steps are traced (warm-up)
            llm = LLM(None, random_shape=shape, load_format="dummy", max_num_seqs=8,
                      max_model_len=1024, num_gpu_blocks_override=1024, max_num_batched_tokens=512,
                      token_buckets=(8, 512), seq_buckets=(1, 8))
            start = time.perf_counter() - t0
            rng = np.random.default_rng(0)
            vocab = llm.engine.model_cfg.vocab_size
            for b in (1, 8):
                prompts = [{"prompt_token_ids": rng.integers(0, vocab, 64).tolist()} for _ in range(b)]
                sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
                llm.generate(prompts, sp, use_tqdm=False)  # the timed run's shapes, warm
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.perf_counter() - t
                toks[mode, b] = [o.outputs[0].token_ids for o in outs]
                n = sum(len(t) for t in toks[mode, b])
                print(json.dumps(dict(shape=shape, mode=mode, batch=b, tok_s=round(n / dt, 1),
                                      start_s=round(start, 1),
                                      compiles_after_warmup=llm.stats()["compiles_after_warmup"])),
                      flush=True)
            del llm
        for b in (1, 8):
            a, z = toks["decode_kernel", b], toks["before", b]
            same = np.mean([x == y for x, y in zip(a, z)])
            first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(a, z)]
            print(f"  {shape} batch {b}: greedy outputs identical in {same:.2f} of the requests; "
                  f"first differing token of each: {first}", flush=True)
    kernels.decode_head_dim_ok = on


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine", action="store_true")
    p.add_argument("--no-kernels", action="store_true", help="the engine part only")
    a = p.parse_args()
    if not a.no_kernels:
        print(f"summary: {kernel_rows()} kernel cases failed", flush=True)
    if a.engine:
        engine_rows()


if __name__ == "__main__":
    main()
