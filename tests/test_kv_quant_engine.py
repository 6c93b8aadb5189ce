"""Quantized KV caches end to end: prefix hits, recompute and swap preemption, tensor
parallelism and the pool's block count, each against the same dtype's plain run.

Pages carry their scales in their rows (kernels/kv_quant.py), so every page move
(swap, copy-on-write, prefix reuse, TP shards) must keep outputs unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hf_tiny import TINY, make, make_llm

from jaxllm import SamplingParams
from jaxllm.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]  # 16
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tiny():
    _, cfg, sd = make("llama3", seed=3)
    return cfg, sd


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    shared = rng.integers(0, 384, size=40).tolist()  # two full blocks shared by the last three
    out = [rng.integers(0, 384, size=n).tolist() for n in np.linspace(20, 300, 9).astype(int)]
    return out + [shared + rng.integers(0, 384, size=n).tolist() for n in (5, 17, 30)]


@pytest.fixture(scope="module")
def plain_llms(tiny):
    """One prefix-caching-off engine per KV dtype, built on first use and shared by the tests
    that only generate on it (an engine's build and warm-up is most of each test's time)."""
    cache = {}

    def get(kv_dtype):
        if kv_dtype not in cache:
            cache[kv_dtype] = make_llm(tiny, kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
        return cache[kv_dtype]
    return get


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "int4"])
def test_prefix_hits_and_preemption_keep_the_plain_output(tiny, plain_llms, prompts, kv_dtype):
    plain = plain_llms(kv_dtype)
    assert plain.engine.runner.kv_pages.dtype.name == ("float8_e4m3fn" if kv_dtype == "fp8" else "uint8")
    before = plain.stats()["num_preemptions"]
    want = tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert plain.stats()["num_preemptions"] == before
    # 40 blocks: preemption; a host pool of 8 blocks: some swap, some recompute.
    block = plain.engine.runner._bytes_per_block()
    busy = make_llm(tiny, kv_cache_dtype=kv_dtype, num_gpu_blocks_override=40,
                    preemption_mode="swap", swap_space=8 * block / 2**30)
    assert tokens(busy.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert tokens(busy.generate(prompts[::-1], GREEDY, use_tqdm=False)) == want[::-1]
    st = busy.stats()
    assert st["num_swapped_out"] > 0 and st["num_preemptions"] > st["num_swapped_out"]
    assert st["prefix_cache_hits"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"] == 40
    assert st["compiles_after_warmup"] == 0


def test_pool_block_count_per_dtype_at_a_fixed_budget(tiny):
    budget = 1 << 20
    blocks = {}
    for name in ("auto", "fp8", "int8", "int4"):
        llm = make_llm(tiny, kv_cache_dtype=name, kv_cache_memory_bytes=budget, skip_warmup=True)
        blocks[name] = llm.engine.runner.num_blocks
    # Per token and layer: 2 (K, V) x 2 KV heads x row bytes; 2 layers, 16 tokens a block.
    row = {"auto": HEAD_DIM * 4, "fp8": HEAD_DIM, "int8": HEAD_DIM + 2, "int4": HEAD_DIM // 2 + 4}
    for name, r in row.items():
        assert blocks[name] == budget // (2 * 2 * 2 * 16 * r), name
    assert blocks["int4"] > blocks["int8"] > blocks["fp8"] * 0.8 and blocks["fp8"] == 4 * blocks["auto"]


def test_unknown_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")


def test_cli_flag():
    import argparse

    from jaxllm.engine.arg_utils import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "int4"]))["kv_cache_dtype"] == "int4"


def test_tp2_equals_tp1_on_quantized_pages():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.join(HERE, "tp_worker.py"), "kv_quant"], env=env,
                         cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("int8", "int4", "fp8"):
        assert out[f"{name}_tp2"]["tokens"] == out[f"{name}_tp1"]["tokens"], name
        shards = out[f"{name}_tp2"]["kv_shards"]
        assert len(shards) == 2 and shards[0][2] * 2 == out[f"{name}_tp1"]["kv_shape"][2]


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "int4"])
def test_copy_on_write_keeps_the_scales(plain_llms, prompts, kv_dtype):
    """n = 2 greedy siblings share the prompt's partly filled last block; their first decode
    step copies it (copy-on-write). With the scales in the page rows the copy must carry them:
    each sibling's output is the single request's."""
    llm = plain_llms(kv_dtype)
    few = [p for p in prompts if len(p) % 16][:4]  # last blocks partly filled: shared, then copied
    want = tokens(llm.generate(few, GREEDY, use_tqdm=False))
    before = llm.stats()["num_cow_copies"]
    pair = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(few, pair, use_tqdm=False)]
    assert got == [[w, w] for w in want]
    st = llm.stats()
    assert st["num_cow_copies"] - before >= len(few)
    assert st["num_free_blocks"] == st["num_total_blocks"] and st["compiles_after_warmup"] == 0
