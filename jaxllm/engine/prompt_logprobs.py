"""Prompt logprobs by a separate forward over the prompt, outside the engine's step.

lm-evaluation-harness scores log-likelihood tasks with `echo=True, logprobs=k`:
it needs log p(prompt[i] | prompt[:i]) for every position, which the engine's
step never computes (it keeps logits of one row per request). Until the engine
grows a native hook, this module runs the engine's own model (same graph, same
weights, same attention backend) over the prompt in fixed-size chunks, writing
K/V into a private one-sequence page array, and reduces each chunk's logits to
(target logprob, rank, top-20) inside the jit so a [chunk, vocab] slab never
leaves the device. One compile (one chunk shape), made on first use.

Must run on the engine thread (`AsyncLLM.call`): it shares the device and the
tokenizer with the step loop.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.outputs import Logprob
from jaxllm.sampling_params import MAX_LOGPROBS

log = logging.getLogger("jaxllm")


class PromptScorer:
    """Computes vLLM-shaped prompt logprobs: [None, {token_id: Logprob}, ...]."""

    def __init__(self, engine) -> None:
        runner = engine.runner
        self.engine = engine
        self.graphdef = runner.graphdef
        self.block_size = runner.block_size
        self.max_blocks = runner.max_blocks
        small = [b for b in engine.token_buckets if b <= 512]
        self.chunk = small[-1] if small else engine.token_buckets[0]
        self.rows = engine.seq_buckets[0]  # a compiled request-count shape, as the kernels expect
        self.top = min(MAX_LOGPROBS, engine.model_cfg.vocab_size)
        L, two, K = runner.kv_pages.shape[:3]
        D = runner.kv_pages.shape[-1]
        self.kv_shape = (L, two, K, self.max_blocks, self.block_size, D)
        self.kv_dtype = runner.kv_pages.dtype
        self.num_compiles = 0
        self._fn = jax.jit(self._impl, donate_argnums=(1,))

    def _impl(self, params, kv, tokens, md: AttentionMetadata, targets):
        self.num_compiles += 1  # runs while tracing only
        params, layers = params if isinstance(params, tuple) else (params, None)
        model = nnx.merge(self.graphdef, params)
        kv, logits, *_ = model(kv, tokens, md, jnp.arange(tokens.shape[0], dtype=jnp.int32), layers)
        lp = jax.nn.log_softmax(logits, axis=-1)
        tgt = jnp.take_along_axis(lp, targets[:, None], axis=1)[:, 0]
        rank = (lp > tgt[:, None]).sum(-1) + 1
        top_lp, top_ids = jax.lax.top_k(lp, self.top)
        return kv, tgt, rank, top_lp, top_ids

    def _metadata(self, start: int, n: int) -> AttentionMetadata:
        C, R = self.chunk, self.rows
        pos = np.full(C, -1, np.int32)
        pos[:n] = np.arange(start, start + n, dtype=np.int32)
        block_tables = np.zeros((R, self.max_blocks), np.int32)
        block_tables[0] = np.arange(self.max_blocks, dtype=np.int32)  # page i holds positions of block i
        seq_lens = np.zeros(R, np.int32)
        seq_lens[0] = start + n
        qsl = np.full(R + 1, n, np.int32)
        qsl[0] = 0
        return AttentionMetadata(pos, np.zeros(C, np.int32), pos.copy(), block_tables, seq_lens, qsl,
                                 np.array([1], np.int32))

    def score(self, token_ids: list[int], k: int) -> list[dict[int, Logprob] | None]:
        """Logprob of each prompt token given the ones before it, plus its top-k alternatives."""
        t0 = time.perf_counter()
        ids = np.asarray(token_ids, np.int32)
        P, C = len(ids), self.chunk
        if P > self.max_blocks * self.block_size:
            raise ValueError(f"prompt of {P} tokens is longer than max_model_len")
        kv = jnp.zeros(self.kv_shape, self.kv_dtype)
        tgt, rank, top_lp, top_ids = [], [], [], []
        for start in range(0, max(P - 1, 0), C):  # the last token predicts nothing in the prompt
            m = min(C, P - 1 - start)  # positions whose next token is in the prompt
            tokens = np.zeros(C, np.int32)
            tokens[:m] = ids[start:start + m]
            targets = np.zeros(C, np.int32)
            targets[:m] = ids[start + 1:start + 1 + m]
            md = jax.device_put(self._metadata(start, m))
            kv, a, b, c, d = self._fn(self.engine.runner.step_params, kv, jnp.asarray(tokens), md,
                                      jnp.asarray(targets))
            a, b, c, d = jax.device_get((a, b, c, d))
            tgt.append(a[:m]), rank.append(b[:m]), top_lp.append(c[:m, :k]), top_ids.append(d[:m, :k])
        out: list[dict[int, Logprob] | None] = [None]
        if P > 1:
            tgt_a, rank_a = np.concatenate(tgt), np.concatenate(rank)
            top_lp_a, top_ids_a = np.concatenate(top_lp), np.concatenate(top_ids)
            for i in range(P - 1):
                tok = int(ids[i + 1])
                entry = {tok: Logprob(float(tgt_a[i]), int(rank_a[i]), self._decode(tok))}
                for r in range(k):
                    tid = int(top_ids_a[i, r])
                    if tid not in entry:
                        entry[tid] = Logprob(float(top_lp_a[i, r]), r + 1, self._decode(tid))
                out.append(entry)
        log.debug("prompt logprobs for %d tokens in %.3fs", P, time.perf_counter() - t0)
        return out

    def _decode(self, token_id: int) -> str | None:
        tok = self.engine.tokenizer
        return None if tok is None else tok.decode([token_id], skip_special_tokens=False)
