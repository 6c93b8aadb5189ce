"""Decode steps compiled with the measured quantized-matmul paths and with graphable ones, the
faster kept (quantization/step_choice.py, `ModelRunner.choose_decode_steps`)."""

from __future__ import annotations

import contextlib

import pytest

from jaxllm import SamplingParams
from jaxllm.kernels import qmatmul
from jaxllm.quantization import choice, step_choice
from jaxllm.quantization import kernels as qkernels

PROMPTS = [[5, 17, 99, 3, 250, 11], list(range(40, 80))]
MOSAIC = "mosaic/mq_64x256s6k4p"
KEY = ("fp8", "fp8", 0, 1, 4096, 1024, 8)  # (kind, act, group, pack, K, N, rows)


@pytest.fixture
def table():
    choice.clear()
    yield
    choice.clear()


def test_alternative_is_the_fastest_graphable_path_of_each_breaking_layout(table):
    other = (*KEY[:-1], 64)  # the same layout at 64 rows: not this bucket's
    choice._MEASURED.update({KEY: MOSAIC, other: MOSAIC, (*KEY[:4], 4096, 4096, 8): "pallas/q_64k4"})
    choice.TIMINGS[KEY] = {MOSAIC: 10e-6, "pallas/q_64k4": 12e-6, "pallas/q_128k1": 11e-6, "xla": 30e-6}
    choice.TIMINGS[other] = {MOSAIC: 10e-6, "xla": 12e-6}
    assert step_choice.alternative(8) == {KEY: "pallas/q_128k1"}
    assert step_choice.alternative(64) == {other: "xla"}
    assert step_choice.alternative(16) == {}  # nothing measured there
    with step_choice.swapped({KEY: "pallas/q_128k1"}):
        assert choice._MEASURED[KEY] == "pallas/q_128k1"
    assert choice._MEASURED[KEY] == MOSAIC


def test_no_alternative_where_a_breaking_layout_has_no_other_path(table):
    choice._MEASURED[KEY] = MOSAIC
    choice.TIMINGS[KEY] = {MOSAIC: 10e-6}  # nothing graphable timed
    assert step_choice.alternative(8) == {}
    nk = ("int4", "bf16", 128, 1, 4096, 1024, 8)  # re-laid out [N, K]: its weights take no other path
    choice._MEASURED.update({KEY: "pallas/q_64k4", nk: "mosaic_nk/n64"})
    choice.TIMINGS[nk] = {"mosaic_nk/n64": 5e-6, "pallas/q_64k4": 9e-6}
    choice.NK_LAYOUTS.add(nk[:-1])
    assert step_choice.alternative(8) == {}
    choice.NK_LAYOUTS.clear()
    assert step_choice.alternative(8) == {nk: "pallas/q_64k4"}


def test_margin_and_switch(monkeypatch):
    assert step_choice.keep_graphable(1.0, 0.97) and not step_choice.keep_graphable(1.0, 0.99)
    assert step_choice.enabled()
    monkeypatch.setenv("JAXLLM_STEP_CHOICE", "yes")
    with pytest.raises(ValueError, match="JAXLLM_STEP_CHOICE"):
        step_choice.enabled()


def _engine(monkeypatch, timings: list[float], spans: list):
    """A tiny int8 engine warmed up as on one GPU, its int8 matmuls at 8 rows measured on a Pallas
    path that stands in for a Mosaic one (`BREAKS_GRAPHS`), XLA's the graphable alternative;
    `timings`: the seconds `_time_executables` reports (measured, graphable)."""
    from hf_tiny import make, make_llm

    from jaxllm.engine.runner import ModelRunner

    picked = []

    def measure(weights, rows, dtype, reps=5):
        for w in map(choice.two_d, weights):
            for M in (r for r in rows if r <= qmatmul.MAX_ROWS):
                t = next((t for t in qmatmul.TILINGS if qmatmul.unsupported((M, w.shape[-2]), w, t) is None), None)
                if t is not None:
                    key = choice.layout_key((M, w.shape[-2]), w)
                    choice._MEASURED[key] = f"pallas/{t.name}"
                    choice.TIMINGS[key] = {f"pallas/{t.name}": 1e-6, "xla": 2e-6}
                    picked.append(key)
        return dict(choice._MEASURED)

    traced, lookups = [], []
    real_qmatmul, real_swapped = qmatmul.qmatmul, step_choice.swapped

    @contextlib.contextmanager
    def swapped(paths):
        n, m = len(traced), len(lookups)
        with real_swapped(paths):
            yield
        spans.append((len(traced) - n, len(lookups) - m))  # (Pallas matmuls, paths read) while swapped

    monkeypatch.setattr(choice, "measure", measure)
    monkeypatch.setattr(step_choice, "BREAKS_GRAPHS", ("pallas/",))
    monkeypatch.setattr(step_choice, "swapped", swapped)
    monkeypatch.setattr(qkernels, "path_for",
                        lambda x_shape, w: lookups.append(1) or choice.measured_path(x_shape, w) or "xla")
    monkeypatch.setattr(qmatmul, "qmatmul", lambda *a, **k: traced.append(1) or real_qmatmul(*a, **k))
    real_time = ModelRunner._time_executables

    def timed(self, pair, exes, steps, rounds):  # the real loop runs (short), its figures replaced
        assert len(real_time(self, pair, exes, 2, 1)) == len(exes) == len(timings)
        timed.exes = exes
        return timings
    monkeypatch.setattr(ModelRunner, "_time_executables", timed)
    _, cfg, sd = make("llama3", seed=3)
    llm = make_llm((cfg, sd), quantization="int8", token_buckets=(8, 64), seq_buckets=(8,), skip_warmup=True)
    r = llm.engine.runner
    r.platform, r._kernels_measured = "gpu", False  # as on one GPU: measured, then the steps chosen
    llm.engine.warmup()
    llm.engine.traces_after_warmup = llm.engine.num_traces()
    assert picked and traced, "the Pallas path stood for the measured one in the first compile"
    r.timed_exes = getattr(timed, "exes", None)  # (measured, graphable) executables, if timed
    return llm, r


@pytest.mark.parametrize("timings,kept", [([1.0, 0.5], "graphable"), ([1.0, 0.99], "measured")])
def test_engine_keeps_the_faster_decode_step(monkeypatch, table, timings, kept):
    from hf_tiny import make, make_llm

    _, cfg, sd = make("llama3", seed=3)
    base = make_llm((cfg, sd), quantization="int8", token_buckets=(8, 64), seq_buckets=(8,))
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, params, use_tqdm=False)]
    spans: list = []
    llm, r = _engine(monkeypatch, timings, spans)
    # Only the decode-only pair (8 tokens, 8 rows) is compiled again: traced anew (the paths read
    # again), with no Pallas matmul in it; (64, 8) is not decode-only.
    assert r.step_choice == {(8, 8): (kept, *timings)}
    assert r._compiled[(8, 8)] is r.timed_exes[1 if kept == "graphable" else 0]
    assert len(spans) == 1 and spans[0][0] == 0 and spans[0][1] > 0
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert llm.stats()["compiles_after_warmup"] == 0


def test_nothing_compiled_again_without_a_breaking_path(monkeypatch, table):
    monkeypatch.setenv("JAXLLM_STEP_CHOICE", "0")
    spans: list = []
    _, r = _engine(monkeypatch, [], spans)
    assert r.step_choice == {} and spans == []
