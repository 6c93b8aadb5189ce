"""Parallel sampling (n > 1) on shared blocks, and beam search against brute force.

n > 1: sequence 0 computes the prompt once; its siblings are forked off it and
share its blocks, the partial last block copied on write. Seeded results must
equal n = 1 requests with seeds seed + i (the siblings' seeds), which also
checks the copy: a wrong page would change the tokens.

Beam search runs on a tiny-vocabulary model (8 tokens) so that it can be
checked against a reference built from full forward passes of the HF model:
vLLM's algorithm step by step, and, with beam_width = vocabulary, exhaustive
enumeration of every two-token continuation.
"""

import itertools

import numpy as np
import pytest

from hf_tiny import make

from jaxllm import LLM, SamplingParams
from jaxllm.beam_search import BeamSearchParams, beam_score

S = 16


@pytest.fixture(scope="module")
def llm():
    _, cfg, sd = make("llama3", seed=3)
    return LLM(hf_config=cfg, weights=sd, dtype="float32", max_model_len=384, max_num_seqs=8,
               max_num_batched_tokens=64, token_buckets=(16, 64), seq_buckets=(8,))


def rand(n: int, seed: int, vocab: int = 384) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def drain(eng) -> dict:
    """Step to completion: finished outputs, peak blocks in use, tokens computed."""
    done, peak, computed = {}, 0, 0
    schedule = eng.scheduler.schedule
    while eng.has_unfinished_requests():
        for o in eng.flush():  # the step in flight first: then `out` is the step's own schedule
            if o.finished:
                done[o.request_id] = o
        if not eng.has_unfinished_requests():
            break
        out = schedule()
        computed += out.num_batched_tokens
        eng.scheduler.schedule = lambda: out  # the step below runs exactly this output
        try:
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        finally:
            del eng.scheduler.schedule
        peak = max(peak, eng.kv.pool.num_blocks - eng.kv.num_free_blocks)
    return {"outs": done, "peak": peak, "computed": computed}


def test_seeded_n4_reproducible_and_equal_to_single_seeds(llm):
    p = rand(37, 1)  # 2 full blocks + a partial one that the 4 siblings share
    sp = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=9, ignore_eos=True)
    cow0 = llm.stats()["num_cow_copies"]
    a = llm.generate([p], sp, use_tqdm=False)[0]
    b = llm.generate([p], sp, use_tqdm=False)[0]
    got = [c.token_ids for c in a.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert got == [c.token_ids for c in b.outputs]
    assert len({tuple(t) for t in got}) == 4
    singles = llm.generate([p] * 4, [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=9,
                                                    ignore_eos=True) for i in range(4)], use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in singles]
    assert llm.stats()["num_cow_copies"] - cow0 >= 2 * 3  # 3 of 4 sharers copy, in each n=4 run
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"] and st["compiles_after_warmup"] == 0


def test_n4_uses_fewer_blocks_than_4_requests(llm):
    eng = llm.engine

    def four_alone(prompt, tag):
        for i in range(4):
            eng.add_request(f"{tag}{i}", prompt, SamplingParams(temperature=1.0, seed=3 + i, max_tokens=3,
                                                                ignore_eos=True))
        return drain(eng)

    p = rand(150, 2)  # 9 full blocks + 6 tokens
    eng.add_request("forked", p, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=3, ignore_eos=True))
    forked = drain(eng)
    assert forked["peak"] == 10 + 3  # the prompt's blocks once, plus 3 copies of the shared partial one
    assert forked["computed"] == 150 + 4 * 2  # the prompt once, then one token per sequence per step
    # 4 independent requests, caching off: each computes and holds its own copy (they
    # overlap only partly: the 64-token budget staggers their prompts).
    eng.kv.enable_prefix_caching = False
    try:
        apart = four_alone(rand(150, 3), "nocache")
    finally:
        eng.kv.enable_prefix_caching = True
    assert apart["peak"] > forked["peak"] and apart["computed"] == 4 * 150 + 4 * 2
    # With prefix caching they share the full blocks (admitted in the same step or not),
    # but each still computes the tail of the prompt.
    cached = four_alone(rand(150, 4), "cache")
    assert forked["peak"] <= cached["peak"] and forked["computed"] < cached["computed"]
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)


def test_n_siblings_finish_and_abort(llm):
    eng = llm.engine
    p = rand(20, 4)
    out = llm.generate([p], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=1), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [1, 1, 1]  # forked and finished in one step
    eng.add_request("ab", p, SamplingParams(n=5, temperature=1.0, max_tokens=50, ignore_eos=True))
    eng.step()  # the prompt: forks
    eng.step()
    assert eng.scheduler.num_running == 5
    eng.abort_request("ab")
    assert not eng.has_unfinished_requests() and not eng.scheduler.requests
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([p], SamplingParams(n=9), use_tqdm=False)


