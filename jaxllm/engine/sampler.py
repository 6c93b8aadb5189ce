"""Batched, jitted next-token sampler with vLLM semantics.

Every step the engine hands over the last-token logits of each scheduled
request as a padded ``[R, V]`` array. All per-request knobs (temperature,
top-k/p, min-p, penalties, seeds, min_tokens) travel as fixed-shape per-row
arrays, so requests with different parameters share one compiled function and
a new batch composition never recompiles. Only two host-chosen variants exist:

* greedy: a bare argmax, used when no row needs anything else (the common
  case for benchmarks and evals, and by far the cheapest);
* full: penalties -> min_tokens suppression -> temperature -> top-k/top-p ->
  min-p -> per-row seeded draw, plus raw top-n logprobs. It is compiled at two
  history widths: ``max_model_len`` when some row has penalties, and 1 when
  none has, so penalty-free sampling never ships ``[R, max_model_len]``
  token histories to the device; and with or without the structured-outputs
  bitmask (``[R, ceil(V/32)]`` packed int32, bit ``i % 32`` of word ``i // 32``
  allows token ``i``; width 0 when no row is constrained), so unconstrained
  steps neither ship nor apply one. All four are compiled at warm-up.

Per-row randomness uses a threefry key built from the row's seed and folded
with its step, so a seeded request's draws depend only on (seed, step), not on
its batch companions or row position.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.sampling_tensors import PackedSampling, SamplingTensors, pack
from jaxllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_MIN_SUPPRESS_WIDTH = 16  # stop/eos ids per row masked by min_tokens; grows by powers of two


@dataclass
class SampleRow:
    """Host-side description of one real row of the logits batch."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # tokens generated so far by this request
    seed: int  # always set: the engine derives one when params.seed is None
    eos_token_id: int | None
    num_pending: int = 0  # tokens sampled in flight (async steps), not yet in output_ids

    @property
    def num_output(self) -> int:
        return len(self.output_ids) + self.num_pending


@dataclass
class SamplingBatch:
    """What ``prepare`` hands to ``sample``: host flags plus device tensors."""

    num_rows: int  # padded R
    num_real: int  # real rows; the rest are padding
    greedy_only: bool  # take the argmax-only variant
    want_logprobs: bool  # some row asked for logprobs
    tensors: PackedSampling | None  # None on the greedy-only path
    masked: bool = False  # some row is constrained: `bitmask` must be set before the launch
    bitmask: np.ndarray | None = None  # host [R, ceil(V/32)] int32, filled while the forward runs


@dataclass
class SamplerOutput:
    """Host numpy results; only the first ``num_real`` rows are meaningful."""

    token_ids: np.ndarray  # [R] int32
    logprobs: np.ndarray | None  # [R] float32 raw log-softmax of the sampled token
    top_ids: np.ndarray | None  # [R, min(max_logprobs, V)] int32, sorted by logprob desc
    top_logprobs: np.ndarray | None  # [R, min(max_logprobs, V)] float32


def _greedy_sample(logits: jax.Array, pad_to: int = 0) -> jax.Array:
    return pad_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32), pad_to)


def pad_ids(ids: jax.Array, size: int) -> jax.Array:
    """[R] ids -> [max(size, R)]: one shape for every bucket, so the next step can read them."""
    return ids if size <= ids.shape[0] else jnp.zeros(size, ids.dtype).at[:ids.shape[0]].set(ids)


