"""Prefix caching end to end on a tiny model: hits, stats, unchanged outputs, eviction, salts.

Every output is compared with an engine that has prefix caching off: a cached
block must hold exactly the K/V that recomputing it would produce.
"""

import numpy as np
import pytest

from hf_tiny import make, make_llm

from jaxllm import SamplingParams
from jaxllm.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
S = 16  # block size
POOL = 48  # blocks in the cached engine: two full-length sequences, so eviction happens


@pytest.fixture(scope="module")
def tiny():
    _, cfg, sd = make("llama3", seed=3)
    return cfg, sd


@pytest.fixture(scope="module")
def ref(tiny):
    return make_llm(tiny, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached(tiny):
    return make_llm(tiny, num_gpu_blocks_override=POOL)


def rand(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 384, size=n).tolist()


def run(llm, prompts, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_on_by_default():
    assert EngineConfig().enable_prefix_caching is True


def test_repeated_prompt_and_shared_prefix(ref, cached):
    base = rand(150, 1)
    p1 = base + rand(11, 2)  # 161 tokens: 10 full blocks
    p2 = base[:130] + rand(20, 3)  # shares 8 full blocks with p1
    want = tokens(run(ref, [p1, p2]))
    st0 = cached.stats()
    first = run(cached, [p1])[0]
    assert first.num_cached_tokens == 0 and tokens([first]) == want[:1]
    again = run(cached, [p1])[0]
    assert again.num_cached_tokens == 160 and tokens([again]) == want[:1]
    shared = run(cached, [p2])[0]
    assert shared.num_cached_tokens == 128 and tokens([shared]) == want[1:]
    st = cached.stats()
    assert st["prefix_cache_queries"] - st0["prefix_cache_queries"] == 2 * len(p1) + len(p2)
    assert st["prefix_cache_hits"] - st0["prefix_cache_hits"] == 160 + 128
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert st["compiles_after_warmup"] == 0


@pytest.mark.parametrize("n_blocks", [1, 4])
def test_whole_block_prompt_still_computes_its_last_token(ref, cached, n_blocks):
    p = rand(n_blocks * S, 10 + n_blocks)
    run(cached, [p])
    out = run(cached, [p])[0]
    assert out.num_cached_tokens == (n_blocks - 1) * S  # the last block is recomputed
    assert tokens([out]) == tokens(run(ref, [p]))


def test_batch_sharing_a_prefix_counts_each_lookup_once(ref, cached):
    """Requests that wait several steps for room are looked up once in the stats."""
    system = rand(100, 20)
    prompts = [system + rand(5 + i, 30 + i) for i in range(12)]
    want = tokens(run(ref, prompts))
    st0 = cached.stats()
    outs = run(cached, prompts)
    assert tokens(outs) == want
    st = cached.stats()
    assert st["prefix_cache_queries"] - st0["prefix_cache_queries"] == sum(map(len, prompts))
    hits = st["prefix_cache_hits"] - st0["prefix_cache_hits"]
    assert hits == sum(o.num_cached_tokens for o in outs)
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 8  # the later ones share the system prompt
    assert all(o.num_cached_tokens <= 96 for o in outs)
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_eviction_under_a_small_pool_keeps_outputs(ref, cached):
    old = rand(200, 40)
    run(cached, [old])
    assert run(cached, [old])[0].num_cached_tokens == 192
    # Long distinct prompts (with preemption: 48 blocks hold two at most) push the old one out.
    flood = [rand(300, 50 + i) for i in range(6)]
    outs = run(cached, flood)
    assert tokens(outs) == tokens(run(ref, flood))
    assert cached.stats()["num_preemptions"] > 0
    again = run(cached, [old])[0]
    assert again.num_cached_tokens < 192  # evicted, at least partly (LRU)
    assert tokens([again]) == tokens(run(ref, [old]))
    pool = cached.engine.kv.pool
    assert pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert len(pool.cached) <= pool.num_blocks


def test_cache_salt_isolates(cached):
    p = rand(70, 60)
    eng = cached.engine

    def one(rid, salt):
        eng.add_request(rid, p, GREEDY, cache_salt=salt)
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                done[o.request_id] = o
        return done[rid]

    a = one("salt-a", "alice")
    assert one("salt-b", "bob").num_cached_tokens == 0
    hit = one("salt-a2", "alice")
    assert hit.num_cached_tokens == 64
    assert hit.outputs[0].token_ids == a.outputs[0].token_ids


def test_same_step_admissions_share_blocks_being_written():
    """Blocks are registered when scheduled: a request admitted later in the same step
    hits them (each layer writes the step's K/V before any row attends)."""
    from jaxllm.runtime.kv_cache_manager import KVCacheManager
    from jaxllm.runtime.request import Request, StopRule
    from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(16, 4))
    prompt = list(range(1, 12))
    for rid in ("a", "b"):
        sched.add(Request(rid, prompt, StopRule(max_tokens=2)))
    out = sched.schedule()
    a, b = out.scheduled
    assert (a.start_pos, len(a.token_ids)) == (0, 11)
    assert (b.start_pos, b.token_ids) == (8, prompt[8:]) and b.block_ids[:2] == a.block_ids[:2]
    assert sched.requests["b"].num_cached_tokens == 8
    assert sched.kv.num_free_blocks == 16 - 3 - 1
