"""KV pool sizing from a compiled step's memory analysis (`jaxllm/engine/memory.py`), on CPU."""

from __future__ import annotations

import types

import pytest

from jaxllm.engine.memory import StepMemory, base_limit, describe, plan_pool, xla_limit_options

GiB = 1 << 30
BLOCK = 2 << 20  # 2 MiB a block (Llama-3-8B, 16 tokens, bf16)


def fake_analysis(temp: int, out: int, alias: int, args: int):
    return types.SimpleNamespace(temp_size_in_bytes=temp, output_size_in_bytes=out,
                                 alias_size_in_bytes=alias, argument_size_in_bytes=args)


def probes(temp_at, p1=128, p2=256, weights=15 * GiB, logits=64 << 20):
    """A step whose temporaries are temp_at(P); the pool (P blocks) is donated and aliased."""
    def m(p):
        pool = p * BLOCK
        return StepMemory.of(fake_analysis(temp_at(p), pool + logits, pool, weights + pool))
    return [(p1, m(p1)), (p2, m(p2))]


@pytest.mark.parametrize("temp_at", [lambda p: 3 * GiB, lambda p: 1 * GiB + p * BLOCK,  # a copy of the pool
                                     lambda p: 2 * GiB + p * BLOCK // 8])
@pytest.mark.parametrize("limit,in_use,util", [(100 * GiB, 16 * GiB, 0.9), (60 * GiB, 20 * GiB, 0.9),
                                               (140 * GiB, 15 * GiB, 0.5)])
def test_pool_never_exceeds_free_minus_step(temp_at, limit, in_use, util):
    pr = probes(temp_at)
    plan = plan_pool(limit, in_use, util, BLOCK, pr)
    free = int(limit * util) - in_use
    logits = 64 << 20
    need = lambda p: p * BLOCK + temp_at(p) + logits  # the pool plus what the step allocates
    assert need(plan.num_blocks) <= free
    assert need(plan.num_blocks + 1) > free  # and it is the largest such pool
    assert plan.pool_bytes == plan.num_blocks * BLOCK
    assert plan.step_extra_bytes == temp_at(plan.num_blocks) + logits


def test_io_cap_keeps_xla_limit_positive():
    pr = probes(lambda p: GiB)
    cap = 60 * GiB
    plan = plan_pool(100 * GiB, 16 * GiB, 0.9, BLOCK, pr, io_cap_bytes=cap)
    io = 15 * GiB + plan.num_blocks * BLOCK + (64 << 20)
    assert io <= 0.95 * cap
    assert plan.num_blocks < plan_pool(100 * GiB, 16 * GiB, 0.9, BLOCK, pr).num_blocks


def test_pool_fits_the_largest_free_block():
    """The pool is one array: free memory split by holes (weights built with temporaries) holds
    less than the sum says. H100, 8B dummy weights: 44 GiB free, the largest block 35 GiB."""
    pr = probes(lambda p: GiB)
    whole = plan_pool(60 * GiB, 15 * GiB, 0.9, BLOCK, pr, headroom_bytes=2 * GiB)
    split = plan_pool(60 * GiB, 15 * GiB, 0.9, BLOCK, pr, headroom_bytes=2 * GiB, largest_free_bytes=35 * GiB)
    assert whole.pool_bytes > 35 * GiB - 3 * GiB
    assert split.pool_bytes + split.step_extra_bytes <= 35 * GiB - 2 * GiB
    assert split.pool_bytes + BLOCK + GiB + (64 << 20) > 35 * GiB - 2 * GiB  # the largest that fits
    roomy = plan_pool(60 * GiB, 15 * GiB, 0.9, BLOCK, pr, headroom_bytes=2 * GiB, largest_free_bytes=45 * GiB)
    assert roomy == whole  # a block larger than what is free changes nothing


def test_too_small_names_the_fix():
    with pytest.raises(ValueError, match="gpu_memory_utilization.*kv_cache_memory_bytes"):
        plan_pool(20 * GiB, 16 * GiB, 0.9, BLOCK, probes(lambda p: GiB), min_blocks=10_000)


def test_xla_limit_options():
    assert xla_limit_options("cpu", 100 * GiB, 90 * GiB, 80 * GiB) == {}
    limit = 100 * GiB
    io, out = 85 * GiB, 70 * GiB
    opts = xla_limit_options("gpu", limit, io, out)
    slop = opts["xla_gpu_memory_limit_slop_factor"]
    # XLA: (base - io) * slop / 100 - outputs, the rematerialization limit, covers the allocator.
    assert (base_limit(limit) - io) * slop / 100 - out >= 3 * limit
    assert xla_limit_options("gpu", limit, 2 * limit, out) == {}  # no factor can help: io capped instead
    assert base_limit(100 * GiB, client_fraction=0.75) == 100 * GiB
    assert base_limit(90 * GiB, client_fraction=0.9) == int(0.8 * 100 * GiB)


def test_describe():
    line = describe(1000, 16, 1000 * BLOCK, 2048)
    assert "1.95 GiB" in line and "1000 blocks" in line and "16000 tokens" in line and "7.81x" in line


def test_runner_sizes_from_its_compiled_step():
    """The runner's own probe path on CPU: real compiled steps, fake device memory."""
    from jaxllm import LLM
    from jaxllm.models.shapes import TINY

    llm = LLM(hf_config=dict(TINY, max_position_embeddings=256), max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, skip_warmup=True)
    r = llm.engine.runner
    per_block = r._bytes_per_block()
    traces = r.num_traces
    limit, in_use = 4 << 30, 8 << 20
    blocks = r._profiled_blocks(limit, in_use, None, min_blocks=r.max_blocks)
    step = StepMemory.of(r._compile_probe(blocks, {}).memory_analysis())
    from jaxllm.engine.pool_sizing import SIZING_HEADROOM
    free = int(limit * 0.9) - in_use - SIZING_HEADROOM
    assert blocks >= r.max_blocks
    assert blocks * per_block + step.extra_bytes <= free
    assert (blocks + 8) * per_block + step.extra_bytes > free  # close to the largest fit
    assert r.num_traces >= traces  # probes traced the step


def test_engine_starts_when_the_pool_is_sized_from_the_compiled_step(monkeypatch):
    """Accelerators size the pool inside the runner's constructor, before any step has run: the
    probes' traces must not need state the constructor sets later (an H200 start-up failed so)."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.engine.runner import ModelRunner
    from jaxllm.models.shapes import TINY

    monkeypatch.setattr(ModelRunner, "_memory_stats", lambda self: (4 << 30, 8 << 20, None))
    monkeypatch.setattr(ModelRunner, "_num_blocks", lambda self, max_model_len: self._profiled_blocks(
        *self._memory_stats(), min_blocks=self.max_blocks))
    llm = LLM(hf_config=dict(TINY, max_position_embeddings=256), max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, skip_warmup=True)
    r = llm.engine.runner
    assert r.num_blocks >= r.max_blocks and r.num_traces == 0  # the probes' traces are not counted
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_given_pool_still_gets_xla_real_limit(monkeypatch):
    """A pool of given size (`num_gpu_blocks_override`, `kv_cache_memory_bytes`) on a GPU: the
    step's compile still gets the slop factor that gives XLA the real limit (without it XLA logged
    "Can't reduce memory use below ..." for the MoE decode bench on an H100, session 35)."""
    import dataclasses

    from jaxllm import LLM
    from jaxllm.engine.runner import ModelRunner
    from jaxllm.models.shapes import TINY

    llm = LLM(hf_config=dict(TINY, max_position_embeddings=256), max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, skip_warmup=True)
    r = llm.engine.runner
    assert r.compiler_options == {}  # the CPU: none
    monkeypatch.setattr(ModelRunner, "_memory_stats", lambda self: (4 << 30, 8 << 20, None))
    r.platform = "gpu"
    for given in (dict(num_gpu_blocks_override=100), dict(kv_cache_memory_bytes=100 * r._bytes_per_block())):
        r.compiler_options = {}
        r.cfg = dataclasses.replace(r.cfg, **given)
        assert r._num_blocks(256) == 100
        io, out = r._step_io(100)
        assert r.compiler_options == xla_limit_options("gpu", 4 << 30, io, out) != {}
