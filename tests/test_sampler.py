"""Sampler: greedy/argmax, seeded determinism, exact distributions, penalties,
min_tokens, logprobs, and no recompiles after warmup."""

from __future__ import annotations

import dataclasses
import jax
import numpy as np
import pytest
import scipy.stats  # a dependency of jax itself

from jaxllm.engine.sampler import Sampler, SampleRow, _apply_penalties
from jaxllm.sampling_params import SamplingParams

V = 32
MAX_LEN = 48
EOS = 3
BIG = 256  # the second row bucket the tests use


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    s = Sampler(V, MAX_LEN, max_logprobs=5)
    s.warmup(4)
    return s


def _logits(rng: np.random.Generator, rows: int, vocab: int = V) -> jax.Array:
    return jax.device_put(rng.normal(size=(rows, vocab)).astype(np.float32) * 2.0)


def _row(params: SamplingParams, seed: int = 0, out: list[int] | None = None, prompt: list[int] | None = None) -> SampleRow:
    return SampleRow(params, prompt if prompt is not None else [1, 2], out or [], seed, EOS)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_greedy_is_argmax(sampler: Sampler) -> None:
    rng = np.random.default_rng(0)
    logits = _logits(rng, 4)
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(3)]
    batch = sampler.prepare(rows, 4)
    assert batch.greedy_only
    out = sampler.sample(logits, batch)
    np.testing.assert_array_equal(out.token_ids[:3], np.asarray(logits).argmax(-1)[:3])
    assert out.logprobs is None and out.top_ids is None
    # Greedy rows inside a sampled batch (full path) are still the argmax.
    rows = [_row(SamplingParams(temperature=0.0)), _row(SamplingParams(temperature=1.0)), _row(SamplingParams(temperature=0.0))]
    batch = sampler.prepare(rows, 4)
    assert not batch.greedy_only
    out = sampler.sample(logits, batch)
    ref = np.asarray(logits).argmax(-1)
    assert out.token_ids[0] == ref[0] and out.token_ids[2] == ref[2]


def test_top_k_one_equals_greedy(sampler: Sampler) -> None:
    rng = np.random.default_rng(1)
    for trial in range(10):
        logits = _logits(rng, 4)
        rows = [_row(SamplingParams(temperature=1.5, top_k=1), seed=trial * 4 + i) for i in range(4)]
        out = sampler.sample(logits, sampler.prepare(rows, 4))
        np.testing.assert_array_equal(out.token_ids, np.asarray(logits).argmax(-1))


def test_seeded_row_independent_of_companions_and_position(sampler: Sampler) -> None:
    rng = np.random.default_rng(2)
    target = SamplingParams(temperature=1.0, seed=1234)
    row_logits = rng.normal(size=(V,)).astype(np.float32)
    layouts = [
        (4, 0, [_row(SamplingParams(temperature=0.5), 7), _row(SamplingParams(temperature=0.0))]),
        (4, 3, [_row(SamplingParams(top_p=0.5, repetition_penalty=1.3), 9), _row(SamplingParams(top_k=2, logprobs=3), 11),
                _row(SamplingParams(min_tokens=4), 13)]),
        (BIG, 200, [_row(SamplingParams(temperature=2.0), s) for s in range(BIG - 1)]),
    ]  # fmt: skip
    sequences = []
    for num_rows, pos, companions in layouts:
        seq = []
        for step in range(20):
            logits = rng.normal(size=(num_rows, V)).astype(np.float32)
            logits[pos] = row_logits
            rows = list(companions)
            rows.insert(pos, _row(target, seed=1234, out=[0] * step))
            seq.append(int(sampler.sample(jax.device_put(logits), sampler.prepare(rows, num_rows)).token_ids[pos]))
        sequences.append(seq)
    assert sequences[0] == sequences[1] == sequences[2]
    assert len(set(sequences[0])) > 1  # the draws really vary with the step


