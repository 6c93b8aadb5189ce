"""Speculative steps overlapped with the next (async scheduling, jaxllm/spec/shift.py).

The device-side correction against a host computation of the same acceptance; then the
engine end to end: greedy output identical to plain decoding while steps verifying drafts
overlap the next one (ngram, an oracle proposer whose drafts are all accepted, random drafts
that are all rejected), with preemption and prefix hits; no leaked blocks, no compiles after
warm-up; sampled requests' verification steps stay synchronous."""

import numpy as np
import pytest

from hf_tiny import make, make_llm

from jaxllm import SamplingParams
from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.spec import shift

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
KW = dict(max_num_seqs=4, token_buckets=(16, 64), seq_buckets=(16,), speculative_config=NGRAM)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_correct_moves_rows_back_over_rejected_drafts():
    import jax.numpy as jnp
    K, bs = 3, 4
    prev_ids = np.arange(100, 132, dtype=np.int32)  # step N's sampled id at row r: 100 + r
    # Row 0 verified drafts [105, 77, 107] at rows 5, 6, 7 (its own row, the bonus, 2): accepts 1.
    # Row 1 did not verify drafts in step N. Row 2 verified [109, 110] at rows 9, 10 (own 3): all.
    # Row 3 verified [77] at row 11 (own 4): none accepted.
    entry = np.full((5, shift.width(K)), -1, np.int32)
    entry[0, :4], entry[0, 4:7] = [5, 6, 7, 2], [105, 77, 107]
    entry[2, :3], entry[2, 4:6] = [9, 10, 3], [109, 110]
    entry[3, :2], entry[3, 4] = [11, 4], 77
    # This step: row 0 [bonus, 50, 51] at positions 20..22 (as if all 3 accepted), row 1 [60, 61]
    # at 7, 8, row 2 [bonus, 52] at 12, 13, row 3 [bonus] at 30; two padding tokens.
    token_req = np.array([0, 0, 0, 1, 1, 2, 2, 3, 0, 0], np.int32)
    positions = np.array([20, 21, 22, 7, 8, 12, 13, 30, -1, -1], np.int32)
    tokens = np.array([0, 50, 51, 60, 61, 0, 52, 0, 0, 0], np.int32)
    prev_index = np.array([shift.BONUS, -1, -1, -1, -1, shift.BONUS, -1, shift.BONUS, -1, -1], np.int32)
    tables = np.arange(5 * 9, dtype=np.int32).reshape(5, 9)[:, ::-1].copy()  # distinct pages
    slots = np.where(positions >= 0, tables[token_req, positions // bs] * bs + positions % bs, -1)
    seq_lens = np.array([23, 9, 14, 31, 0], np.int32)
    md = AttentionMetadata(*map(jnp.asarray, (positions, token_req, slots, tables, seq_lens,
                                               np.array([0, 3, 5, 7, 8, 8], np.int32), np.array([4], np.int32))))
    got_tokens, got = shift.correct(jnp.asarray(tokens), md, jnp.asarray(entry), jnp.asarray(prev_index),
                                    jnp.asarray(prev_ids), bs)

    back = np.array([2, 0, 0, 1])  # rejected drafts per row: 3 - 1, none, 2 - 2, 1 - 0
    want_pos = np.where(positions >= 0, positions - back[token_req], -1)
    np.testing.assert_array_equal(got.positions, want_pos)
    want_slots = np.where(want_pos >= 0, tables[token_req, np.maximum(want_pos, 0) // bs] * bs
                          + np.maximum(want_pos, 0) % bs, -1)
    np.testing.assert_array_equal(got.slot_mapping, want_slots)
    np.testing.assert_array_equal(got.seq_lens, [21, 9, 14, 30, 0])
    # the placeholder takes the id sampled after the accepted drafts: rows 6, 3 and 11
    np.testing.assert_array_equal(got_tokens, [106, 50, 51, 60, 61, 103, 52, 111, 0, 0])
    np.testing.assert_array_equal(got.block_tables, tables)


@pytest.fixture(scope="module")
def tiny():
    _, cfg, sd = make("llama3", seed=3)
    return cfg, sd


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    pat = rng.integers(0, 384, size=20).tolist()
    return [pat * 3, rng.integers(0, 384, size=5).tolist(), (pat[:7] * 10)[:50],
            rng.integers(0, 384, size=150).tolist(), pat * 3 + [7, 8]]


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny, **KW)


def _plain(llm, prompts, params, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(llm.engine.spec, "propose", lambda *a: None)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _delta(llm, before: dict) -> dict:
    return {k: v - before[k] for k, v in llm.stats().items() if isinstance(v, int) and k in before}


class _Oracle:
    """Proposes the true greedy continuation of each history that is a prefix of it."""

    def __init__(self, full: dict, k: int):
        self.full, self.k = full, k

    def propose(self, histories, k=None):
        caps = np.broadcast_to(np.asarray(self.k if k is None else k), (len(histories),))
        out = []
        for h, c in zip(histories, caps):
            f = next((f for f in self.full if f[:len(h)] == list(h)), None)
            out.append(f[len(h):len(h) + int(c)] if f is not None else [])
        return out


class _Random:
    """Drafts of random ids (acceptance ~0): every verification moves the next step back."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def propose(self, histories, k=None):
        caps = np.broadcast_to(np.asarray(3 if k is None else k), (len(histories),))
        return [self.rng.integers(0, 384, int(c)).tolist() for c in caps]


@pytest.mark.parametrize("proposer", ["ngram", "oracle", "random"])
def test_overlapped_greedy_identical(llm, prompts, monkeypatch, proposer):
    eng = llm.engine
    assert eng.async_scheduling and eng.spec.overlap
    want = _plain(llm, prompts, GREEDY, monkeypatch)
    if proposer == "oracle":
        monkeypatch.setattr(eng.spec, "proposer", _Oracle([p + w for p, w in zip(prompts, want)], 3))
    elif proposer == "random":
        monkeypatch.setattr(eng.spec, "proposer", _Random())
    st0 = dict(llm.stats())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    d, st = _delta(llm, st0), llm.stats()
    assert d["spec_decode_overlapped_steps"] > 0
    assert st["compiles_after_warmup"] == 0 and st["num_free_blocks"] == st["num_total_blocks"]
    drafts, accepted = d["spec_decode_num_draft_tokens"], d["spec_decode_num_accepted_tokens"]
    if proposer == "oracle":  # drafts built on the step in flight's drafts stay right
        assert accepted >= 0.9 * drafts > 0
    elif proposer == "random":
        assert drafts > 0 and accepted <= 0.1 * drafts
    else:
        assert 0 < accepted < drafts


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_overlapped_with_preemption_and_prefix_hits(tiny, prompts, monkeypatch, mode):
    small = make_llm(tiny, **KW, num_gpu_blocks_override=16, preemption_mode=mode, swap_space=0.01,
                     skip_warmup=True)
    batch = prompts + [prompts[0]]  # the repeat hits the prefix cache
    want = _plain(small, batch, GREEDY, monkeypatch)
    got = [o.outputs[0].token_ids for o in small.generate(batch, GREEDY, use_tqdm=False)]
    assert got == want
    st = small.stats()
    assert st["num_preemptions"] > 0 and st["spec_decode_overlapped_steps"] > 0
    assert st["prefix_cache_hits"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_sampled_requests_verify_synchronously(llm, prompts, monkeypatch):
    """A step verifying drafts of a sampled request is read before the next is scheduled
    (its counts in flight would otherwise feed the next draw's random stream); greedy
    requests beside it still get drafts, and seeded outputs reproduce."""
    eng = llm.engine
    seen = []
    overlaps = eng._overlaps

    def spy(prev):
        ok = overlaps(prev)
        sampled = [rid for rid in prev.spec_rows if rid in eng.seqs and not eng.seqs[rid].params.is_greedy]
        seen.append((bool(sampled), ok))
        return ok

    monkeypatch.setattr(eng, "_overlaps", spy)
    params = [SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True), GREEDY, GREEDY]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
    assert a == b
    assert any(s for s, _ in seen) and not any(ok for s, ok in seen if s)
    assert any(ok for s, ok in seen if not s)
    assert llm.stats()["compiles_after_warmup"] == 0
