"""Speculative decoding (jaxllm/spec): config errors, ngram proposals, exact rejection
sampling (chi-square), and the engine end to end: greedy output identical to decoding
without drafts under chunked prefill, prefix hits, n = 2, stop ids, preemption (recompute
and swap) and the context limit; no leaked blocks, no compiles after warm-up."""

import argparse

import numpy as np
import pytest

from hf_tiny import make, make_llm

from jaxllm import SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.engine.arg_utils import add_engine_args, engine_kwargs
from jaxllm.spec.config import SpeculativeConfig
from jaxllm.spec.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# -- config ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, key", [
    ({"method": "medusa2", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "lookup"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram"}, "num_speculative_tokens"),
])
def test_bad_config_names_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        EngineConfig(speculative_config=bad)


def test_config_defaults_and_flag():
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4}).speculative_config
    assert isinstance(c, SpeculativeConfig) and (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.from_dict({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert EngineConfig(**kw).speculative_config.num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", "[1]"])


# -- ngram ---------------------------------------------------------------------------------
def _ngram_ref(h, n_min, n_max, k):
    for n in range(n_max, n_min - 1, -1):
        if len(h) <= n:
            continue
        suffix = h[-n:]
        for s in range(len(h) - n - 1, -1, -1):  # latest earlier occurrence
            if h[s:s + n] == suffix:
                return h[s + n:s + n + k]
    return []


def test_ngram_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    hist = [rng.integers(0, 4, size=int(rng.integers(1, 60))).tolist() for _ in range(300)]
    for n_min, n_max, k in [(1, 3, 4), (2, 2, 1), (2, 5, 7)]:
        got = NgramProposer(k, n_min, n_max).propose(hist)
        assert got == [_ngram_ref(h, n_min, n_max, k) for h in hist]
        assert any(got) and not all(got)
    caps = rng.integers(0, 4, size=len(hist))  # per-row caps (max_tokens / context)
    got = NgramProposer(4, 1, 3).propose(hist, caps)
    assert got == [_ngram_ref(h, 1, 3, 4)[:c] for h, c in zip(hist, caps)]
    # sparse matches in long rows of a larger vocabulary, rows of one, and a batch of one
    long = [rng.integers(0, 12, size=int(rng.integers(1, 400))).tolist() for _ in range(60)] + [[7]]
    for n_min, n_max, k in [(2, 4, 4), (1, 1, 2), (3, 6, 5)]:
        got = NgramProposer(k, n_min, n_max).propose(long)
        assert got == [_ngram_ref(h, n_min, n_max, k) for h in long]
        assert any(got)
        assert NgramProposer(k, n_min, n_max).propose(long[:1]) == got[:1]


# -- rejection sampling ----------------------------------------------------------------------
def _tensors(n, vocab, temperature, top_k, top_p):
    from jaxllm.engine.sampler import SamplingTensors
    f = lambda v, dt: np.full(n, v, dt)
    seed = np.stack([np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32)], 1)
    return SamplingTensors(f(temperature, np.float32), f(temperature == 0, bool), f(top_k, np.int32),
                           f(top_p, np.float32), f(0.0, np.float32), f(0.0, np.float32), f(0.0, np.float32),
                           f(1.0, np.float32), seed, f(3, np.int32), f(1, np.int32),
                           np.full((n, 1), -1, np.int32), np.full((n, 16), -1, np.int32), f(-1, np.int32),
                           np.zeros((n, 0), np.int32))


_VERIFY = {}  # one compiled verify for both cases


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 8, 1.0), (0.7, 5, 0.9)])
def test_rejection_sampling_is_exact(temperature, top_k, top_p):
    """Tokens from verify(), for drafts drawn from a q far from p, are distributed as p."""
    import jax
    from scipy.stats import chi2
    from jaxllm.spec.rejection import verify

    V, N = 8, 20_000
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1.5, V).astype(np.float32)
    x = logits / temperature
    order = np.argsort(-x)
    keep = np.zeros(V, bool)
    keep[order[:top_k]] = True
    p = np.where(keep, np.exp(x - x.max()), 0)
    p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    keep[order[before >= top_p]] = False
    p = np.where(keep, p, 0)
    p /= p.sum()
    q = np.exp(-logits) / np.exp(-logits).sum()  # the opposite preference
    drafts = rng.choice(V, size=N, p=q).astype(np.int32)
    drafts[: N // 10] = -1  # bonus rows: a plain draw
    fn = _VERIFY.setdefault("fn", jax.jit(lambda lg, t, d: verify(lg, t, d, max_logprobs=4)))
    tokens = np.asarray(fn(np.tile(logits, (N, 1)), _tensors(N, V, temperature, top_k, top_p), drafts)[0])
    counts = np.bincount(tokens, minlength=V)
    assert counts[p == 0].sum() == 0
    exp = p[p > 0] * N
    stat = ((counts[p > 0] - exp) ** 2 / exp).sum()
    assert stat < chi2.ppf(0.999, df=(p > 0).sum() - 1), (stat, counts / N, p)
    # The drafts were accepted often where p and q agree: acceptance is real, not a re-draw.
    accepted = (tokens == drafts)[drafts >= 0].mean()
    assert abs(accepted - (p * q).sum()) < 0.02
    # Greedy rows: the argmax whatever the draft.
    g = np.asarray(fn(np.tile(logits, (64, 1)), _tensors(64, V, 0.0, V, 1.0), drafts[:64])[0])
    assert (g == np.argmax(logits)).all()


# -- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    _, cfg, sd = make("llama3", seed=3)
    return cfg, sd


@pytest.fixture(scope="module")
def prompts(tiny):
    rng = np.random.default_rng(0)
    pat = rng.integers(0, 384, size=20).tolist()
    return [pat * 3, rng.integers(0, 384, size=5).tolist(), (pat[:7] * 10)[:50],
            rng.integers(0, 384, size=150).tolist(), pat * 3 + [7, 8], (pat[:5] * 40)[:190]]


KW = dict(max_num_seqs=4, token_buckets=(16, 64), seq_buckets=(16,), speculative_config=NGRAM)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny, **KW)


