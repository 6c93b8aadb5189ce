"""A tiny random-weight Llama engine for the KV connector tests (no torch, no download)."""

from __future__ import annotations

import numpy as np

from jaxllm import LLM, SamplingParams

CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=384, hidden_size=64,
           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
S = 16
BLOCK_BYTES = 2 * 2 * 2 * S * 16 * 4  # layers x K/V x kv heads x tokens x head dim x float32
POOL = 24  # device blocks: one 384-token sequence, so every new long prompt evicts the last


def gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / (1 << 30)


def rand(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 384, size=n).tolist()


def make(**kw) -> LLM:
    """Compiles lazily (skip_warmup): greedy steps compile the one bucket they use."""
    args = dict(hf_config=CFG, dtype="float32", max_model_len=384, max_num_seqs=4,
                max_num_batched_tokens=64, token_buckets=(64,), seq_buckets=(4,),
                num_gpu_blocks_override=POOL, skip_warmup=True, seed=7)
    args.update(kw)
    llm = LLM(**args)
    e = llm.engine
    e.runner.kv_pages = e.kv_ops.warmup(e.runner.kv_pages)  # the page moves, as at start-up
    llm.kv_compiled = e.kv_ops.num_compiled()
    return llm


def run1(llm: LLM, prompt: list[int]):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def gen(llm: LLM, prompt: list[int], max_tokens: int, params: dict | None = None, rid: str = "r"):
    """One greedy request through the engine's own loop (kv_transfer_params passed through);
    its last output."""
    e = llm.engine
    e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                  kv_transfer_params=params)
    last = None
    while e.has_unfinished_requests():
        for o in e.step():
            last = o
    return last
