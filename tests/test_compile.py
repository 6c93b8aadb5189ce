"""Start-up compilation: which (tokens, rows) shapes are compiled, that every batch lands on one,
the thread-pool compile with its executables kept per shape, and the persistent cache switch."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import make, make_llm

from jaxllm import SamplingParams
from jaxllm.config import default_buckets, default_token_buckets
from jaxllm.engine import compile as compile_mod
from jaxllm.engine.batch import (ROWS_PADDED_ABOVE, HostBatch, compiled_pairs, pick_bucket,
                                 row_buckets_for, with_logit_rows)


def _pairs(budget: int, max_seqs: int):
    seqs = default_buckets(max_seqs, 8)
    toks = default_token_buckets(budget, seqs)
    return toks, seqs, compiled_pairs(toks, seqs)


def test_large_token_buckets_compile_one_row_bucket():
    toks, seqs, pairs = _pairs(16384, 256)  # the GPU offline defaults
    everything = [(T, R) for T in toks for R in seqs if R <= pick_bucket(seqs, min(T, seqs[-1]))]
    assert len(everything) == 39 and len(pairs) == 24
    for T in toks:
        rows = [R for t, R in pairs if t == T]
        if T >= ROWS_PADDED_ABOVE * seqs[-1]:
            assert rows == [seqs[-1]]
        else:
            assert rows == [R for R in seqs if R <= pick_bucket(seqs, min(T, seqs[-1]))]
    assert len(_pairs(2048, 256)[2]) == 21  # serve defaults


@pytest.mark.parametrize("budget,max_seqs", [(16384, 256), (2048, 64), (512, 8), (1024, 32)])
def test_every_batch_shape_is_compiled(budget, max_seqs):
    toks, seqs, pairs = _pairs(budget, max_seqs)
    pairs = set(pairs)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n_tok = int(rng.integers(1, budget + 1))
        n_rows = int(rng.integers(1, min(n_tok, max_seqs) + 1))
        T = pick_bucket(toks, n_tok)
        R = pick_bucket(row_buckets_for(T, seqs), n_rows)
        assert (T, R) in pairs, (n_tok, n_rows, T, R)
        extra = int(rng.integers(0, max_seqs - n_rows + 1))  # n > 1 siblings / draft rows
        hb = HostBatch(np.zeros(T, np.int32), np.full(T, -1, np.int32), np.zeros(T, np.int32),
                       np.full(T, -1, np.int32), np.zeros((R, 4), np.int32), np.zeros(R, np.int32),
                       np.zeros(R + 1, np.int32), np.array([n_rows], np.int32), np.zeros(R, np.int32),
                       n_rows)
        grown = with_logit_rows(hb, [0] * extra, toks, seqs)
        shape = (len(grown.tokens), grown.block_tables.shape[0])
        assert shape in pairs and shape[1] >= n_rows + extra, (T, R, extra, shape)


def test_padded_rows_keep_outputs_and_compile_nothing_after_warmup(caplog):
    tiny = make("llama3", seed=5)[1:]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, tiny[0]["vocab_size"], size=n).tolist() for n in (150, 3, 40, 90)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # seq buckets (2, 8), token buckets up to 64: T = 32 and 64 compile rows 8 only.
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        padded = make_llm(tiny, token_buckets=(8, 16, 32, 64), seq_buckets=(2, 8))
    assert "compiled 6 step shapes" in caplog.text  # (8,2) (8,8) (16,2) (16,8) (32,8) (64,8)
    assert sorted(padded.engine.runner._compiled) == compiled_pairs((8, 16, 32, 64), (2, 8))
    small = make_llm(tiny, max_num_batched_tokens=16, token_buckets=(8, 16), seq_buckets=(2, 8))
    for one in ([prompts[0]], prompts):  # one long prompt alone (1 row, padded to 8), then mixed
        a = padded.generate(one, greedy, use_tqdm=False)
        b = small.generate(one, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert padded.stats()["compiles_after_warmup"] == 0
    assert small.stats()["compiles_after_warmup"] == 0


def test_compile_all_runs_compiles_on_threads(caplog):
    f = jax.jit(lambda x, y: (x @ y).sum(0))
    lower = lambda T, R: f.lower(jnp.zeros((T, R)), jnp.zeros((R, 4)))
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        out = compile_mod.compile_all(lower, [(8, 2), (16, 2), (16, 4)], threads=2)
    assert sorted(out) == [(8, 2), (16, 2), (16, 4)]
    np.testing.assert_allclose(out[(16, 4)](jnp.ones((16, 4)), jnp.ones((4, 4))), np.full(4, 64.0))
    assert "compiled 3 step shapes" in caplog.text and "on 2 threads" in caplog.text


def test_persistent_cache_only_on_accelerators(monkeypatch, tmp_path):
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JAXLLM_CACHE_ROOT", str(tmp_path))
    assert compile_mod.enable_persistent_cache("cpu") is None
    assert jax.config.jax_compilation_cache_dir == before
    monkeypatch.setenv("JAXLLM_CACHE_ROOT", "")
    assert compile_mod.enable_persistent_cache("gpu") is None  # "" turns it off
    monkeypatch.setenv("JAXLLM_CACHE_ROOT", str(tmp_path))
    try:
        if before:  # the user's own choice wins
            assert compile_mod.enable_persistent_cache("gpu") == before
        else:
            assert compile_mod.enable_persistent_cache("gpu") == str(tmp_path / "xla")
            assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
            assert (tmp_path / "xla").is_dir()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