def _apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM penalties; token counts come from a scatter-add over the history."""
    num_rows, vocab = logits.shape
    hist = t.history
    valid = hist >= 0
    is_out = valid & (jnp.arange(hist.shape[1])[None, :] >= t.prompt_len[:, None])
    idx = jnp.where(valid, hist, vocab)  # index V is out of range -> dropped
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], hist.shape)
    zeros = jnp.zeros((num_rows, vocab), jnp.int32)
    out_counts = zeros.at[rows, idx].add(is_out.astype(jnp.int32), mode="drop")
    seen = zeros.at[rows, idx].add(valid.astype(jnp.int32), mode="drop") > 0
    rep = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - t.frequency_penalty[:, None] * out_counts.astype(logits.dtype)
    return logits - t.presence_penalty[:, None] * (out_counts > 0).astype(logits.dtype)


def _top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the top-k, then the smallest prefix reaching top_p mass (ties kept)."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    in_k = jnp.arange(vocab)[None, :] < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, _NEG_INF), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive prefix mass
    keep = in_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, _NEG_INF)


def _min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    probs = jax.nn.softmax(logits, axis=-1)
    cutoff = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < cutoff, _NEG_INF, logits)


def _draw(seed: jax.Array, step: jax.Array, logits: jax.Array) -> jax.Array:
    """One row's categorical draw, a pure function of (seed, step, logits)."""
    key = jax.random.wrap_key_data(seed, impl="threefry2x32")
    return jax.random.categorical(jax.random.fold_in(key, step), logits)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where the packed mask's bit is 0 (bit i % 32 of word i // 32: token i allowed)."""
    num_rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, _NEG_INF)