def _ref_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Independent numpy port of vLLM's temperature/top-k/top-p/min-p pipeline."""
    x = logits.astype(np.float64) / p.temperature
    if 0 < p.top_k < x.size:
        kth = np.sort(x)[::-1][p.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    order = np.argsort(x, kind="stable")  # ascending, as vLLM does
    probs_sorted = np.exp(_log_softmax(x[order]))
    remove = np.cumsum(probs_sorted) <= 1.0 - p.top_p
    remove[-1] = False
    x[order[remove]] = -np.inf
    probs = np.exp(_log_softmax(x))
    x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    return np.exp(_log_softmax(x))


def test_empirical_distribution_matches_exact(sampler: Sampler) -> None:
    # The 8 real logits sit in a V=32 row whose other entries are -inf (as a
    # padded vocabulary would be), so the shared sampler's compile is reused.
    vocab, per_config, steps = 8, 64, 320  # 20480 draws per config
    base = np.array([2.0, 1.5, 1.2, 1.0, 0.1, -1.0, 0.5, -0.3], np.float32)
    configs = [
        SamplingParams(temperature=0.7, top_p=0.8, min_p=0.2, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.75),
        SamplingParams(temperature=0.9, min_p=0.3),
        SamplingParams(temperature=1.0, top_k=5),
    ]
    num_rows = BIG
    padded = np.full((num_rows, V), -np.inf, np.float32)
    padded[:, :vocab] = base
    logits = jax.device_put(padded)
    counts = np.zeros((len(configs), V))
    for step in range(steps):
        rows = [SampleRow(c, [], [0] * step, 1000 * j + i, None) for j, c in enumerate(configs) for i in range(per_config)]
        toks = sampler.sample(logits, sampler.prepare(rows, num_rows)).token_ids
        for j in range(len(configs)):
            counts[j] += np.bincount(toks[j * per_config : (j + 1) * per_config], minlength=V)
    assert counts[:, vocab:].sum() == 0
    counts = counts[:, :vocab]
    n = per_config * steps
    for j, c in enumerate(configs):
        expected = _ref_probs(base, c)
        live = expected > 0
        assert live.sum() >= 2, "config should leave a real choice"
        assert counts[j][~live].sum() == 0, f"config {j} sampled a filtered-out token"
        assert np.abs(counts[j] / n - expected).max() < 0.01
        chi2 = (((counts[j] - n * expected) ** 2)[live] / (n * expected[live])).sum()
        assert scipy.stats.chi2.sf(chi2, live.sum() - 1) > 1e-3, f"config {j}: chi2={chi2}"


def _ref_penalties(x: np.ndarray, prompt: list[int], out: list[int], p: SamplingParams) -> np.ndarray:
    x = x.astype(np.float64).copy()
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(np.asarray(out, np.int64), minlength=x.size) if out else np.zeros(x.size)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_match_vllm_formula(sampler: Sampler) -> None:
    rng = np.random.default_rng(3)
    cases = [
        (SamplingParams(repetition_penalty=1.7), [4, 5, 5, 9], [9, 10, 10]),
        (SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4), [1, 2, 2], [2, 7, 7, 7, 8]),
        (SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.9), list(range(0, 30, 2)),
         [31, 31, 0, 5, 5, 5]),
        (SamplingParams(), [3, 4], [6]),  # penalty-free row in a penalised batch is untouched
    ]  # fmt: skip
    rows = [_row(p, seed=i, out=o, prompt=pr) for i, (p, pr, o) in enumerate(cases)]
    batch = sampler.prepare(rows, 4)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    got = np.asarray(jax.jit(_apply_penalties)(jax.device_put(logits), batch.tensors.unpack()))
    for i, (p, pr, o) in enumerate(cases):
        np.testing.assert_allclose(got[i], _ref_penalties(logits[i], pr, o, p), rtol=1e-6, atol=1e-6)
    # End to end: a strong frequency penalty moves the greedy choice off a repeated token.
    logits = np.zeros((4, V), np.float32)
    logits[:, 6] = 1.0
    logits[:, 7] = 0.9
    rows = [_row(SamplingParams(temperature=0.0, frequency_penalty=0.5), out=[6]), _row(SamplingParams(temperature=0.0))]
    toks = sampler.sample(jax.device_put(logits), sampler.prepare(rows, 4)).token_ids
    assert toks[0] == 7 and toks[1] == 6


def test_min_tokens_suppresses_eos_and_stop_ids(sampler: Sampler) -> None:
    logits = np.zeros((4, V), np.float32)
    logits[:, EOS] = 50.0
    logits[:, 20] = 40.0
    logits[:, 21] = 30.0
    logits = jax.device_put(logits)
    greedy = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[20])
    rows = [_row(greedy, out=[0]), _row(greedy, out=[0, 0, 0]),
            _row(SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True), out=[0]),
            _row(SamplingParams(temperature=1.0, min_tokens=5), seed=5, out=[1])]  # fmt: skip
    toks = sampler.sample(logits, sampler.prepare(rows, 4)).token_ids
    assert toks.tolist() == [21, EOS, EOS, 20]
    # Sampled rows below min_tokens never emit EOS even when it dominates.
    for step in range(1, 30):
        rows = [_row(SamplingParams(min_tokens=40, max_tokens=None), seed=s, out=[0] * step) for s in range(4)]
        assert EOS not in sampler.sample(logits, sampler.prepare(rows, 4)).token_ids.tolist()


