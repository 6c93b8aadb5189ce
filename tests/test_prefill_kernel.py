"""CPU tests of the ragged paged prefill kernel: the portable twin (Pallas interpret mode)
and the Hopper kernel itself (Mosaic GPU interpreter), both against ref.py and textbook
attention, on batches mixing prefill chunks over a cached prefix, decode rows, ragged lengths
that are not multiples of the page size or the block, GQA 1/4/8, shuffled pages, padding
request rows and padding tokens (which must come out exactly 0)."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxllm.kernels import pallas_prefill, prefill_schedule as ps, ref
from test_kernels import dense_outputs, make_batch, rel_err

CASES = [
    # (requests [(context, new tokens)], page size, kv heads, GQA group, block rows)
    ([(37, 37), (20, 1), (5, 1), (50, 9)], 8, 2, 1, 16),    # prefill + decode + chunk
    ([(61, 23), (17, 1), (40, 40), (9, 9)], 4, 2, 4, 16),   # chunks over a cached prefix
    ([(23, 11), (9, 1), (45, 30)], 16, 1, 8, 32),           # GQA 8, page > block tail
]


@pytest.mark.parametrize("reqs,page_size,num_kv_heads,group,rows", CASES)
def test_twin_matches_reference_and_dense(reqs, page_size, num_kv_heads, group, rows):
    rng = np.random.default_rng(hash((page_size, group, rows)) % 2**32)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=num_kv_heads,
                           group=group, pad_tokens=5)
    layer, scale = jnp.int32(1), 0.25
    want = jax.jit(ref.ragged_paged_attention, static_argnames="sm_scale")(
        q, kv, layer, md, sm_scale=scale)
    got = jax.jit(lambda q, kv, layer, md: pallas_prefill.ragged_prefill_attention(
        q, kv, layer, md, sm_scale=scale, block_rows=rows, block_keys=16))(q, kv, layer, md)
    dense = dense_outputs(q, kv, 1, md, reqs, page_size, scale)
    assert np.isfinite(np.asarray(got)).all()  # interpret mode starts outputs as NaN
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, dense) < 1e-5
    n_real = int(md.query_start_loc[len(reqs)])
    assert not np.asarray(got[n_real:]).any()


def test_schedule_covers_every_token_with_full_or_exact_blocks():
    """Every token is owned by a block of its own segment; blocks are full (the last one of a
    long segment shifted back inside it) unless the segment is shorter than bq."""
    qsl = np.array([0, 5, 6, 6, 17, 17], np.int32)  # 5, 1, 0, 11 tokens, 1 padding row
    num_tokens, bq = 22, 4
    pos = np.concatenate([np.arange(10, 15), [3], np.arange(30, 41), -np.ones(5, int)])
    sched = np.asarray(ps.prefill_schedule(jnp.asarray(qsl), jnp.asarray(pos, jnp.int32),
                                           num_tokens, bq))
    seen = np.zeros(num_tokens, int)
    assert (np.diff(sched[ps.KEY_END]) <= 0).all()  # heaviest first
    side = np.asarray(ps.short_segment_rows(jnp.asarray(qsl), num_tokens, bq))
    for req, win, lo, count, pos0, key_end, seg in sched.T:
        if count == 0:
            continue
        if count < bq:  # the one block of a short segment: the rows the wrapper scatters
            np.testing.assert_array_equal(side[seg][lo:lo + count], np.arange(count) + win + lo)
            assert (side[seg][:lo] == num_tokens).all() and (side[seg][lo + count:] == num_tokens).all()
        t0 = win + lo
        assert 0 <= win and win + bq <= num_tokens and (lo == 0 or count < bq)
        seg = np.searchsorted(qsl, t0, side="right") - 1
        end = qsl[seg + 1] if seg < 4 else num_tokens
        start = qsl[seg] if seg < 4 else qsl[5]
        assert start <= t0 and t0 + count <= end
        assert count == bq or count == end - start
        if seg < 4:
            assert req == seg and pos0 + lo == pos[t0] and key_end == pos[t0] + count
        else:
            assert key_end == 0
        seen[t0:t0 + count] += 1
    assert (seen >= 1).all()


def test_twin_bf16_long_chunk_many_key_steps():
    """bf16, one long chunk over a cached prefix (many unmasked steps) plus decode rows."""
    rng = np.random.default_rng(5)
    reqs = [(300, 77), (130, 1), (64, 64)]
    q, kv, md = make_batch(rng, reqs, page_size=16, num_kv_heads=2, group=4, head_dim=32,
                           dtype=jnp.bfloat16)
    got = jax.jit(lambda q, kv, md: pallas_prefill.ragged_prefill_attention(
        q, kv, jnp.int32(0), md, sm_scale=0.2, block_rows=32, block_keys=32))(q, kv, md)
    dense = dense_outputs(q, kv, 0, md, reqs, 16, 0.2)
    assert rel_err(np.asarray(got, np.float32), dense) < 1e-2


@pytest.mark.slow
def test_hopper_kernel_in_mosaic_interpreter():
    """The Mosaic GPU kernel itself (TMA ring, ping-pong barriers, full and partial-block
    epilogues) in Mosaic's CPU interpreter with its race detector; only wgmma's operand
    staging differs from the GPU path. GQA 8 (16 tokens per block): a chunk of 19 tokens
    over a cached prefix (a shifted full last block), a decode row, a 3-token prompt; run
    through `aligned_layout` (interpret mode always relabels)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jaxllm.kernels import mosaic_prefill
    rng = np.random.default_rng(13)
    reqs = [(90, 19), (20, 1), (3, 3)]
    q, kv, md = make_batch(rng, reqs, page_size=16, num_kv_heads=1, group=8, head_dim=64,
                           pad_reqs=1, pad_tokens=2, dtype=jnp.bfloat16)
    got = mosaic_prefill.ragged_prefill_attention(q, kv, jnp.int32(1), md, sm_scale=0.2,
                                                  block_keys=64, num_stages=2, interpret=True)
    got = np.asarray(got, np.float32)
    dense = dense_outputs(q, kv, 1, md, reqs, 16, 0.2)
    assert rel_err(got, dense) < 1e-2
    assert not got[23:].any()
    assert not ipc.get_races().races_found


