"""Quantized-matmul paths chosen by measurement (quantization/choice.py): the candidates per
layout, the check that keeps a wrong path out, the lookup `kernels.matmul` makes, and the
runner's warm-up hook (exercised here on the CPU, where the engine itself never measures)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.quantization import choice, kernels
from jaxllm.quantization.quantize import quantize_fp8, quantize_int4, quantize_int8


@pytest.fixture(autouse=True)
def _clean():
    choice.clear()
    yield
    choice.clear()


def _w(kind: str, K: int = 256, N: int = 128, layers: int = 0):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((layers, K, N) if layers else (K, N)) * 0.05).astype(np.float32)
    q = {"int4": lambda: quantize_int4(w, search=False), "int8": lambda: quantize_int8(w),
         "fp8": lambda: quantize_fp8(w, search=1)}[kind]()
    return jax.tree.map(jnp.asarray, q)


def test_candidates_per_layout():
    from jaxllm.kernels import qmatmul

    w4 = _w("int4", K=1024, N=256)
    int4 = choice.candidates((4, 1024), w4)
    fits = [t.name for t in qmatmul.TILINGS if qmatmul.unsupported((4, 1024), w4, t) is None]
    assert int4 == ["xla"] + [f"pallas/{n}" for n in fits] and len(fits) >= 5
    assert "pallas/q_64k8" in int4
    assert "pallas/q_64k8" not in choice.candidates((4, 512), _w("int4", K=512, N=256))  # 4 runs
    assert choice.candidates((4, 1024), w4, ["q_64k1"]) == ["xla"]  # not a shipped tiling
    assert choice.candidates((4, 1024), w4, [fits[1]]) == ["xla", f"pallas/{fits[1]}"]
    int8 = choice.candidates((4, 256), _w("int8"))  # "mgpu": Hopper only
    assert int8[0] == "xla" and len(int8) > 3 and all(p.startswith("pallas/") for p in int8[1:])
    assert choice.candidates((128, 256), _w("int4")) == ["xla"]  # beyond the kernel's rows
    fp8 = choice.candidates((4, 256), _w("fp8"))  # weight-only through the kernel
    assert fp8[0] == "xla" and len(fp8) > 2 and all(p.startswith("pallas/") for p in fp8[1:])


def _reachable(hlo: str, root: str) -> str:
    """The text of HLO computation `root` and every computation it calls, transitively."""
    import re
    comps = {m.group(1): m.group(0) for m in re.finditer(r"^%?([\w.\-]+) \(.*?^}", hlo, re.M | re.S)}
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[name])
    return "\n".join(comps[n] for n in seen)


def test_chained_calls_run_in_the_loop_not_hoisted():
    """Timings of decode-sized matmuls run the path `chain` times in one jitted loop, each call
    depending on the last: the loop's body holds the matmul and the weight's dequantization
    (without the barrier, XLA hoisted the dequantization out of the loop), and x comes back."""
    import re
    from jaxllm.kernels.timing import chained, time_checked

    w = _w("int8")
    x = jnp.ones((4, 256), jnp.float32)
    f = lambda x, w: kernels.matmul(x, w, "xla")
    hlo = jax.jit(chained(f, 7)).lower(x, w).compile().as_text()
    body = re.search(r"while\(.*?body=%?([\w.\-]+)", hlo).group(1)
    inside = _reachable(hlo, body)
    assert " dot(" in inside and " convert(" in inside
    x3, out = jax.jit(chained(f, 3))(x, w)
    np.testing.assert_array_equal(np.asarray(x3), np.asarray(x))
    np.testing.assert_allclose(np.asarray(out), np.asarray(f(x, w)), rtol=1e-6)
    t = time_checked({"xla": f}, (x, w), 2, "quantized matmul", chain=5)
    assert set(t) == {"xla"} and 0 < t["xla"] < 1
    # unrolled: `unroll` dependent calls an iteration (its fixed cost shared), n calls in all
    hlo = jax.jit(chained(f, 8, unroll=4)).lower(x, w).compile().as_text()
    inside = _reachable(hlo, re.search(r"while\(.*?body=%?([\w.\-]+)", hlo).group(1))
    assert inside.count(" dot(") == 4
    x8, out = jax.jit(chained(f, 8, unroll=4))(x, w)
    np.testing.assert_array_equal(np.asarray(x8), np.asarray(x))
    np.testing.assert_allclose(np.asarray(out), np.asarray(f(x, w)), rtol=1e-6)
    t = time_checked({"xla": f}, (x, w), 2, "quantized matmul", chain=6, unroll=4)  # 6 = 4 + 2
    assert set(t) == {"xla"} and 0 < t["xla"] < 1


def test_measure_logs_the_timing_overhead(monkeypatch, caplog):
    """Beside the paths' figures the log gives a trivial call's time, measured the same way
    (loop and dispatch), per row count: what part of every figure is not the kernel."""
    import logging
    from jaxllm.kernels import timing

    assert 0 < timing.loop_floor(jnp.ones((4, 256), jnp.float32), reps=2, chain=3) < 1
    monkeypatch.setattr(choice, "loop_floor", lambda x, reps, unroll=1: 1e-6 * x.shape[0])
    choice.clear()
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        choice.measure([_w("int8")], [1, 4], jnp.float32)
    line = next(r.getMessage() for r in caplog.records if "timing overhead" in r.getMessage())
    assert line.endswith("{1: 1.0, 4: 4.0}")
    choice.clear()


def test_measure_keeps_a_checked_fastest_path_and_matmul_reads_it(monkeypatch):
    stacked = _w("int4", layers=3)  # as the scan layout holds it: one layer's slice is measured
    times = {"xla": 2e-3}
    seen = []

    def fake(x, w, paths, reps=10):  # the real check, fake clocks: the last tiling is fastest
        checked = choice.__dict__["_real_time_paths"](x, w, paths, reps=1, chain=2)
        seen.append((x.shape[0], list(paths)))
        tiled = [p for p in paths if p.startswith("pallas/")]
        return {p: times.get(p, 1.5e-3 if p != tiled[-1] else 1e-3) for p in checked}

    monkeypatch.setitem(choice.__dict__, "_real_time_paths", choice.time_paths)
    monkeypatch.setattr(choice, "time_paths", fake)
    got = choice.measure([stacked, stacked[1]], [1, 4, 512], jnp.float32)
    (m1, all_paths), (m4, few) = seen  # one layout (both leaves), the decode-sized rows only
    assert (m1, m4) == (1, 4) and len(all_paths) >= 3
    assert few == ["xla", all_paths[-1]]  # at 4 rows only the tiling fastest at 1 row
    key1 = choice.layout_key((1, 256), choice.two_d(stacked))
    key4 = choice.layout_key((4, 256), choice.two_d(stacked))
    assert got == {key1: all_paths[-1], key4: all_paths[-1]}
    assert choice.measured_path((2, 2, 256), choice.two_d(stacked)) == all_paths[-1]  # rows = 4
    assert choice.measured_path((512, 256), choice.two_d(stacked)) is None  # prefill-sized: TUNING
    times["xla"] = 1e-4
    choice.clear()
    choice.measure([stacked], [4], jnp.float32)
    assert choice.measured_path((4, 256), choice.two_d(stacked)) == "xla"


def test_a_wrong_path_is_never_chosen(monkeypatch, caplog):
    import logging
    w = _w("int8")
    plain = kernels.matmul
    monkeypatch.setattr(kernels, "matmul", lambda x, w, path=None: plain(x, w, path) * (
        1.5 if path == "pallas/q_128k1" else 1.0))
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        times = choice.time_paths(jnp.ones((4, 256)), w, ["xla", "pallas/q_128k1", "pallas/q_64k4"], reps=1)
    assert set(times) == {"xla", "pallas/q_64k4"}
    assert "pallas/q_128k1" in caplog.text and "wrong result" in caplog.text


def test_fp8_paths_are_checked_against_the_dequantized_weight():
    """fp8 W8A8 ("xla": x rounded to fp8 per token, 2-3% off) and the kernel's weight-only fp8
    both pass the check against x @ the dequantized weight; a wrong one still does not."""
    w = _w("fp8", K=512)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 512)), jnp.float32)
    times = choice.time_paths(x, w, ["xla", "pallas/q_128k1", "pallas/q_64k4"], reps=1)
    assert set(times) == {"xla", "pallas/q_128k1", "pallas/q_64k4"}


def test_matmul_on_gpu_takes_the_measured_path(monkeypatch):
    w = _w("int4")
    choice._MEASURED[choice.layout_key((4, 256), w)] = "pallas/q_32k1u2w2"
    seen = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels.qmatmul, "qmatmul", lambda x, w, t: seen.append(t) or x[..., :w.shape[1]])
    kernels.matmul(jnp.ones((4, 256)), w)
    assert [t.name for t in seen] == ["q_32k1u2w2"]  # the measured path and tiling, not TUNING's "xla"
    kernels.matmul(jnp.ones((8, 256)), w)  # unmeasured rows: TUNING
    assert len(seen) == 1


def test_quantized_leaves_of_an_engine():
    from hf_tiny import make, make_llm

    _, cfg, sd = make("llama3", seed=3)
    llm = make_llm((cfg, sd), quantization="int8", skip_warmup=True)
    r = llm.engine.runner
    leaves = choice.quantized_leaves(r.params, r.layer_params)
    assert len(leaves) == 7 and all(choice.two_d(q).values.ndim == 2 for q in leaves)


def test_kernels_are_measured_once_before_the_pool_sizing(monkeypatch):
    """The engine hands its token buckets to the runner, which measures the kernels (quantized
    matmuls, MoE grouped matmul) before the pool sizing compiles its probe step, so the probe
    holds the kernels the steps will run; the warm-up does not measure again."""
    from hf_tiny import make, make_llm

    from jaxllm.engine.runner import ModelRunner

    calls = []
    measure, size = ModelRunner.measure_kernels, ModelRunner._num_blocks
    monkeypatch.setattr(ModelRunner, "measure_kernels",
                        lambda self, buckets: calls.append(("measure", buckets)) or measure(self, buckets))
    monkeypatch.setattr(ModelRunner, "_num_blocks",
                        lambda self, n: calls.append(("size",)) or size(self, n))
    monkeypatch.setattr(choice, "measure", lambda *a, **k: calls.append(("timed",)) or {})
    _, cfg, sd = make("llama3", seed=3)
    llm = make_llm((cfg, sd), quantization="int8", token_buckets=(16, 64))
    r = llm.engine.runner
    assert calls[:2] == [("measure", (16, 64)), ("size",)]
    assert calls.count(("timed",)) == 0  # the CPU never times (a GPU with one device does)
    assert [c for c in calls if c[0] == "measure"] == [("measure", (16, 64))] * 2  # warm-up's call: a no-op
    r.platform = "gpu"  # as on one GPU: the measurement runs, once
    r._kernels_measured = False
    r.measure_kernels((16, 64))
    r.measure_kernels((16, 64))
    assert calls.count(("timed",)) == 1


def test_time_paths_checks_leading_rows_and_takes_compiler_options(monkeypatch):
    """The prefill-sized timing's reference covers x's first rows only, and its compiles take XLA
    options (here one that is valid and harmless on the CPU)."""
    from jaxllm.kernels import qmatmul

    seen = []
    real = qmatmul.reference
    monkeypatch.setattr(qmatmul, "reference", lambda x, w: seen.append(x.shape) or real(x, w))

    rng = np.random.default_rng(2)
    w = jax.tree.map(jnp.asarray, quantize_fp8(rng.standard_normal((64, 128)).astype(np.float32) * 0.05))
    x = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
    times = choice.time_paths(x, w, ["xla"], reps=1, chain=2, ref_rows=64,
                              compiler_options={"xla_gpu_autotune_level": 0})
    assert set(times) == {"xla"} and times["xla"] > 0
    assert seen == [(64, 64)]


def test_xla_is_taken_only_when_clearly_faster():
    """Timed alone XLA's dot can tie a kernel and still cost more in the step (XLA merges it
    with a sibling dot, concatenating their weights each step): it needs a margin."""
    assert choice.fastest({"xla": 43.3e-6, "pallas/q_64k4": 43.7e-6, "mosaic/mq_64x256s6k4p": 44.2e-6}) == "pallas/q_64k4"
    assert choice.fastest({"xla": 30e-6, "mosaic/mq_64x256s6k4p": 44.2e-6}) == "xla"
    assert choice.fastest({"xla": 30e-6}) == "xla"
    assert choice.fastest({"mosaic/a": 2e-6, "mosaic/b": 1e-6}) == "mosaic/b"


def test_decode_family_restricts_the_candidates(monkeypatch):
    """JAXLLM_DECODE_MATMUL keeps one family's paths (a step-level experiment on the GPU), "xla"
    where the family has none; a bad name is refused naming the variable; a single path left is
    taken without timing (and an int layout it needs re-laid out)."""
    from jaxllm.kernels import prefill_choice

    monkeypatch.setattr(prefill_choice, "is_hopper", lambda: True)
    w4 = _w("int4", K=1024, N=256)
    every = choice.candidates((4, 1024), w4)
    assert any(p.startswith("pallas/") for p in every) and any(p.startswith("mosaic_nk/") for p in every)
    monkeypatch.setenv("JAXLLM_DECODE_MATMUL", "pallas")
    assert choice.candidates((4, 1024), w4) == [p for p in every if p.startswith("pallas/")]
    monkeypatch.setenv("JAXLLM_DECODE_MATMUL", "mgpu")  # int4 has no such path
    assert choice.candidates((4, 1024), w4) == ["xla"]
    monkeypatch.setenv("JAXLLM_DECODE_MATMUL", "mosaic_nk")
    nk = [p for p in every if p.startswith("mosaic_nk/")]
    assert choice.candidates((4, 1024), w4) == nk
    monkeypatch.setattr(choice, "candidates", lambda x_shape, w, best=None: nk[:1])
    monkeypatch.setattr(choice, "time_paths", lambda *a, **k: pytest.fail("one path: nothing to time"))
    monkeypatch.setattr(choice, "measure_gemm", lambda *a, **k: None)
    choice.clear()
    try:
        choice.measure([w4], [4], jnp.float32)
        key = choice.layout_key((4, 1024), w4)
        assert choice._MEASURED[key] == nk[0] and key[:-1] in choice.NK_LAYOUTS
    finally:
        choice.clear()
    monkeypatch.setenv("JAXLLM_DECODE_MATMUL", "fast")
    with pytest.raises(ValueError, match="JAXLLM_DECODE_MATMUL"):
        choice.decode_family()
