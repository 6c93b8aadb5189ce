"""The engine's one hook for speculative decoding.

Per step: `add_rows` gives each request that carries drafts one logits row per draft
position (the positions of its last token and of every draft but the last; its own row
is the bonus position after the last draft), each with the sampling state of that
position (the drafts before it count as output: penalties, min_tokens and the random
key follow). `accepted` reads the rows back into the accepted drafts plus one token.
`propose` sets the next drafts of running requests: of those whose tokens are all known,
and, with a host-side proposer (ngram), of those whose one step in flight verifies
drafts, from their known tokens plus those drafts (the engine then schedules the next step
before reading that one, and the device moves it back over the drafts that step rejects:
spec/shift.py). A draft model or EAGLE head reads its own KV and proposes in sync steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
from typing import TYPE_CHECKING

from jaxllm.runtime.request import Request, RequestStatus
from jaxllm.runtime.scheduler_output import SchedulerOutput
from jaxllm.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from jaxllm.engine.sampler import SampleRow

log = logging.getLogger("jaxllm")


@dataclasses.dataclass
class SpecMetrics:
    """vLLM's counters: drafts verified, draft tokens, accepted tokens, accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def observe(self, ks: np.ndarray, accepted: np.ndarray) -> None:
        """n verified drafts: ks [n] draft tokens each, accepted [n] of them."""
        self.num_drafts += len(ks)
        self.num_draft_tokens += int(ks.sum())
        self.num_accepted_tokens += int(accepted.sum())
        per_pos = np.bincount(accepted, minlength=len(self.accepted_per_pos) + 1)[::-1].cumsum()[::-1]
        for j in range(len(self.accepted_per_pos)):  # drafts that accepted more than j tokens
            self.accepted_per_pos[j] += int(per_pos[j + 1])

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft: 1 (the sampled token) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_mean_acceptance_length": self.mean_acceptance_length}