def _full_sample(
    logits: jax.Array, t: SamplingTensors | PackedSampling, max_logprobs: int, pad_to: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    t = t.unpack() if isinstance(t, PackedSampling) else t
    num_rows, vocab = logits.shape
    raw = logits.astype(jnp.float32)
    x = raw
    if t.history.shape[1] > 1:  # static: the penalty-free variant has width 1
        x = _apply_penalties(x, t)
    sup = jnp.where(t.suppress_ids >= 0, t.suppress_ids, vocab)
    x = x.at[jnp.arange(num_rows)[:, None], sup].set(_NEG_INF, mode="drop")
    if t.bitmask.shape[1]:  # static: the structured-outputs variant
        x = apply_bitmask(x, t.bitmask)
    greedy_tok = jnp.argmax(x, axis=-1)

    x = x / t.temperature[:, None]
    needs_sort = jnp.any((t.top_k < vocab) | (t.top_p < 1.0))
    x = jax.lax.cond(needs_sort, _top_k_top_p, lambda y, _k, _p: y, x, t.top_k, t.top_p)
    x = jax.lax.cond(jnp.any(t.min_p > 0.0), _min_p, lambda y, _m: y, x, t.min_p)
    # Every row greedy (a constrained, penalised or logprobs batch at temperature 0): no draw.
    sampled = jax.lax.cond(jnp.any(~t.greedy), lambda y: jax.vmap(_draw)(t.seed, t.step, y),
                           lambda y: jnp.zeros((num_rows,), jnp.int32), x)
    tokens = jnp.where(t.greedy, greedy_tok, sampled).astype(jnp.int32)

    def with_logprobs(raw_: jax.Array, tok: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        lp = jax.nn.log_softmax(raw_, axis=-1)
        tok_lp = jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(lp, max_logprobs)
        return tok_lp, top_ids.astype(jnp.int32), top_lp

    def without(raw_: jax.Array, tok: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (
            jnp.zeros((num_rows,), jnp.float32),
            jnp.zeros((num_rows, max_logprobs), jnp.int32),
            jnp.zeros((num_rows, max_logprobs), jnp.float32),
        )

    tok_lp, top_ids, top_lp = jax.lax.cond(jnp.any(t.num_logprobs >= 0), with_logprobs, without, raw, tokens)
    return pad_ids(tokens, pad_to), tok_lp, top_ids, top_lp


@dataclass
class PendingSample:
    """A dispatched draw: device arrays the host has not waited for yet.

    `token_ids` stays on the device so an overlapped next step can read it
    before the host does; `fetch` is the one device-to-host sync.
    """

    token_ids: jax.Array  # [max(pad_to, R)] int32
    extras: tuple | None = None  # (logprobs, top ids, top logprobs) when some row wants them

    def fetch(self) -> SamplerOutput:
        if self.extras is None:
            return SamplerOutput(np.asarray(self.token_ids), None, None, None)
        return SamplerOutput(*jax.device_get((self.token_ids, *self.extras)))


class Sampler:
    """Turns padded last-token logits into next tokens for a batch of requests."""

    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        max_logprobs: int = 20,
        sharding: jax.sharding.Sharding | None = None,
        pad_to: int = 0,
    ) -> None:
        if max_logprobs < 1:
            raise ValueError(f"max_logprobs must be at least 1, got {max_logprobs}.")
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.mask_words = (vocab_size + 31) // 32  # packed structured-outputs bitmask width
        self._sharding = sharding  # where the per-row tensors live (default device if None)
        # Sampled ids come out [max(pad_to, R)] (see `pad_ids`).
        self._greedy_fn = jax.jit(functools.partial(_greedy_sample, pad_to=pad_to))
        # Top-n output width; a toy vocab smaller than max_logprobs narrows it.
        self._full_fn = jax.jit(functools.partial(
            _full_sample, max_logprobs=min(max_logprobs, vocab_size), pad_to=pad_to))

    def num_compiled_variants(self) -> int:
        """Compiled (function, shape) entries; lets callers assert no recompiles."""
        return sum(fn._cache_size() for fn in (self._greedy_fn, self._full_fn))

    def prepare(self, rows: list[SampleRow], num_rows: int) -> SamplingBatch:
        """Build the per-row arrays on the host and ship them to the device."""
        n = len(rows)
        if n > num_rows:
            raise ValueError(f"{n} rows do not fit in a batch of {num_rows}.")
        vocab = self.vocab_size
        stop_ids = [self._suppressed_ids(r) for r in rows]
        for r in rows:
            if r.params.logprobs is not None and r.params.logprobs > self.max_logprobs:
                raise ValueError(f"logprobs must be at most {self.max_logprobs}, got {r.params.logprobs}.")
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        any_penalty = any(r.params.has_penalties for r in rows)
        greedy_only = not want_logprobs and not any_penalty and not any(stop_ids)
        greedy_only = greedy_only and all(r.params.is_greedy for r in rows)
        masked = any(r.params.structured_outputs is not None for r in rows)
        greedy_only = greedy_only and not masked
        if greedy_only:
            return SamplingBatch(num_rows, n, True, False, None)

        temperature = np.ones(num_rows, np.float32)
        greedy = np.ones(num_rows, bool)
        top_k = np.full(num_rows, vocab, np.int32)
        top_p = np.ones(num_rows, np.float32)
        min_p = np.zeros(num_rows, np.float32)
        penalties = np.zeros((3, num_rows), np.float32)
        penalties[2] = 1.0
        seed = np.zeros((num_rows, 2), np.uint32)
        step = np.zeros(num_rows, np.int32)
        prompt_len = np.zeros(num_rows, np.int32)
        history = np.full((num_rows, self.max_model_len if any_penalty else 1), -1, np.int32)
        width = _MIN_SUPPRESS_WIDTH
        while width < max((len(s) for s in stop_ids), default=0):
            width *= 2  # rare: a new width compiles once more
        suppress = np.full((num_rows, width), -1, np.int32)
        num_logprobs = np.full(num_rows, -1, np.int32)

        for i, r in enumerate(rows):
            p = r.params
            if not p.is_greedy:
                greedy[i] = False
                temperature[i] = p.temperature
                top_k[i] = p.top_k if 0 < p.top_k < vocab else vocab
                top_p[i] = p.top_p
                min_p[i] = p.min_p
            penalties[:, i] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            s = r.seed & 0xFFFF_FFFF_FFFF_FFFF
            seed[i] = (s >> 32, s & 0xFFFF_FFFF)
            step[i] = r.num_output
            prompt_len[i] = len(r.prompt_ids)
            if any_penalty and p.has_penalties:
                if r.num_pending:
                    raise ValueError("penalties need every earlier token: sample after the step in flight")
                total = len(r.prompt_ids) + len(r.output_ids)
                if total > self.max_model_len:
                    raise ValueError(f"row {i} has {total} tokens, more than max_model_len={self.max_model_len}.")
                history[i, : len(r.prompt_ids)] = r.prompt_ids
                history[i, len(r.prompt_ids) : total] = r.output_ids
            suppress[i, : len(stop_ids[i])] = stop_ids[i]
            if p.logprobs is not None:
                num_logprobs[i] = p.logprobs

        host = SamplingTensors(
            temperature, greedy, top_k, top_p, min_p, penalties[0], penalties[1], penalties[2],
            seed, step, prompt_len, history, suppress, num_logprobs, np.zeros((num_rows, 0), np.int32),
        )  # fmt: skip
        tensors = jax.device_put(pack(host), self._sharding)  # 3 transfers, not 15
        return SamplingBatch(num_rows, n, False, want_logprobs, tensors, masked)

    def _suppressed_ids(self, row: SampleRow) -> list[int]:
        """Stop ids (and EOS) to mask while the request is below min_tokens."""
        if row.num_output >= row.params.min_tokens:
            return []
        ids = row.params.all_stop_token_ids(row.eos_token_id)
        return [t for t in ids if 0 <= t < self.vocab_size]

    def sample(self, logits: jax.Array, batch: SamplingBatch,
               greedy_ids: jax.Array | None = None) -> SamplerOutput:
        """Pick one token per row; returns host numpy arrays."""
        return self.launch(logits, batch, greedy_ids).fetch()

    def launch(self, logits: jax.Array, batch: SamplingBatch,
               greedy_ids: jax.Array | None = None) -> PendingSample:
        """Dispatch the draw without waiting for it.

        `greedy_ids` (argmax of `logits`, when the forward pass computed it
        already) serves a greedy-only batch without another dispatch.
        """
        if logits.shape != (batch.num_rows, self.vocab_size):
            raise ValueError(f"logits shape {logits.shape} != ({batch.num_rows}, {self.vocab_size}).")
        if batch.greedy_only:
            return PendingSample(self._greedy_fn(logits) if greedy_ids is None else greedy_ids)
        tensors = batch.tensors
        if batch.masked:
            if batch.bitmask is None or batch.bitmask.shape != (batch.num_rows, self.mask_words):
                raise ValueError(f"a constrained batch needs a [{batch.num_rows}, {self.mask_words}] bitmask")
            tensors = dataclasses.replace(tensors, bitmask=jax.device_put(batch.bitmask, self._sharding))
        tokens, tok_lp, top_ids, top_lp = self._full_fn(logits, tensors)
        return PendingSample(tokens, (tok_lp, top_ids, top_lp) if batch.want_logprobs else None)

    def warmup(self, num_rows: int) -> None:
        """Compile the greedy and the four full variants (history, bitmask) for this row count."""
        from jaxllm.sampling_params import StructuredOutputsParams

        logits = jnp.zeros((num_rows, self.vocab_size), jnp.float32)
        regex = StructuredOutputsParams(regex="a")
        variants = [
            [],  # greedy-only
            [SampleRow(SamplingParams(), [0], [], 0, None)],  # full, no penalties
            [SampleRow(SamplingParams(repetition_penalty=1.1), [0], [], 0, None)],  # full with history
            [SampleRow(SamplingParams(structured_outputs=regex), [0], [], 0, None)],  # + bitmask
            [SampleRow(SamplingParams(repetition_penalty=1.1, structured_outputs=regex), [0], [], 0, None)],
        ]
        for rows in variants:
            batch = self.prepare(rows, num_rows)
            if batch.masked:
                batch.bitmask = np.full((num_rows, self.mask_words), -1, np.int32)
            self.sample(logits, batch)