def test_gpu_prefill_path_falls_back_off_hopper_and_probe_batch_is_valid(caplog, monkeypatch):
    """The engine's prefill/mixed path: off Hopper the probe refuses (and says why) and the
    portable kernel runs; the probe's own batch, through the twin, matches the reference."""
    import logging
    from jaxllm.kernels import gpu_prefill_attention, mosaic_attention, prefill_choice
    monkeypatch.setenv("JAXLLM_PREFILL_KERNEL", "auto")
    monkeypatch.setenv("JAXLLM_MOSAIC_MIN_TOKENS", "0")  # the probe's small batch asks too
    ok, why = prefill_choice.mosaic_prefill_ok(8, 2, 64, 16, "float32")
    assert not ok and "Hopper" in why
    q, kv, md, real = prefill_choice.probe_case(8, 2, 32, 16, jnp.float32)
    want = ref.ragged_paged_attention(q, kv, jnp.int32(0), md, sm_scale=0.2)
    with caplog.at_level(logging.INFO, logger="jaxllm.kernels.prefill_choice"):
        got = jax.jit(lambda q, kv, md: mosaic_attention(
            q, kv, jnp.int32(0), md, sm_scale=0.2, prefill_fn=gpu_prefill_attention))(q, kv, md)
    assert "portable Pallas kernel" in caplog.text and "Hopper" in caplog.text
    monkeypatch.setenv("JAXLLM_PREFILL_KERNEL", "bogus")
    with pytest.raises(ValueError, match="JAXLLM_PREFILL_KERNEL"):
        prefill_choice.prefill_kernel(q, kv)
    assert rel_err(got, want) < 1e-5 and not np.asarray(got[real:]).any()
    twin = pallas_prefill.ragged_prefill_attention(q, kv, jnp.int32(0), md, sm_scale=0.2,
                                                   block_rows=32, block_keys=32)
    assert rel_err(twin, want) < 1e-5


@pytest.mark.parametrize("group,page_size,block_keys", [(4, 16, 128), (1, 32, 64), (8, 64, 128)])
def test_hopper_kernel_lowers_for_cuda_on_cpu(group, page_size, block_keys):
    """Lowering to the Mosaic GPU dialect (TMA shape rules, layouts, barriers) needs no GPU:
    export for the cuda platform. A ragged batch whose T is not a multiple of 8."""
    from jaxllm.kernels import mosaic_prefill
    rng = np.random.default_rng(group)
    q, kv, md = make_batch(rng, [(300, 45), (20, 1), (9, 9)], page_size=page_size,
                           num_kv_heads=2, group=group, head_dim=128, pad_tokens=2,
                           dtype=jnp.bfloat16)
    assert q.shape[0] % 8
    f = jax.jit(lambda q, kv, md: mosaic_prefill.ragged_prefill_attention(
        q, kv, jnp.int32(1), md, sm_scale=0.1, block_keys=block_keys))
    exported = jax.export.export(f, platforms=["cuda"])(q, kv, md)
    # one kernel per call: each Mosaic call site compiles on its own (1.4 s on an H200 host)
    assert exported.mlir_module().count("@mosaic_gpu_v2") == 1


