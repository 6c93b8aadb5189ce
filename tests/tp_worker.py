"""Tensor-parallel checks that need forced host devices, run as a subprocess by test_tp.py.

XLA_FLAGS=--xla_force_host_platform_device_count=N must be set before jax is
imported, and it would change every other test's device count, so these run in
their own interpreter and report JSON on the last line of stdout:

    python tests/tp_worker.py tiny      parity / shardings / compiles on random tiny models
    python tests/tp_worker.py smollm2   parity at tp=3 on the embedded SmolLM2 (9 heads, 3 KV)
    python tests/tp_worker.py kv_quant  parity tp=2 vs tp=1 on quantized KV pages
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

GREEDY_TOKENS = 8
SPLIT = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "bq", "bk", "bv", "embed", "lm_head")


def tiny_model(arch: str, heads: int, kv_heads: int, seed: int = 0, vocab: int = 384,
               hidden: int = 64, inter: int = 128, layers: int = 2, head_dim: int = 16
               ) -> tuple[dict, dict[str, np.ndarray]]:
    """An HF config dict and HF-named float32 numpy weights, scaled 1/sqrt(fan_in).

    That scale keeps activations O(1), so greedy picks are well separated and a
    reordered float32 sum (the all-reduce) cannot flip them.
    """
    qwen = arch == "qwen2"
    cfg = dict(model_type=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=qwen)
    rng = np.random.default_rng(seed)

    def lin(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def vec(n: int, base: float) -> np.ndarray:
        return (base + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Tied: a small embedding, else each token's own row dominates its logits (it repeats itself).
    emb_scale = 0.05 if qwen else 1.0
    w = {"model.embed_tokens.weight": (emb_scale * rng.standard_normal((vocab, hidden))).astype(np.float32),
         "model.norm.weight": vec(hidden, 1.0)}
    if not qwen:
        w["lm_head.weight"] = lin(vocab, hidden)
    H, K = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": lin(H, hidden), p + "self_attn.k_proj.weight": lin(K, hidden),
              p + "self_attn.v_proj.weight": lin(K, hidden), p + "self_attn.o_proj.weight": lin(hidden, H),
              p + "mlp.gate_proj.weight": lin(inter, hidden), p + "mlp.up_proj.weight": lin(inter, hidden),
              p + "mlp.down_proj.weight": lin(hidden, inter),
              p + "input_layernorm.weight": vec(hidden, 1.0),
              p + "post_attention_layernorm.weight": vec(hidden, 1.0)}
        if qwen:
            w |= {p + "self_attn.q_proj.bias": vec(H, 0.0), p + "self_attn.k_proj.bias": vec(K, 0.0),
                  p + "self_attn.v_proj.bias": vec(K, 0.0)}
    return cfg, w


def shard_report(runner) -> dict:
    """Global and per-device shapes of each split weight and of the KV pages."""
    from flax import nnx

    out = {}
    pure = nnx.to_pure_dict(runner.params)
    flat = {**{k: v for k, v in pure.items() if k != "layers"}, **pure["layers"]}
    for name, arr in flat.items():
        if name in SPLIT:
            out[name] = {"global": list(arr.shape),
                         "shards": [list(s.data.shape) for s in arr.addressable_shards],
                         "devices": sorted(s.device.id for s in arr.addressable_shards)}
    kv = runner.kv_pages
    out["kv_pages"] = {"global": list(kv.shape),
                       "shards": [list(s.data.shape) for s in kv.addressable_shards],
                       "devices": sorted(s.device.id for s in kv.addressable_shards)}
    return out


def collectives(runner, T: int, R: int) -> list[str]:
    """'op result-shape' of every collective in the compiled (T, R) step, from its HLO.

    Lowering traces the step again, so call this after reading the compile counters.
    """
    from jaxllm.engine.batch import HostBatch
    from jaxllm.engine.device_batch import Batch

    hb = HostBatch(tokens=np.zeros(T, np.int32), positions=np.full(T, -1, np.int32),
                   token_req=np.zeros(T, np.int32), slot_mapping=np.full(T, -1, np.int32),
                   block_tables=np.zeros((R, runner.max_blocks), np.int32),
                   seq_lens=np.zeros(R, np.int32), query_start_loc=np.zeros(R + 1, np.int32),
                   num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(R, np.int32), num_rows=0)
    batch = Batch.from_host(hb, runner.tp.replicated)
    import jax

    prev_ids = jax.device_put(np.zeros(runner.max_rows, np.int32), runner.tp.replicated)
    hlo = runner._step.lower(runner.flat_params, runner.kv_pages, batch, prev_ids).compile().as_text()
    ops = []
    for line in hlo.splitlines():
        for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
            if f" {op}(" in line or f" {op}-start(" in line:
                ops.append(f"{op} {line.split('=', 1)[1].split(op)[0].strip()}")
    return ops


def run_tiny() -> dict:
    from jaxllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 384, size=n).tolist() for n in (3, 11, 29, 70)]  # 70: chunked prefill
    result: dict = {}
    for arch, heads, kv_heads in (("llama", 8, 8), ("qwen2", 8, 2)):
        cfg, weights = tiny_model(arch, heads, kv_heads)
        key = f"{arch}_{heads}q{kv_heads}kv"
        for tp in (1, 2, 4):
            warm = tp == 4 and kv_heads == 2  # the compile check: full warm-up, then a mixed workload
            llm = LLM(hf_config=cfg, weights=weights, dtype="float32", max_model_len=128,
                      max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,),
                      seq_buckets=(4,), tensor_parallel_size=tp, skip_warmup=not warm)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            run = {"tokens": [o.outputs[0].token_ids for o in outs],
                   "device_bytes": llm.engine.runner.device_bytes,
                   "num_blocks": llm.engine.runner.num_blocks}
            if tp > 1:
                run["shards"] = shard_report(llm.engine.runner)
            if warm:
                mixed = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=4),
                         SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                         SamplingParams(temperature=1.0, max_tokens=4, repetition_penalty=1.2, seed=2),
                         greedy]
                llm.generate(prompts, mixed, use_tqdm=False)
                run["stats"] = llm.stats()
                run["collectives"] = collectives(llm.engine.runner, 32, 4)
            result[f"{key}_tp{tp}"] = run
    # The accelerator layout (one array per layer, unrolled), forced on CPU at tp=2.
    from jaxllm.engine.runner import ModelRunner

    init = ModelRunner.__init__
    ModelRunner.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": True})
    try:
        llm = LLM(hf_config=cfg, weights=weights, dtype="float32", max_model_len=128,
                  max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,),
                  seq_buckets=(4,), tensor_parallel_size=2, skip_warmup=True)
    finally:
        ModelRunner.__init__ = init
    runner = llm.engine.runner
    result[f"{key}_tp2_unrolled"] = {
        "tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)],
        "device_bytes": runner.device_bytes,
        "layer_specs": {k: str(v.sharding.spec) for k, v in runner.layer_params[0].items()}}
    return result


def run_smollm2() -> dict:
    from jaxllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = {}
    for tp in (1, 3):
        llm = LLM(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                  token_buckets=(16,), seq_buckets=(2,), tensor_parallel_size=tp, skip_warmup=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        result[f"tp{tp}"] = {"tokens": [o.outputs[0].token_ids for o in outs],
                             "device_bytes": llm.engine.runner.device_bytes}
        if tp > 1:
            result[f"tp{tp}"]["shards"] = shard_report(llm.engine.runner)
    return result


def run_kv_quant() -> dict:
    """Quantized KV pages split by KV head over 2 devices: greedy tokens equal tp=1's."""
    from jaxllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 384, size=n).tolist() for n in (3, 29, 70)]
    cfg, weights = tiny_model("qwen2", 8, 2)
    result = {}
    for name in ("int8", "int4", "fp8"):
        for tp in (1, 2):
            llm = LLM(hf_config=cfg, weights=weights, dtype="float32", max_model_len=128,
                      max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,),
                      seq_buckets=(4,), tensor_parallel_size=tp, skip_warmup=True,
                      kv_cache_dtype=name)
            toks = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            kv = llm.engine.runner.kv_pages
            result[f"{name}_tp{tp}"] = {
                "tokens": toks, "kv_shape": list(kv.shape), "kv_shards": [list(s.data.shape) for s in kv.addressable_shards]}
    return result


if __name__ == "__main__":
    # Only here: importing this module (for tiny_model) must not change the importer's devices.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    which = sys.argv[1]
    res = {"tiny": run_tiny, "smollm2": run_smollm2, "kv_quant": run_kv_quant}[which]()
    print(json.dumps(res))
