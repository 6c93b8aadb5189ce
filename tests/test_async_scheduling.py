"""Overlapped (async) scheduling gives the outputs of synchronous scheduling.

Two engines on one tiny random model, identical but for `async_scheduling`. The
KV pool is small (40 blocks of 16 tokens for 8 sequences of up to ~170 tokens),
so the mixed batches below preempt requests while a step is in flight.
"""

import numpy as np
import pytest

from hf_tiny import make, make_llm, random_prompts

from jaxllm import SamplingParams

KW = dict(num_gpu_blocks_override=40, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny():
    _, cfg, sd = make("llama3", seed=5)
    return cfg, sd


@pytest.fixture(scope="module")
def engines(tiny):
    return make_llm(tiny, async_scheduling=True, **KW), make_llm(tiny, async_scheduling=False, **KW)


def count_placeholders(llm) -> list[int]:
    """Wrap the runner: per step, how many tokens came from the step before on the device."""
    seen, execute = [], llm.engine.runner.execute

    def wrapped(hb, prev_ids=None):
        seen.append(0 if hb.prev_index is None else int((hb.prev_index >= 0).sum()))
        return execute(hb, prev_ids)

    llm.engine.runner.execute = wrapped
    return seen


def mixed_params(vocab: int) -> list[SamplingParams]:
    stops = list(range(1, vocab, 25))[:15]  # with EOS 16 ids, the compiled width; a random model hits one
    return [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stops),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=30, min_tokens=12,
                       stop_token_ids=stops),
        SamplingParams(temperature=0.7, seed=3, max_tokens=25, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=20, repetition_penalty=1.3,
                       ignore_eos=True),  # penalties: the engine reads the step before scheduling
        SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=18, ignore_eos=True),  # a fork
    ]


def summary(outs) -> list:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def test_same_outputs_with_preemption_and_overlap(engines, tiny):
    on, off = engines
    vocab = tiny[0]["vocab_size"]
    prompts = random_prompts(8, vocab, 60, 140, seed=11)
    params = mixed_params(vocab)
    seen = count_placeholders(on)
    p0 = on.stats()["num_preemptions"]
    a = on.generate(prompts, params, use_tqdm=False)
    b = off.generate(prompts, params, use_tqdm=False)
    assert summary(a) == summary(b)
    lp_a = [[next(iter(d.values())).logprob for d in c.logprobs] for c in a[4].outputs]
    lp_b = [[next(iter(d.values())).logprob for d in c.logprobs] for c in b[4].outputs]
    np.testing.assert_allclose(lp_a, lp_b, rtol=1e-5, atol=1e-5)
    assert {c.finish_reason for c in a[1].outputs} == {"stop"}  # the stop ids did fire
    assert len(a[3].outputs[0].token_ids) >= 12  # min_tokens held back the stop ids
    assert on.stats()["num_preemptions"] > p0, "the pool was meant to run dry"
    assert sum(1 for n in seen if n) > 10, f"steps did not overlap: {seen}"
    for llm in engines:
        st = llm.stats()
        assert st["compiles_after_warmup"] == 0
        assert st["num_free_blocks"] == st["num_total_blocks"]


def test_sync_engine_never_feeds_placeholders(engines, tiny):
    _, off = engines
    seen = count_placeholders(off)
    off.generate(random_prompts(3, tiny[0]["vocab_size"], 5, 30, seed=2),
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert seen and not any(seen)


def test_abort_while_in_flight(engines, tiny):
    on, off = engines
    prompts = random_prompts(4, tiny[0]["vocab_size"], 10, 40, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eng = on.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None  # a step of r1's is on the device now
    eng.abort_request("r1")
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    eng.flush()
    assert sorted(done) == ["r0", "r2", "r3"]
    want = off.generate([prompts[i] for i in (0, 2, 3)], sp, use_tqdm=False)
    assert [done[r].outputs[0].token_ids for r in ("r0", "r2", "r3")] == \
        [o.outputs[0].token_ids for o in want]
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