def row_buckets(seq_buckets: tuple[int, ...], max_num_seqs: int, cfg: SpeculativeConfig,
                explicit: bool) -> tuple[int, ...]:
    """Request buckets that also hold one logits row per draft position of every request.

    Defaults grow by doubling past max_num_seqs (a 32-row decode step with 4 drafts
    each pads its 160 logits rows to 256, not to 4x); explicit buckets must cover it.
    """
    need = max_num_seqs * (cfg.num_speculative_tokens + 1)
    if seq_buckets[-1] >= need:
        return seq_buckets
    if explicit:
        raise ValueError(f"seq_buckets: the largest ({seq_buckets[-1]}) must hold max_num_seqs x "
                         f"(num_speculative_tokens + 1) = {need} logits rows with speculative decoding")
    out, b = list(seq_buckets), seq_buckets[-1]
    while b < need:
        b = min(2 * b, need)
        out.append(b)
    return tuple(out)


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, vocab_size: int, max_logprobs: int, pad_to: int,
                 proposer=None):
        from jaxllm.spec.rejection import RejectionSampler
        self.cfg = cfg
        self.k = cfg.num_speculative_tokens
        self.verifier = RejectionSampler(vocab_size, max_logprobs, pad_to)
        if proposer is None:
            if cfg.method != "ngram":
                raise ValueError(f"speculative_config.method {cfg.method!r} needs a proposer")
            from jaxllm.spec.ngram import NgramProposer
            proposer = NgramProposer(self.k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self.proposer = proposer
        # Steps that verify drafts may overlap the next (a host-side proposer; engine's
        # runner corrects positions on the device, spec/shift.py): set by `build_decoder`.
        self.overlap = False
        self.num_overlapped = 0  # steps scheduled while a step verifying drafts was in flight
        # request id -> (its token count when its drafts were proposed, the tokens they assumed
        # would come before them): drafts in flight still extend the known tokens iff they came
        self._guess: dict[str, tuple[int, list[int]]] = {}
        self.metrics = SpecMetrics(accepted_per_pos=[0] * self.k)
        self.log_interval = 10.0  # seconds between "spec decode:" log lines (vLLM's cadence)
        self._last_log = time.monotonic()

    @property
    def hook(self):
        """What the dispatcher calls after a step's page moves and forward pass
        (`on_kv_ops(out)`, `after_forward(out, hb, prev_ids)`): a proposer with its own KV, or None."""
        return self.proposer if hasattr(self.proposer, "after_forward") else None

    def warmup(self, sampler, seq_buckets: tuple[int, ...], device=None, token_buckets=(),
               max_num_seqs: int = 0) -> None:
        """Compile verification for every request bucket, with and without penalties;
        `device`: where the step's logits live (tensor parallel: committed to a mesh device,
        which jit keys its cache on). A proposer with programs of its own compiles them too."""
        if hasattr(self.proposer, "warmup"):
            self.proposer.warmup(token_buckets, seq_buckets, max_num_seqs)
        import jax
        import jax.numpy as jnp
        from jaxllm.engine.sampler import SampleRow
        from jaxllm.sampling_params import SamplingParams
        for R in seq_buckets:
            logits = jnp.zeros((R, sampler.vocab_size), jnp.float32)
            if device is not None:
                logits = jax.device_put(logits, device)
            for params in (SamplingParams(), SamplingParams(repetition_penalty=1.1)):
                for masked in (False, True):  # with a structured-outputs row in the batch
                    batch = sampler.prepare([SampleRow(params, [0], [], 0, None)], R)
                    if masked:
                        batch.masked = True
                        batch.bitmask = np.full((R, sampler.mask_words), -1, np.int32)
                    self.verifier.bind(np.full(R, -1, np.int32)).launch(logits, batch).fetch()

    def stats(self) -> dict:
        """vLLM's counters, and how many steps overlapped a verification in flight."""
        return {**self.metrics.as_dict(), "spec_decode_overlapped_steps": self.num_overlapped}

    def num_compiled(self) -> int:
        own = self.proposer.num_compiled() if hasattr(self.proposer, "num_compiled") else 0
        return self.verifier.num_compiled_variants() + own

    # -- the step's rows ---------------------------------------------------------
    def add_rows(self, out: SchedulerOutput, qsl: np.ndarray, rows: list) -> tuple[list[int], dict]:
        """Append a SampleRow per draft position to `rows` (in place) and make each request's
        own row the bonus position. Returns (token index of each new row, request id ->
        its rows in draft order, the bonus row last)."""
        indices: list[int] = []
        spec_rows: dict[str, list[int]] = {}
        for i, s in enumerate(out.scheduled):
            k = len(s.spec_token_ids)
            if not k:
                continue
            base = rows[i]
            first = int(qsl[i]) + len(s.token_ids) - 1 - k  # the request's last known token
            mine = []
            for j in range(k):
                mine.append(len(rows))
                rows.append(_drafted(base, s.spec_token_ids, j))
                indices.append(first + j)
            rows[i] = _drafted(base, s.spec_token_ids, k)
            spec_rows[s.request_id] = mine + [i]
        return indices, spec_rows

    def draft_ids(self, out: SchedulerOutput, spec_rows: dict, num_rows: int) -> np.ndarray:
        """[num_rows] the draft each row checks; -1 where it checks none."""
        d = np.full(num_rows, -1, np.int32)
        for s in out.scheduled:
            if s.spec_token_ids:
                d[spec_rows[s.request_id][:-1]] = s.spec_token_ids
        return d

    def accepted(self, out: SchedulerOutput, spec_rows: dict, token_ids: np.ndarray) -> dict[str, list[int]]:
        """Request id -> accepted drafts + the token sampled after them; counts them. One
        gather and compare over all drafted requests ([n, k + 1] rows, padded where a request
        drafted fewer), not numpy calls per request."""
        live = [s for s in out.scheduled if s.request_id in spec_rows]
        if not live:
            return {}
        ks = np.fromiter((len(s.spec_token_ids) for s in live), np.int64, len(live))
        kmax = int(ks.max())
        idx = np.zeros((len(live), kmax + 1), np.int64)
        drafts = np.full((len(live), kmax), -1, np.int64)
        for i, s in enumerate(live):
            r, k = spec_rows[s.request_id], len(s.spec_token_ids)
            idx[i, :k + 1] = r
            idx[i, k + 1:] = r[-1]
            drafts[i, :k] = s.spec_token_ids
        toks = np.asarray(token_ids)[idx]  # [n, kmax + 1]: the drafts' rows, the bonus row
        miss = (toks[:, :kmax] != drafts) | (np.arange(kmax)[None, :] >= ks[:, None])
        acc = np.where(miss.any(1), miss.argmax(1), kmax)  # drafts accepted, <= k
        bonus = toks[np.arange(len(live)), acc]  # the token sampled after them
        res = {}
        for s, a, row, b in zip(live, acc.tolist(), toks.tolist(), bonus.tolist()):
            res[s.request_id] = row[:a] + [b]
        self.metrics.observe(ks, acc)
        if time.monotonic() - self._last_log >= self.log_interval:
            self._last_log = time.monotonic()
            log.info(self.log_line())
        return res

    # -- proposals -----------------------------------------------------------------
    def propose(self, running: list[Request], max_model_len: int, skip=(), inflight=None) -> None:
        """Drafts for every running request whose tokens are all known and computed but the
        last; none for ids in `skip` (structured outputs: the grammar has not seen drafts).

        `inflight`: the step launched but not read (engine.dispatch.Launched). With a host-side
        proposer, a request whose only step in flight samples its next token gets drafts
        too: proposed after its known tokens, plus that step's drafts where they still
        extend them (`_guess`), plus a predicted token for the one that step samples."""
        takes_requests = getattr(self.proposer, "takes_requests", False)
        in_step = {}
        if inflight is not None and self.overlap and not takes_requests:
            in_step = {s.request_id: s for s in inflight.out.scheduled if s.sample}
        ready, ahead = [], []
        for r in running:
            if r.status is not RequestStatus.RUNNING or r.pending_forks or r.request_id in skip:
                continue
            if r.num_pending == 0 and r.num_computed_tokens == r.num_tokens - 1:
                ready.append(r)
            elif (s := in_step.get(r.request_id)) is not None and r.num_pending == 1 + len(s.spec_token_ids):
                ahead.append((r, s.spec_token_ids))
        if not ready and not ahead and not takes_requests:  # (an EAGLE head writes its entries anyway)
            self._guess = {}
            return
        room = [self._room(r, max_model_len) for r in ready]
        if takes_requests:  # a draft model or EAGLE head: it reads its own KV
            drafts = self.proposer.propose(ready, np.array(room, np.int64))
            for r, d in zip(ready, drafts):
                r.spec_token_ids = d
            return
        histories = [r.all_token_ids for r in ready]
        bases = []  # of the requests ahead: (known tokens, what their step in flight is assumed to add)
        for r, flying in ahead:
            known = r.all_token_ids
            was = self._guess.get(r.request_id)
            valid = not flying or (was is not None and known[was[0]:] == was[1])
            bases.append((len(known), list(flying) if valid else []))
            histories.append(known + bases[-1][1])
            room.append(1 + self._room(r, max_model_len))  # + the predicted token in flight
        drafts = self.proposer.propose(histories, np.array(room, np.int64))
        guess = {}
        for r, d in zip(ready, drafts):
            r.spec_token_ids = d
            if d:
                guess[r.request_id] = (r.num_tokens, [])
        for (r, _), (n, assumed), d in zip(ahead, bases, drafts[len(ready):]):
            r.spec_token_ids = d[1:]  # d[0]: the token the step in flight is predicted to sample
            if d[1:]:
                guess[r.request_id] = (n, assumed + d[:1])
        self._guess = guess

    def _room(self, r: Request, max_model_len: int) -> int:
        """Drafts `r` has room for (k, max_tokens, the context), counting its tokens in flight."""
        return max(0, min(self.k, r.stop.max_tokens - len(r.output_token_ids) - r.num_pending - 1,
                          max_model_len - r.num_tokens_scheduled - 1))

    def log_line(self) -> str:
        m = self.metrics
        rate = m.num_accepted_tokens / m.num_draft_tokens if m.num_draft_tokens else 0.0
        per_pos = ", ".join(f"{a / m.num_drafts:.2f}" if m.num_drafts else "0" for a in m.accepted_per_pos)
        return (f"spec decode: mean acceptance length {m.mean_acceptance_length:.2f}, "
                f"accepted {m.num_accepted_tokens}/{m.num_draft_tokens} draft tokens ({rate:.1%}), "
                f"per position [{per_pos}]")


def _drafted(base: SampleRow, drafts: list[int], j: int) -> SampleRow:
    """`base`'s row as if its first j drafts had been sampled: their ids where penalties read
    the history, else only their count (`num_output`: min_tokens, the seed's step), so a row
    never copies a long history (160 rows a step at batch 32, k = 4)."""
    if base.params.has_penalties:
        return dataclasses.replace(base, output_ids=list(base.output_ids) + drafts[:j])
    # type(base): engine.sampler's SampleRow, built directly (replace() costs ~3x as much)
    return type(base)(base.params, base.prompt_ids, base.output_ids, base.seed, base.eos_token_id,
                      base.num_pending + j)
