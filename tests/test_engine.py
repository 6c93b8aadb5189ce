"""End-to-end engine behaviour on a tiny model: batching, chunking, preemption, compiles, errors."""

import numpy as np
import pytest

from hf_tiny import make, make_llm

from jaxllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    _, cfg, sd = make("llama3", seed=3)
    return cfg, sd


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny)


@pytest.fixture(scope="module")
def prompts(tiny):
    lens = np.linspace(1, 300, 24).astype(int)
    rng = np.random.default_rng(7)
    return [rng.integers(0, tiny[0]["vocab_size"], size=n).tolist() for n in lens]


@pytest.fixture(scope="module")
def alone(llm, prompts):
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_batch_invariance_with_chunked_prefill(llm, prompts, alone):
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert all(len(t) == 12 for t in alone)
    assert llm.stats()["compiles_after_warmup"] == 0


def test_preemption_keeps_outputs_and_frees_blocks(tiny, prompts, alone):
    # 40 blocks of 16 tokens: far fewer than 24 prompts of up to 312 tokens need together.
    small = make_llm(tiny, num_gpu_blocks_override=40)
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    st = small.stats()
    assert st["num_preemptions"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"] == 40
    assert st["compiles_after_warmup"] == 0


def test_mixed_workload_no_compiles(llm, prompts):
    before = llm.stats()["num_compiles"]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=5 + i % 7) for i in range(6)]
    params += [SamplingParams(temperature=0, max_tokens=9, logprobs=3, repetition_penalty=1.2),
               SamplingParams(temperature=1.0, top_k=5, min_tokens=3, max_tokens=6, presence_penalty=0.5)]
    outs = llm.generate(prompts[:8], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs[:6]] == [5 + i % 7 for i in range(6)]
    assert len(outs[6].outputs[0].logprobs) == 9
    assert llm.stats()["num_compiles"] == before
    assert llm.stats()["compiles_after_warmup"] == 0


def test_outputs_fields(llm, prompts):
    out = llm.generate({"prompt_token_ids": prompts[3]}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompts[3] and out.finished
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_stop_token_ids_and_max_tokens(llm, prompts, alone):
    stop_tok = alone[5][4]
    out = llm.generate([prompts[5]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    first = alone[5].index(stop_tok)
    assert out.token_ids == alone[5][:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_bad_input(llm, prompts, alone):
    with pytest.raises(ValueError, match="384"):
        llm.generate([[1] * 400], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="vocab"):
        llm.generate([[10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    # A bad request in the batch fails the call and leaves nothing queued behind.
    with pytest.raises(ValueError, match="400"):
        llm.generate([prompts[0], [1] * 400], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # The engine API refuses the bad request alone; the good ones still run.
    eng = llm.engine
    eng.add_request("good", prompts[2], GREEDY)
    with pytest.raises(ValueError):
        eng.add_request("bad", [1] * 400, GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert done["good"].outputs[0].token_ids == alone[2]


def test_missing_model_path():
    with pytest.raises((FileNotFoundError, ValueError), match="nope"):
        LLM("/nonexistent/nope")


def test_abort_frees_blocks(llm, prompts):
    eng = llm.engine
    eng.add_request("a", prompts[10], GREEDY)
    eng.add_request("b", prompts[11], GREEDY)
    eng.step()
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_seeded_sampling_independent_of_companions(llm, prompts):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompts[4]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)] * 5
    outs = llm.generate(prompts[:5] + [prompts[4]], others[:4] + [p, p], use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone == outs[5].outputs[0].token_ids
    # Unseeded requests in one call differ from each other (not a constant stream).
    free = llm.generate([prompts[4]] * 2, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    assert free[0].outputs[0].token_ids != free[1].outputs[0].token_ids


def test_n_parallel_samples(llm, prompts):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    a = llm.generate([prompts[6]], p, use_tqdm=False)[0]
    b = llm.generate([prompts[6]], p, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_packed_batch_unpacks_to_the_host_batch():
    """The step's two packed input arrays give back every field of the host batch, and a
    placeholder token (async scheduling) reads the previous step's id of its request."""
    from jaxllm.engine.batch import build_batch
    from jaxllm.engine.device_batch import Batch
    from jaxllm.runtime.scheduler_output import PLACEHOLDER, ScheduledRequest, SchedulerOutput

    rows = [ScheduledRequest("a", token_ids=[5, 6, 7], start_pos=0, block_ids=[3], sample=True),
            ScheduledRequest("b", token_ids=[PLACEHOLDER], start_pos=20, block_ids=[1, 4], sample=True),
            ScheduledRequest("c", token_ids=[9], start_pos=4, block_ids=[2], sample=True)]
    out = SchedulerOutput(scheduled=rows, num_batched_tokens=5)
    hb = build_batch(out, (8,), (4,), block_size=16, max_blocks=3, prev_rows={"b": 2, "z": 0})
    b = Batch.from_host(hb)
    prev_ids = np.array([30, 31, 32, 33], np.int32)
    np.testing.assert_array_equal(b.tokens(prev_ids), [5, 6, 7, 32, 9, 0, 0, 0])
    np.testing.assert_array_equal(hb.prev_index, [-1, -1, -1, 2, -1, -1, -1, -1])
    np.testing.assert_array_equal(b.logits_indices, hb.logits_indices)
    for name in ("positions", "token_req", "slot_mapping", "block_tables", "seq_lens",
                 "query_start_loc", "num_seqs"):
        np.testing.assert_array_equal(getattr(b.md, name), getattr(hb, name), err_msg=name)


def test_generate_asks_for_final_outputs_only(llm, prompts, alone, monkeypatch):
    """LLM.generate reads only final outputs, so (as vLLM's LLM) it asks for FINAL_ONLY and the
    engine builds one RequestOutput per request, not one per request per step; the caller's
    SamplingParams is left as it was, and the outputs are the cumulative ones' finals. A request
    added with the default kind gets an output at every step; DELTA is refused naming the field."""
    import jaxllm.engine.step_io as le  # where the step builds its outputs
    from jaxllm.sampling_params import RequestOutputKind

    built: list[str] = []
    real = le.make_output
    monkeypatch.setattr(le, "make_output", lambda parent, fin: built.append(parent.request_id) or real(parent, fin))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # as GREEDY, a new object
    outs = llm.generate(prompts[:3], sp, use_tqdm=False)
    assert sp.output_kind is RequestOutputKind.CUMULATIVE
    assert sorted(built) == sorted(o.request_id for o in outs)  # one each, at the end
    assert [o.outputs[0].token_ids for o in outs] == alone[:3]
    built.clear()
    eng = llm.engine
    eng.add_request("cumulative", prompts[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert built.count("cumulative") == 5
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