# -- beam search ---------------------------------------------------------------------

V, EOS = 8, 2


@pytest.fixture(scope="module")
def beam_model():
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=EOS)
    model = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for w in model.parameters():  # sharper distributions than the default init
            w.mul_(3.0)
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    llm = LLM(hf_config=cfg.to_dict(), weights=sd, dtype="float32", max_model_len=64, max_num_seqs=8,
              max_num_batched_tokens=64, token_buckets=(16, 64), seq_buckets=(8,))
    return model, llm


def ref_logprobs(model, tokens: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), -1).numpy()


def ref_beam_search(model, prompt, width, max_tokens, ignore_eos=False, length_penalty=1.0):
    """vLLM's beam search with a full forward pass per beam per step."""
    key = lambda b: beam_score(b[0], b[1], {EOS}, length_penalty)
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in beams:
            lp = ref_logprobs(model, toks)
            for t in np.argsort(-lp, kind="stable")[:2 * width]:
                nb = (toks + [int(t)], cum + float(lp[t]))
                (done if t == EOS and not ignore_eos else cands).append(nb)
        beams = sorted(cands, key=key, reverse=True)[:width]
    return sorted(done + beams, key=key, reverse=True)[:width]


@pytest.mark.parametrize("width,max_tokens,penalty", [(1, 5, 1.0), (3, 6, 1.0), (4, 5, 0.5)])
def test_beam_search_matches_reference(beam_model, width, max_tokens, penalty):
    model, llm = beam_model
    prompts = [[1, 3, 4], rand(19, 5, V)]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty))
    for p, out in zip(prompts, outs):
        want = ref_beam_search(model, p, width, max_tokens, length_penalty=penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences], [c for _, c in want],
                                   rtol=1e-4, atol=1e-4)
        for s in out.sequences:
            assert s.tokens[:len(p)] == p and len(s.logprobs) == len(s.tokens) - len(p)
            assert s.cum_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(s.logprobs, s.tokens[len(p):])),
                                                  abs=1e-4)
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"] and st["compiles_after_warmup"] == 0
    assert not llm.engine.scheduler.requests


def test_beam_search_exhaustive(beam_model):
    """beam_width = vocab keeps every first token: the result is the true top 8 of all 64."""
    model, llm = beam_model
    prompt = rand(21, 6, V)  # a partial block, shared by all beams and copied on write
    cow0 = llm.stats()["num_cow_copies"]
    # length_penalty 0: the score is the plain cumulative logprob, EOS or not
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=V, max_tokens=2, ignore_eos=True,
                                                     length_penalty=0.0))[0]
    first = ref_logprobs(model, prompt)
    scored = {(a, b): first[a] + ref_logprobs(model, prompt + [a])[b]
              for a, b in itertools.product(range(V), repeat=2)}
    best = sorted(scored, key=scored.get, reverse=True)[:V]
    assert [tuple(s.tokens[-2:]) for s in out.sequences] == best
    np.testing.assert_allclose([s.cum_logprob for s in out.sequences], [scored[k] for k in best],
                               rtol=1e-4, atol=1e-4)
    assert llm.stats()["num_cow_copies"] > cow0


def test_fork_rows_repad_to_a_compiled_bucket_pair():
    """Sibling rows repeat their leader's last token; the batch grows to a compiled (T, R)."""
    from jaxllm.engine.batch import build_batch
    from jaxllm.engine.batch import with_fork_rows
    from jaxllm.runtime.scheduler import ScheduledRequest, SchedulerOutput

    out = SchedulerOutput([ScheduledRequest("a", [5] * 10, 0, [3], True),
                           ScheduledRequest("b", [6], 20, [1, 2], True)], num_batched_tokens=11)
    tb, sb = (16, 64, 256), (8, 32, 64)
    hb = build_batch(out, tb, sb, 16, 4)
    assert (len(hb.tokens), hb.block_tables.shape[0]) == (16, 8)
    big = with_fork_rows(hb, [0] * 39, tb, sb)  # 2 + 39 rows: R 64, which T=16 was not compiled with
    assert (len(big.tokens), big.block_tables.shape[0]) == (64, 64)
    assert list(big.logits_indices[:2]) == list(hb.logits_indices[:2]) == [9, 10]
    assert set(big.logits_indices[2:41]) == {9} and big.num_rows == 2 and int(big.num_seqs[0]) == 2
    assert (big.slot_mapping[11:] == -1).all() and (big.seq_lens[2:] == 0).all()
    assert (big.query_start_loc[2:] == 11).all()
    small = with_fork_rows(hb, [1, 0], tb, sb)  # fits the batch as it is
    assert small.block_tables.shape[0] == 8 and list(small.logits_indices[:4]) == [9, 10, 10, 9]
