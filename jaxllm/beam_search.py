"""Beam search on the engine's block sharing, with vLLM's `LLM.beam_search` semantics.

vLLM runs each beam step as a fresh batch of one-token requests and leans on
the prefix cache, recomputing every beam's partly filled last block each step.
Here a beam is a live request: it computes its newest token, samples with
`2 * beam_width` logprobs and is *parked* by the scheduler (blocks kept). Once
every beam of a prompt has reported, the best `beam_width` extensions are
forked off their parents (`Scheduler.fork`: shared blocks by reference count,
copy-on-write of the last partial block when siblings diverge) and the parents
are finished. Each step thus computes one token per beam.

Selection follows vLLM: candidates are each beam's top-2w tokens (plus the
sampled one); a candidate ending in EOS (unless `ignore_eos`) is set aside as
completed, the rest are ranked by `cum_logprob / len(tokens) ** length_penalty`
(tokens including the prompt, one less for a final EOS) and the top w live on.
After `max_tokens` steps the completed and live beams are ranked together.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from jaxllm.engine.sampler import SampleRow
from jaxllm.outputs import Logprob
from jaxllm.runtime.request import Request, RequestStatus, StopRule
from jaxllm.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """One finished beam; `tokens` include the prompt, as in vLLM."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids, length_penalty: float) -> float:
    """vLLM's ranking: length-normalised cumulative logprob, a final EOS not counted."""
    n = len(tokens) - (1 if tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (n ** length_penalty)


@dataclass
class _Beam:
    tokens: list[int]  # prompt + generated
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    req: Request | None = None  # the live request computing this beam's last token
    finish_reason: str | None = None


@dataclass
class _Prompt:
    prompt_ids: list[int]
    max_steps: int
    beams: list[_Beam] = field(default_factory=list)
    completed: list[_Beam] = field(default_factory=list)
    reports: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    steps: int = 0
    done: bool = False


class BeamSearch:
    """Runs beam search for a list of prompts on an `LLMEngine` (which calls back here)."""

    def __init__(self, engine, params: BeamSearchParams):
        w = params.beam_width
        if getattr(engine, "spec", None) is not None:
            raise ValueError("beam search is not supported with speculative decoding "
                             "(speculative_config is set on this engine)")
        if 2 * w > engine.sampler.max_logprobs:
            raise ValueError(f"beam_width {w} needs {2 * w} logprobs, more than the sampler's "
                             f"{engine.sampler.max_logprobs}")
        if w > engine.cfg.max_num_seqs:
            raise ValueError(f"beam_width {w} > max_num_seqs {engine.cfg.max_num_seqs}")
        self.engine = engine
        self.params = params
        self.sampling = SamplingParams(temperature=params.temperature, logprobs=2 * w, max_tokens=1)
        self.eos = set(engine.eos_ids)
        self.owner: dict[str, _Prompt] = {}
        self._ids = itertools.count()

    # -- engine callbacks ----------------------------------------------------------
    def sample_row(self, request_id: str) -> SampleRow:
        req = self.engine.scheduler.requests[request_id]
        return SampleRow(self.sampling, req.prompt_token_ids, req.output_token_ids, req.data,
                         self.engine.eos_ids[0] if self.engine.eos_ids else None)

    def on_step(self, out, sout, row_of: dict[str, int]) -> None:
        """Record the candidates of beams that sampled; advance prompts whose beams all did."""
        ready = []
        k = min(2 * self.params.beam_width, sout.top_ids.shape[1])
        for s in out.scheduled:
            p = self.owner.get(s.request_id)
            if not s.sample or p is None or s.request_id in p.reports:
                continue
            r = row_of[s.request_id]
            cands = {}
            for rank, (t, lp) in enumerate(zip(sout.top_ids[r][:k], sout.top_logprobs[r][:k]), 1):
                cands[int(t)] = Logprob(float(lp), rank, self._decode([int(t)]))
            tok = int(sout.token_ids[r])
            if tok not in cands:
                lp = float(sout.logprobs[r])
                cands[tok] = Logprob(lp, int((sout.top_logprobs[r] > lp).sum()) + 1, self._decode([tok]))
            p.reports[s.request_id] = cands
            if len(p.reports) == len(p.beams):
                ready.append(p)
        for p in ready:
            self._advance(p)

    # -- the search ----------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str | None:
        tok = self.engine.tokenizer
        return None if tok is None else tok.decode(ids, skip_special_tokens=False)

    def _new_request(self, p: _Prompt, tokens: list[int]) -> Request:
        rid = f"__beam{next(self._ids)}"
        req = Request(rid, p.prompt_ids, StopRule(max_tokens=p.max_steps, ignore_eos=True))
        req.output_token_ids = tokens[len(p.prompt_ids):]
        req.data = self.engine.next_seed()
        self.owner[rid] = p
        return req

    def _start(self, p: _Prompt) -> None:
        beam = _Beam(list(p.prompt_ids), [], 0.0)
        beam.req = self._new_request(p, beam.tokens)
        p.beams = [beam]
        self.engine.scheduler.add(beam.req)

    def _advance(self, p: _Prompt) -> None:
        prm, sched = self.params, self.engine.scheduler
        key = lambda b: beam_score(b.tokens, b.cum_logprob, self.eos, prm.length_penalty)
        live = []
        for beam in p.beams:
            cands = p.reports[beam.req.request_id]
            for tok, lp in cands.items():
                nb = _Beam(beam.tokens + [tok], beam.logprobs + [cands], beam.cum_logprob + lp.logprob)
                nb.req = beam.req  # parent, until forked
                if tok in self.eos and not prm.ignore_eos:
                    nb.finish_reason = "stop"
                    p.completed.append(nb)
                else:
                    live.append(nb)
        live = sorted(live, key=key, reverse=True)[:prm.beam_width]
        p.steps += 1
        parents = [b.req for b in p.beams]
        if p.steps < p.max_steps and live:
            for nb in live:  # fork before finishing parents: children take their block refs
                parent, nb.req = nb.req, self._new_request(p, nb.tokens)
                sched.fork(parent, nb.req)
        else:
            for nb in live:
                nb.req, nb.finish_reason = None, "length"
            p.completed += live
            live, p.done = [], True
        for req in parents:
            sched.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            del self.owner[req.request_id]
        p.beams, p.reports = live, {}

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        eng, prm = self.engine, self.params
        todo = [_Prompt(ids, min(prm.max_tokens, eng.max_model_len - len(ids))) for ids in prompts]
        # Each prompt holds up to beam_width running beams: start as many as fit max_num_seqs.
        limit = max(1, eng.cfg.max_num_seqs // prm.beam_width)
        pending, active = list(todo), []
        eng.beam = self
        try:
            while pending or active:
                while pending and len(active) < limit:
                    active.append(pending.pop(0))
                    self._start(active[-1])
                eng.step()
                active = [p for p in active if not p.done]
        finally:
            eng.beam = None
            for rid in list(self.owner):
                eng.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            self.owner.clear()
        key = lambda b: beam_score(b.tokens, b.cum_logprob, self.eos, prm.length_penalty)
        outputs = []
        for p in todo:
            best = sorted(p.completed, key=key, reverse=True)[:prm.beam_width]
            outputs.append(BeamSearchOutput([
                BeamSearchSequence(b.tokens, b.logprobs, cum_logprob=b.cum_logprob,
                                   text=self._decode(b.tokens), finish_reason=b.finish_reason)
                for b in best]))
        return outputs