def test_logprobs_are_raw_log_softmax(sampler: Sampler) -> None:
    rng = np.random.default_rng(4)
    logits = _logits(rng, 4)
    rows = [_row(SamplingParams(temperature=0.6, top_k=4, repetition_penalty=1.5, logprobs=5), seed=1),
            _row(SamplingParams(temperature=0.0, logprobs=0)), _row(SamplingParams(temperature=1.0), seed=2)]  # fmt: skip
    out = sampler.sample(logits, sampler.prepare(rows, 4))
    ref = _log_softmax(np.asarray(logits))
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    for i in range(3):
        np.testing.assert_allclose(out.logprobs[i], ref[i, out.token_ids[i]], atol=1e-5)
        np.testing.assert_array_equal(out.top_ids[i], np.argsort(-ref[i], kind="stable")[:5])
        np.testing.assert_allclose(out.top_logprobs[i], np.sort(ref[i])[::-1][:5], atol=1e-5)
    assert out.token_ids[1] == np.asarray(logits)[1].argmax()


def test_no_recompiles_after_warmup(sampler: Sampler) -> None:
    compiles: list[str] = []

    def listener(event: str, duration: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    rng = np.random.default_rng(5)
    before = sampler.num_compiled_variants()
    batches = [
        [],
        [_row(SamplingParams(temperature=0.0))] * 4,
        [_row(SamplingParams(temperature=0.8, top_p=0.9, seed=3), seed=3), _row(SamplingParams(temperature=0.0))],
        [_row(SamplingParams(top_k=5, min_p=0.1, logprobs=2), seed=1, out=[1, 2]), _row(SamplingParams(min_tokens=9), seed=2)],
        [_row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.2), seed=4, out=[5] * 40)],
        [_row(SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=1)), _row(SamplingParams(), seed=7)],
        [_row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=list(range(10))))] * 3,
    ]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for rows in batches * 2:
            out = sampler.sample(_logits(rng, 4), sampler.prepare(rows, 4))
            assert out.token_ids.shape == (4,)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert sampler.num_compiled_variants() == before


def test_prepare_rejects_bad_batches(sampler: Sampler) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        sampler.prepare([_row(SamplingParams())] * 5, 4)
    with pytest.raises(ValueError, match="logprobs"):
        sampler.prepare([_row(SamplingParams(logprobs=6))], 4)
    with pytest.raises(ValueError, match="max_model_len"):
        sampler.prepare([_row(SamplingParams(repetition_penalty=1.1), out=[0] * MAX_LEN)], 4)
    with pytest.raises(ValueError, match="logits shape"):
        sampler.sample(jax.device_put(np.zeros((8, V), np.float32)), sampler.prepare([], 4))


def test_packed_sampling_round_trips_every_field():
    """The three-array transfer form unpacks (inside jit) to exactly the fifteen fields packed."""
    from jaxllm.engine.sampling_tensors import PackedSampling, SamplingTensors, pack
    rng = np.random.default_rng(3)
    R, H, S, W = 5, 7, 16, 4
    host = SamplingTensors(
        rng.random(R, dtype=np.float32), rng.random(R) < 0.5, rng.integers(1, 99, R, dtype=np.int32),
        rng.random(R, dtype=np.float32), rng.random(R, dtype=np.float32), rng.random(R, dtype=np.float32),
        rng.random(R, dtype=np.float32), rng.random(R, dtype=np.float32) + 1,
        rng.integers(0, 2**32, (R, 2), dtype=np.uint32), rng.integers(0, 50, R, dtype=np.int32),
        rng.integers(0, 9, R, dtype=np.int32), rng.integers(-1, 99, (R, H), dtype=np.int32),
        rng.integers(-1, 99, (R, S), dtype=np.int32), rng.integers(-1, 20, R, dtype=np.int32),
        rng.integers(-2**31, 2**31, (R, W), dtype=np.int32))
    packed = jax.device_put(pack(host))
    assert isinstance(packed, PackedSampling) and len(jax.tree_util.tree_leaves(packed)) == 3
    got = jax.jit(lambda p: p.unpack())(packed)
    for f in dataclasses.fields(SamplingTensors):
        want, have = getattr(host, f.name), np.asarray(getattr(got, f.name))
        assert have.dtype == np.asarray(want).dtype and np.array_equal(have, want), f.name
