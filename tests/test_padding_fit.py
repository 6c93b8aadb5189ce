"""Prompt chunks fitted to the token buckets (runtime/padding.py): a step that would just cross
a large bucket is cut back to it; the output is the same, the padded tokens fewer."""

from __future__ import annotations

import pytest

from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.padding import fit_chunk
from jaxllm.runtime.request import Request, StopRule
from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig

BUCKETS = (8, 16, 32, 64, 256, 512, 1024, 2048)


@pytest.mark.parametrize("used,n,want", [
    (63, 600, 449),  # 663 -> 1,024: cut to 512
    (63, 800, 800),  # 863: upper half of (512, 1024], padding < filling: keep
    (63, 151, 151),  # 214 -> 256: below the smallest bucket fitted
    (0, 300, 256),  # a lone prompt: 256 now, 44 next
    (0, 1100, 1024),
    (500, 30, 30),  # the cut would keep 12 of 30 tokens (< half): keep
    (63, 2000, 2000),  # past the largest bucket: not ours to judge
    (0, 3, 3),
])
def test_fit_chunk(used, n, want):
    assert fit_chunk(used, n, BUCKETS, 256) == want


def test_fit_chunk_respects_min_bucket():
    assert fit_chunk(63, 600, BUCKETS, 1024) == 600
    assert fit_chunk(0, 300, BUCKETS, 0) == 256


def _req(rid: str, n: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, n + 1)), StopRule(max_tokens=max_tokens, eos_token_ids=(0,)))


def test_scheduler_cuts_the_prompt_chunk_at_the_bucket_and_finishes_it_next_step():
    kv = KVCacheManager(4096, 16, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096,
                                      token_buckets=BUCKETS), kv)
    for i in range(63):
        sched.add(_req(f"d{i}", 10, 50))
    out = sched.schedule()  # 63 short prompts: past 512 no cut keeps half of a 10-token prompt
    assert out.num_batched_tokens <= 630
    while True:  # finish the prompts; every row then decodes one token a step
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
        if all(len(r.output_token_ids) >= 1 for r in sched.running) and len(sched.running) == 63:
            break
        out = sched.schedule()
    sched.add(_req("p", 600, 5))
    out = sched.schedule()
    by_id = {s.request_id: s for s in out.scheduled}
    assert out.num_batched_tokens == 512 and len(by_id["p"].token_ids) == 449 and not by_id["p"].sample
    sched.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
    out = sched.schedule()
    by_id = {s.request_id: s for s in out.scheduled}
    assert len(by_id["p"].token_ids) == 151 and by_id["p"].sample and out.num_batched_tokens == 63 + 151


def test_without_buckets_nothing_is_cut():
    kv = KVCacheManager(4096, 16, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096), kv)
    sched.add(_req("p", 600, 5))
    assert sched.schedule().num_batched_tokens == 600


def test_engine_output_is_the_same_with_chunks_fitted():
    """Greedy output of the tiny random model: prompts of 300-400 tokens (cut at 256 on CPU's
    buckets) give the tokens they give with fitting off."""
    import dataclasses

    import numpy as np

    from jaxllm import LLM, SamplingParams

    llm = LLM(random_shape="tiny", max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=512,
              dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(5, 500, size=n).tolist()} for n in (300, 350, 400)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sched = llm.engine.scheduler
    assert sched.config.token_buckets[-1] == 512 and sched.config.fit_min_bucket == 256
    fitted = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    sched.config = dataclasses.replace(sched.config, token_buckets=())
    llm.engine.kv.reset_prefix_cache()
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert fitted == plain
    st = llm.stats()
    assert st["compiles_after_warmup"] == 0 and st["num_free_blocks"] == st["num_total_blocks"]
