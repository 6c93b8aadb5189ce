"""Per-request and per-sequence output state: incremental text, stop strings, logprobs, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxllm.runtime.request import Request
from jaxllm.sampling_params import SamplingParams


class Sequence:
    """One generated sequence (a child of a request when n > 1)."""

    def __init__(self, req: Request, parent_id: str, index: int, seed: int, tokenizer,
                 params: SamplingParams):
        self.req = req
        self.parent_id = parent_id
        self.index = index
        self.seed = seed
        self.params = params
        self.tokenizer = tokenizer
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.detok = None
        if tokenizer is not None and params.detokenize:
            from jaxllm.models.detokenizer import IncrementalDetokenizer
            self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids,
                                                skip_special_tokens=params.skip_special_tokens)

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def on_token(self, sout, row: int, index: int | None = None) -> bool:
        """Record output token `index` (default: the last) from logits row `row`;
        True if a stop string fired. Tokens of one step (accepted drafts) come in order."""
        out = self.req.output_token_ids
        index = len(out) - 1 if index is None else index
        token, last = out[index], index == len(out) - 1
        if self.logprobs is not None:
            n = self.params.logprobs
            entry = {}
            for rank, (tid, lp) in enumerate(zip(sout.top_ids[row][:n], sout.top_logprobs[row][:n]), 1):
                entry[int(tid)] = Logprob(float(lp), rank, self._decode_one(int(tid)))
            if token not in entry:
                lp = float(sout.logprobs[row])
                rank = int((sout.top_logprobs[row] > lp).sum()) + 1 if n else None
                entry[token] = Logprob(lp, rank, self._decode_one(token))
            self.logprobs.append(entry)
            self.cumulative_logprob += float(sout.logprobs[row])
        if self.detok is None:
            return False
        delta = self.detok.add([token])
        done = self.req.finished and last  # (a request finished by a later token of this step)
        if done:  # release bytes held back for a character still being spelled
            delta += self.detok.finish()
        self.text += delta
        stops = self.params.stop
        if stops and not done:
            from jaxllm.models.detokenizer import find_stop
            cut = find_stop(self.text, len(delta), stops, self.params.include_stop_str_in_output)
            if cut is not None:
                for s in stops:
                    if s in self.text[:cut + len(s)]:
                        self.req.stop_reason = s
                        break
                self.text = self.text[:cut]
                return True
        return False

    def completion(self) -> CompletionOutput:
        status = self.req.status
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.req.output_token_ids),
            cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
            finish_reason=status.value if status.finished else None,
            stop_reason=self.req.stop_reason)


def make_output(parent, finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id=parent.request_id, prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        outputs=[s.completion() for s in parent.seqs], finished=finished,
        metrics=parent.metrics, num_cached_tokens=parent.num_cached_tokens,
        kv_transfer_params=(parent.seqs[0].req.kv_transfer_params_out or {}) if finished else {})


@dataclass
class ParentRequest:
    """A user request: its n sequences and the metrics reported for them together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    finished_seqs: set = field(default_factory=set)

    @property
    def finished(self) -> bool:
        return len(self.finished_seqs) == len(self.seqs)

    def record(self, req: Request) -> bool:
        """A sequence received a token: update timings; True once every sequence finished."""
        m = self.metrics
        m.last_token_time = time.time()
        if m.first_token_time is None:
            m.first_token_time = m.last_token_time
        if req.num_preemptions == 0 or not self.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, req.num_cached_tokens)
        if req.finished:
            self.finished_seqs.add(req.request_id)
        if self.finished:
            m.finished_time = time.time()
        return self.finished