def _plain(llm, prompts, params, monkeypatch):
    """The same engine with no proposals: plain decoding on the same compiled steps."""
    with monkeypatch.context() as m:
        m.setattr(llm.engine.spec, "propose", lambda *a: None)
        return llm.generate(prompts, params, use_tqdm=False)


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(llm, prompts):
    mp = pytest.MonkeyPatch()
    try:
        params = [GREEDY] * len(prompts) + [SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)]
        return _ids(_plain(llm, prompts + [prompts[0]], params, mp))
    finally:
        mp.undo()


def test_greedy_identical_with_ngram(llm, prompts, reference):
    st0 = dict(llm.stats())
    params = [GREEDY] * len(prompts) + [SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)]
    outs = llm.generate(prompts + [prompts[0]], params, use_tqdm=False)
    assert _ids(outs) == reference
    st = llm.stats()
    drafts = st["spec_decode_num_draft_tokens"] - st0["spec_decode_num_draft_tokens"]
    accepted = st["spec_decode_num_accepted_tokens"] - st0["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafts  # accepted and rejected drafts both happened
    per_pos = st["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == st["spec_decode_num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert st["prefix_cache_hits"] > st0["prefix_cache_hits"]  # the repeated prompt hit
    assert st["compiles_after_warmup"] == 0
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert st["spec_decode_mean_acceptance_length"] > 1.3


def test_stop_ids_and_context_limit(llm, prompts, reference, monkeypatch):
    # A stop id inside an accepted run of drafts ends the output there, as without drafts.
    stop_at = reference[0][0][5]
    p = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at])
    got = llm.generate([prompts[0]], p, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == reference[0][0][:reference[0][0].index(stop_at) + 1]
    assert got.finish_reason == "stop"
    # Near max_model_len (384): fewer drafts, never past the context.
    long = (prompts[0] * 7)[:376]
    p = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    want = _ids(_plain(llm, [long], p, monkeypatch))
    got = llm.generate([long], p, use_tqdm=False)
    assert _ids(got) == want and len(want[0][0]) == 384 - 376
    assert llm.stats()["compiles_after_warmup"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_identical(tiny, prompts, reference, mode):
    small = make_llm(tiny, **KW, num_gpu_blocks_override=16, preemption_mode=mode, swap_space=0.01,
                     skip_warmup=True)
    params = [GREEDY] * len(prompts) + [SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)]
    outs = small.generate(prompts + [prompts[0]], params, use_tqdm=False)
    assert _ids(outs) == reference
    st = small.stats()
    assert st["num_preemptions"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_sampling_seeded_and_logprobs(llm, prompts, monkeypatch):
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, max_tokens=20, ignore_eos=True,
                             logprobs=2) for i in range(3)]
    params.append(SamplingParams(temperature=1.0, min_p=0.05, seed=9, max_tokens=20, repetition_penalty=1.1,
                                 ignore_eos=True))
    a = llm.generate(prompts[:4], params, use_tqdm=False)
    b = llm.generate(prompts[:4], params, use_tqdm=False)
    assert _ids(a) == _ids(b)  # seeded rows reproduce
    for o in a:
        c = o.outputs[0]
        assert len(c.token_ids) == 20
        if c.logprobs is not None:
            assert len(c.logprobs) == 20 and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    # Greedy logprobs of accepted tokens equal those of plain decoding.
    g = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    want = _plain(llm, prompts[:1], g, monkeypatch)[0].outputs[0]
    got = llm.generate(prompts[:1], g, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose([lp[t].logprob for t, lp in zip(got.token_ids, got.logprobs)],
                               [lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs)], atol=1e-4)
    assert llm.stats()["compiles_after_warmup"] == 0


