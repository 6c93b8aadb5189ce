"""Exact verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Each logits row scores one position. A row that checks a draft token d (d >= 0) with
target distribution p (the request's temperature, top-k, top-p, min-p, penalties and
min_tokens applied exactly as the plain sampler does) outputs

    d                                  with probability p(d)   (u < p(d))
    a draw from p with d removed       otherwise (renormalised)

so the token is distributed as p whatever d was: proposals here are deterministic (a
point-mass draft distribution q), for which min(1, p/q) = p(d) and the residual
max(0, p - q) is p without d. Greedy rows output the argmax: d when it equals it,
else the argmax itself, exactly what decoding without drafts would produce. A row
without a draft (d = -1: the bonus position after the last draft, or a row of a
request with no drafts) is a plain draw. The host accepts a request's drafts up to
the first row whose output differs from its draft; that row's output is the token
sampled after the accepted ones.

Randomness: the draw uses the plain sampler's key (seed, step) and the acceptance
test a key folded from it, so seeded requests are reproducible and rows independent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import dataclasses

from jaxllm.engine.sampler import (_NEG_INF, PendingSample, SamplingBatch, SamplingTensors,
                                   _apply_penalties, _draw, _min_p, _top_k_top_p, apply_bitmask, pad_ids)
from jaxllm.engine.sampling_tensors import PackedSampling

_ACCEPT_FOLD = 0x5EC0


def _uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.wrap_key_data(seed, impl="threefry2x32")
    return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, step), _ACCEPT_FOLD))


def verify(logits: jax.Array, t: SamplingTensors | PackedSampling, draft: jax.Array, max_logprobs: int,
           pad_to: int = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [R, V], draft [R] (-1: none) -> (tokens, token logprob, top ids, top logprobs)."""
    t = t.unpack() if isinstance(t, PackedSampling) else t
    num_rows, vocab = logits.shape
    raw = logits.astype(jnp.float32)
    x = raw
    if t.history.shape[1] > 1:  # static, as in the plain sampler
        x = _apply_penalties(x, t)
    sup = jnp.where(t.suppress_ids >= 0, t.suppress_ids, vocab)
    x = x.at[jnp.arange(num_rows)[:, None], sup].set(_NEG_INF, mode="drop")
    if t.bitmask.shape[1]:  # static: a structured-outputs row is in the batch (it has no drafts)
        x = apply_bitmask(x, t.bitmask)
    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
    x = x / t.temperature[:, None]
    needs_sort = jnp.any((t.top_k < vocab) | (t.top_p < 1.0))
    x = jax.lax.cond(needs_sort, _top_k_top_p, lambda y, _k, _p: y, x, t.top_k, t.top_p)
    x = jax.lax.cond(jnp.any(t.min_p > 0.0), _min_p, lambda y, _m: y, x, t.min_p)

    has_draft = draft >= 0
    d = jnp.maximum(draft, 0)
    p_d = jnp.take_along_axis(jax.nn.softmax(x, axis=-1), d[:, None], axis=-1)[:, 0]
    u = jax.vmap(_uniform)(t.seed, t.step)
    accept = has_draft & jnp.where(t.greedy, greedy_tok == d, u < p_d)
    is_d = has_draft[:, None] & (jnp.arange(vocab)[None, :] == d[:, None])
    recovered = jax.vmap(_draw)(t.seed, t.step, jnp.where(is_d, _NEG_INF, x)).astype(jnp.int32)
    tokens = jnp.where(accept, d, jnp.where(t.greedy, greedy_tok, recovered))

    def with_logprobs(raw_, tok):
        lp = jax.nn.log_softmax(raw_, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, max_logprobs)
        return jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def without(raw_, tok):
        return (jnp.zeros((num_rows,), jnp.float32), jnp.zeros((num_rows, max_logprobs), jnp.int32),
                jnp.zeros((num_rows, max_logprobs), jnp.float32))

    tok_lp, top_ids, top_lp = jax.lax.cond(jnp.any(t.num_logprobs >= 0), with_logprobs, without,
                                           raw, tokens)
    return pad_ids(tokens, pad_to), tok_lp, top_ids, top_lp


class RejectionSampler:
    """Jitted `verify`, shaped like `Sampler.launch` so the dispatcher can call either."""

    def __init__(self, vocab_size: int, max_logprobs: int, pad_to: int = 0):
        self._fn = jax.jit(functools.partial(verify, max_logprobs=min(max_logprobs, vocab_size),
                                             pad_to=pad_to))

    def num_compiled_variants(self) -> int:
        return self._fn._cache_size()

    def bind(self, draft_ids) -> "BoundVerify":
        return BoundVerify(self, draft_ids)


class BoundVerify:
    """One step's verification: the draft ids ride along with the sampling batch."""

    def __init__(self, owner: RejectionSampler, draft_ids):
        self.owner, self.draft_ids = owner, draft_ids

    def launch(self, logits: jax.Array, batch: SamplingBatch,
               greedy_ids: jax.Array | None = None) -> PendingSample:
        if batch.greedy_only:  # argmax rows: the host compares with the drafts
            return PendingSample(greedy_ids if greedy_ids is not None
                                 else pad_ids(jnp.argmax(logits, -1).astype(jnp.int32), 0))
        tensors = batch.tensors
        if batch.masked:
            tensors = dataclasses.replace(tensors, bitmask=jax.device_put(batch.bitmask))
        tokens, tok_lp, top_ids, top_lp = self.owner._fn(logits, tensors, self.draft_ids)
        return PendingSample(tokens, (tok_lp, top_ids, top_lp) if batch.want_logprobs else None)
