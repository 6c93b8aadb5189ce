"""Speculative decoding with a draft model (jaxllm/spec/draft_model.py): the tiny target
drafting for itself accepts every draft; a random draft of the same shape accepts almost
none; greedy output is identical to decoding without drafts either way, over short and
long prompts, prefix hits, n = 2 and preemption (recompute and swap) with a small pool;
no leaked blocks, no compiles after warm-up."""

import numpy as np
import pytest

from hf_tiny import make, make_llm

from jaxllm import SamplingParams

K = 3
KW = dict(max_num_seqs=4, token_buckets=(16, 64), seq_buckets=(16,))
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PAIR = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    model, cfg, sd = make("llama3", seed=3)
    return model, cfg, sd


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    """The target itself and a random model of the same shape, as HF folders (safetensors)."""
    root = tmp_path_factory.mktemp("drafts")
    target[0].save_pretrained(root / "self")
    make("llama3", seed=11)[0].save_pretrained(root / "random")
    return {"self": str(root / "self"), "random": str(root / "random")}


def _spec(path):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def llm(target, folders):
    return make_llm(target[1:], **KW, speculative_config=_spec(folders["self"]))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    pat = rng.integers(0, 384, size=20).tolist()
    return [pat * 3, rng.integers(0, 384, size=5).tolist(), rng.integers(0, 384, size=150).tolist(),
            rng.integers(0, 384, size=9).tolist(), (pat[:5] * 40)[:190]]


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _run(llm, prompts):
    """Greedy over the prompts, then the first prompt again (a prefix hit) with n = 2."""
    return _ids(llm.generate(prompts + [prompts[0]], [GREEDY] * len(prompts) + [PAIR], use_tqdm=False))


@pytest.fixture(scope="module")
def reference(llm, prompts):
    mp = pytest.MonkeyPatch()
    try:  # the same engine without proposals: plain decoding
        mp.setattr(llm.engine.spec, "propose", lambda *a: None)
        return _run(llm, prompts)
    finally:
        mp.undo()


def _delta(llm, before):
    st = llm.stats()
    return {k: st[k] - before[k] for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                                           "prefix_cache_hits")}, st


def test_self_draft_accepts_every_draft(llm, prompts, reference):
    st0 = dict(llm.stats())
    assert _run(llm, prompts) == reference
    d, st = _delta(llm, st0)
    assert d["spec_decode_num_draft_tokens"] > 100
    assert d["spec_decode_num_accepted_tokens"] == d["spec_decode_num_draft_tokens"]
    assert d["prefix_cache_hits"] > 0
    assert st["compiles_after_warmup"] == 0
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_random_draft_identical(llm, prompts, reference, target, folders):
    """A random draft of the same shape, swapped in without recompiling: near-zero acceptance."""
    from jaxllm.spec.build import build_decoder
    eng = llm.engine
    own = eng.spec.proposer
    spec = eng.cfg.speculative_config.__class__.from_dict(_spec(folders["random"]))
    other = build_decoder(eng, spec, None, 0).proposer
    try:
        own.flat = other.flat
        st0 = dict(llm.stats())
        assert _run(llm, prompts) == reference
        d, st = _delta(llm, st0)
        assert d["spec_decode_num_draft_tokens"] > 300
        assert d["spec_decode_num_accepted_tokens"] < 0.05 * d["spec_decode_num_draft_tokens"]
        assert st["compiles_after_warmup"] == 0 and st["num_free_blocks"] == st["num_total_blocks"]
    finally:
        own.flat = build_decoder(eng, eng.cfg.speculative_config, None, 0).proposer.flat


def test_sampling_seeded(llm, prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(3)]
    a = _ids(llm.generate(prompts[:3], params, use_tqdm=False))
    assert a == _ids(llm.generate(prompts[:3], params, use_tqdm=False))
    assert llm.stats()["compiles_after_warmup"] == 0


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_preemption_small_pool(target, folders, prompts, reference, mode):
    small = make_llm(target[1:], **KW, num_gpu_blocks_override=16, preemption_mode=mode, swap_space=0.01,
                     skip_warmup=True, speculative_config=_spec(folders["self"]))
    assert _run(small, prompts) == reference
    st = small.stats()
    assert st["num_preemptions"] > 0
    # The draft's pages follow recompute and swap: every draft is still the target's own guess.
    assert 0 < st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
    assert st["num_free_blocks"] == st["num_total_blocks"]


@pytest.mark.slow
def test_smollm2_drafts_for_itself():
    """The embedded SmolLM2 (real weights, GGUF) as its own draft: every draft accepted,
    greedy output identical to decoding without drafts."""
    from jaxllm import LLM
    from jaxllm.models.loader import embedded_model_path
    llm = LLM(dtype="float32", max_model_len=256, max_num_seqs=2, token_buckets=(16, 64), seq_buckets=(16,),
              speculative_config={"method": "draft_model", "model": embedded_model_path(),
                                  "num_speculative_tokens": 4})
    prompts = ["The capital of France is", "Here is a short story about a robot who learns to paint:"]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = _ids(llm.generate(prompts, p, use_tqdm=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm.engine.spec, "propose", lambda *a: None)
        want = _ids(llm.generate(prompts, p, use_tqdm=False))
    assert got == want
    st = llm.stats()
    assert st["spec_decode_num_draft_tokens"] > 40
    assert st["spec_decode_num_accepted_tokens"] >= 0.98 * st["spec_decode_num_draft_tokens"]
    assert st["compiles_after_warmup"] == 0 and st["num_free_blocks"] == st["num_total_blocks"]