def test_auto_choice_by_measurement(monkeypatch, caplog):
    """"auto" on Hopper: each token bucket from JAXLLM_MOSAIC_MIN_TOKENS up is measured once and
    takes the Mosaic kernel only where it is at least MOSAIC_MIN_SPEEDUP faster; smaller steps
    keep the Pallas kernel unmeasured; a failed measurement falls back to the size rule; a bad
    threshold is refused by name."""
    import logging
    from jaxllm.kernels import prefill_choice
    monkeypatch.setattr(prefill_choice, "mosaic_prefill_ok", lambda *key: (True, "probe ok"))
    monkeypatch.setenv("JAXLLM_PREFILL_KERNEL", "auto")
    monkeypatch.delenv("JAXLLM_MOSAIC_MIN_TOKENS", raising=False)
    # Fake kernels' times per T (ms): Mosaic 1.13x at 2048 (under the margin), 2x at 8192.
    table = {1024: {"pallas": 1.0, "mosaic": 1.0}, 2048: {"pallas": 1.13, "mosaic": 1.0},
             8192: {"pallas": 2.0, "mosaic": 1.0}, 16384: {"mosaic": 1.0}}
    calls = []

    def fake_measure(T, *key):
        calls.append(T)
        if T == 4096:
            raise RuntimeError("no kernel image")
        return table[T]

    monkeypatch.setattr(prefill_choice, "_measure", fake_measure)
    prefill_choice.measured_choice.cache_clear()
    kv = jnp.zeros((1, 2, 2, 4, 16, 64), jnp.bfloat16)
    q = lambda T: jax.ShapeDtypeStruct((T, 8, 64), jnp.bfloat16)
    with caplog.at_level(logging.INFO, logger="jaxllm.kernels.prefill_choice"):
        assert prefill_choice.prefill_kernel(q(512), kv) == "pallas"  # under 1024: not measured
        assert prefill_choice.prefill_kernel(q(1024), kv) == "pallas"
        assert prefill_choice.prefill_kernel(q(2048), kv) == "pallas"
        assert prefill_choice.prefill_kernel(q(8192), kv) == "mosaic"
        assert prefill_choice.prefill_kernel(q(8192), kv) == "mosaic"  # cached: measured once
        assert prefill_choice.prefill_kernel(q(4096), kv) == "mosaic"  # failed: the size rule
        assert prefill_choice.prefill_kernel(q(16384), kv) == "mosaic"  # Pallas gave a wrong result
    assert calls == [1024, 2048, 8192, 4096, 16384]
    assert "2.00x; Mosaic from 1.15x" in caplog.text and "1.13x" in caplog.text
    assert "measurement failed (RuntimeError: no kernel image)" in caplog.text
    prefill_choice.measured_choice.cache_clear()
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # several processes: the size rule
    calls.clear()
    assert prefill_choice.prefill_kernel(q(2048), kv) == "pallas"
    assert prefill_choice.prefill_kernel(q(8192), kv) == "mosaic" and calls == []
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    prefill_choice.measured_choice.cache_clear()
    monkeypatch.setenv("JAXLLM_MOSAIC_MIN_TOKENS", "256")
    table[256] = {"pallas": 3.0, "mosaic": 1.0}
    assert prefill_choice.prefill_kernel(q(256), kv) == "mosaic"
    assert prefill_choice.prefill_kernel(q(255), kv) == "pallas"
    monkeypatch.setenv("JAXLLM_PREFILL_KERNEL", "mosaic")  # forced: every prefill step
    assert prefill_choice.prefill_kernel(q(16), kv) == "mosaic"
    monkeypatch.setenv("JAXLLM_PREFILL_KERNEL", "auto")
    monkeypatch.setenv("JAXLLM_MOSAIC_MIN_TOKENS", "many")
    with pytest.raises(ValueError, match="JAXLLM_MOSAIC_MIN_TOKENS"):
        prefill_choice.prefill_kernel(q(4096), kv)
    prefill_choice.measured_choice.cache_clear()