def test_beam_search_refused(llm):
    from jaxllm.beam_search import BeamSearchParams
    with pytest.raises(ValueError, match="speculative"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=4))


def test_draft_checks_at_start_up(tiny, tmp_path):
    import json
    from jaxllm.models.loader import embedded_model_path
    cfg, _ = tiny

    def folder(name, **over):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **over}))
        return str(d)

    cases = [({"model": str(tmp_path / "nope")}, "speculative_config.model.*not found"),
             ({"model": folder("small_vocab", vocab_size=100)}, "vocabulary .100 tokens. differs"),
             ({"model": embedded_model_path()}, "vocabulary .49152 tokens. differs"),  # GGUF metadata
             ({"method": "eagle", "model": folder("eagle", hidden_size=32)}, "hidden_size 32"),
             ({"model": folder("no_weights")}, "cannot load the draft: no safetensors")]
    for extra, msg in cases:
        spec = {"method": "draft_model", "num_speculative_tokens": 2, **extra}
        with pytest.raises(ValueError, match=msg):
            make_llm(tiny, skip_warmup=True, seq_buckets=(24,), speculative_config=spec)


class _Oracle:
    """Proposes the true greedy continuation (every draft accepted): stops then fire mid-step."""

    def __init__(self, full: list[int], k: int):
        self.full, self.k = full, k

    def propose(self, histories, k=None):
        caps = np.broadcast_to(np.asarray(self.k if k is None else k), (len(histories),))
        return [self.full[len(h):len(h) + int(c)] if list(h) == self.full[:len(h)] else []
                for h, c in zip(histories, caps)]


def test_stop_strings_identical(tiny, prompts, monkeypatch):
    """A stop string completed inside a run of accepted drafts ends the text there, and drops
    the tokens after it, as decoding without drafts does."""
    from jaxllm.models.loader import embedded_model_path
    from jaxllm.models.tokenizer import Tokenizer
    llm = make_llm(tiny, **KW, skip_warmup=True, tokenizer_obj=Tokenizer.from_gguf(embedded_model_path()))
    eng, cut = llm.engine, []
    on_tokens = eng._on_tokens

    def spy(seq, sout, rows, first):  # counts steps whose later accepted tokens a stop dropped
        n = len(seq.req.output_token_ids)
        on_tokens(seq, sout, rows, first)
        cut.append(len(seq.req.output_token_ids) < n)

    monkeypatch.setattr(eng, "_on_tokens", spy)
    for prompt in (prompts[2], prompts[5]):
        full = _plain(llm, [prompt], GREEDY, monkeypatch)[0].outputs[0]
        monkeypatch.setattr(eng.spec, "proposer", _Oracle(prompt + full.token_ids, 3))
        t = full.text  # two-character stops, each where it first occurs, spread over the text
        first = [t[e - 2:e] for e in range(3, len(t) - 3) if t.find(t[e - 2:e]) == e - 2]
        for j, stop in enumerate(first[::max(1, len(first) // 5)]):
            p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                               include_stop_str_in_output=j % 2 == 1)
            want = _plain(llm, [prompt], p, monkeypatch)[0].outputs[0]
            got = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
            assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
                want.text, want.token_ids, "stop", stop)
            assert full.text.startswith(got.text)
    assert any(cut) and eng.spec.metrics.num_accepted_tokens > 0


def test_streamed_through_the_async_engine(llm, prompts, reference):
    """Several tokens per step reach an AsyncLLM stream as one delta each; the concatenated
    deltas are the greedy output, and the metrics come through /metrics' renderer."""
    import asyncio
    from jaxllm.engine.async_engine import AsyncLLM
    from jaxllm.server.metrics import ServerMetrics

    async def run() -> tuple[list[int], int]:
        engine = AsyncLLM(llm.engine)
        try:
            ids, chunks = [], 0
            async for o in engine.generate(prompts[0], GREEDY, delta=True):
                ids += o.outputs[0].token_ids
                chunks += 1
            return ids, chunks
        finally:
            await engine.shutdown()

    ids, chunks = asyncio.run(run())
    assert ids == reference[0][0] and chunks < len(ids)  # some deltas carried accepted drafts
    text = ServerMetrics("m").render(llm.stats()).decode()
    drafted = llm.stats()["spec_decode_num_draft_tokens"]
    assert f'jaxllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(drafted)}' in text
    assert 'jaxllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text