def test_time_kernels_checks_before_timing(caplog):
    """The measurement's own loop, on CPU kernels: the Pallas twin (interpret mode) is timed
    against the reference on one prompt; a kernel with a wrong answer is never timed."""
    import logging
    from jaxllm.kernels import pallas_ragged, prefill_choice
    q, kv, md = prefill_choice.prompt_case(64, 4, 2, 32, 16, jnp.float32)
    fns = {"reference": lambda q, kv, md: ref.ragged_paged_attention(q, kv, jnp.int32(0), md, sm_scale=0.2),
           "pallas": lambda q, kv, md: pallas_ragged.ragged_paged_attention(
               q, kv, jnp.int32(0), md, sm_scale=0.2, interpret=True),
           "wrong": lambda q, kv, md: ref.ragged_paged_attention(q, kv, jnp.int32(0), md, sm_scale=0.3)}
    with caplog.at_level(logging.WARNING, logger="jaxllm.kernels.prefill_choice"):
        times = prefill_choice.time_kernels(fns, q, kv, md, reps=2)
    assert set(times) == {"reference", "pallas"} and all(t > 0 for t in times.values())
    assert "prefill kernel wrong: wrong result at T=64" in caplog.text


@pytest.mark.parametrize("reqs,page_size,num_kv_heads,group,rows", CASES)
def test_aligned_layout_keeps_results_and_aligns_every_window(reqs, page_size, num_kv_heads,
                                                              group, rows):
    """The Mosaic kernel's TMA copies of q/out need every block window to start at a
    multiple of 8 rows (on the H200 misaligned windows dropped rows). `aligned_layout`
    relabels a ragged batch so that they do: every window of its schedule is aligned, and
    the twin run on the relabeled batch, gathered back, equals the reference."""
    import dataclasses
    from jaxllm.kernels import mosaic_prefill
    rng = np.random.default_rng(len(reqs) * 7 + group)
    q, kv, md = make_batch(rng, reqs, page_size=page_size, num_kv_heads=num_kv_heads,
                           group=group, pad_tokens=5)
    T = q.shape[0]
    qsl, pos, dest, src, padded = mosaic_prefill.aligned_layout(md.query_start_loc, md.positions, T)
    assert not (np.asarray(qsl) % 8).any() and padded % 8 == 0
    bq = 128 // group
    sched = np.asarray(ps.prefill_schedule(qsl, pos, max(padded, bq), bq))
    live = sched[ps.COUNT] > 0
    assert not (sched[ps.T0][live] % 8).any()
    assert (np.asarray(src)[np.asarray(dest)] == np.arange(T)).all()  # src inverts dest
    q_pad = q[src]  # the gather the kernel's wrapper does; gap rows repeat real queries
    md2 = dataclasses.replace(md, query_start_loc=qsl, positions=pos)
    got = pallas_prefill.ragged_prefill_attention(q_pad, kv, jnp.int32(1), md2, sm_scale=0.25,
                                                  block_rows=rows, block_keys=16)[dest]
    want = ref.ragged_paged_attention(q, kv, jnp.int32(1), md, sm_scale=0.25)
    assert rel_err(got, want) < 1e-5
    n_real = int(md.query_start_loc[len(reqs)])
    assert not np.asarray(got[n_real:]).any()


def test_probe_runs_inside_the_steps_trace(monkeypatch):
    """The engine reaches the probe while its step is being traced (on the H200 it failed
    there with `NameError: unbound axis name: b`). It must build and run its own concrete
    batch: here with the portable twin standing in for the Mosaic kernel (CPU), called from
    inside a jit trace; a wrong kernel must still be caught."""
    from jaxllm.kernels import mosaic_prefill, prefill_choice

    def twin(q, kv, layer, md, *, sm_scale, block_keys, interpret):
        return pallas_prefill.ragged_prefill_attention(q, kv, layer, md, sm_scale=sm_scale,
                                                       block_rows=32, block_keys=32)

    monkeypatch.setattr(mosaic_prefill, "ragged_prefill_attention", twin)
    seen = []

    @jax.jit
    def step(x):
        seen.append(prefill_choice.run_probe(8, 2, 32, 16, "float32", interpret=True))
        return x + 1

    step(1.0)
    assert seen[0][0], seen[0]
    monkeypatch.setattr(mosaic_prefill, "ragged_prefill_attention",
                        lambda q, *a, **k: twin(q, *a, **k) * 1.1)
    ok, why = prefill_choice.run_probe(8, 2, 32, 16, "float32", interpret=True)
    assert not ok and "mismatch" in why
