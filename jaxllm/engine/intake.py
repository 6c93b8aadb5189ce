"""Requests into the engine and out of it early: tokenizing and checking a prompt, the n
sequences of a request, aborts, and the constrained-decoding state requests bring.

`Intake` is a mixin of `LLMEngine` (llm_engine.py), which holds what these methods read: the
tokenizer, `model_cfg`, `max_model_len`, the sampler, the scheduler, the `parents` and `seqs`
maps and the `_counter` of seeds.
"""

from __future__ import annotations

import logging
import time

from jaxllm.engine.outputs_builder import ParentRequest, Sequence, make_output
from jaxllm.outputs import RequestMetrics, RequestOutput
from jaxllm.runtime.request import Request, RequestStatus, StopRule
from jaxllm.sampling_params import SamplingParams

log = logging.getLogger("jaxllm")


class Intake:
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} out of range for vocab size {self.model_cfg.vocab_size}")
        return None, ids

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt length {len(prompt_ids)} is longer than max_model_len "
                             f"{self.max_model_len}")
        if params.logprobs is not None and params.logprobs > self.sampler.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} > max {self.sampler.max_logprobs}")
        if params.n > self.cfg.max_num_seqs:  # the n sequences run side by side after the fork
            raise ValueError(f"n={params.n} is larger than max_num_seqs={self.cfg.max_num_seqs}")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (this engine has none)")
        if priority != 0 and self.cfg.scheduling_policy != "priority":
            raise ValueError(f"got priority {priority} but priority scheduling is not enabled "
                             "(scheduling_policy='priority')")

    def next_seed(self) -> int:
        """A fresh per-sequence seed for a request that did not set one."""
        return hash((self.cfg.seed, next(self._counter))) & 0x7FFFFFFFFFFFFFFF

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, kv_transfer_params: dict | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, ids = self.tokenize(prompt)
        self.validate(ids, params, priority)
        arrival = arrival_time or time.time()
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        stop = StopRule(max_tokens=max_tokens, min_tokens=params.min_tokens,
                        eos_token_ids=self.eos_ids, stop_token_ids=tuple(params.stop_token_ids or ()),
                        ignore_eos=params.ignore_eos)
        parent = ParentRequest(request_id, text, ids, params, [], RequestMetrics(arrival))
        grammar = self.structured.submit(params.structured_outputs) if params.structured_outputs else None
        n = params.n
        for i in range(n):
            sid = request_id if n == 1 else f"{i}_{request_id}"
            seed = params.seed + i if params.seed is not None else self.next_seed()
            req = Request(sid, ids, stop, arrival_time=arrival, priority=priority, cache_salt=cache_salt,
                          kv_transfer_params=kv_transfer_params)
            seq = Sequence(req, parent.request_id, i, seed, self.tokenizer, params)
            parent.seqs.append(seq)
            self.seqs[sid] = seq
            if grammar is not None:  # it waits in the queue until its grammar compiled
                self.structured.add(sid, params.structured_outputs, grammar)
                req.admit_check = self.structured.ready(grammar)  # (a sibling may become the leader)
        self.parents[request_id] = parent
        self.scheduler.add(parent.seqs[0].req, [seq.req for seq in parent.seqs[1:]])

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for seq in reversed(parent.seqs):  # siblings first: no heir takes over the prompt
                self.scheduler.finish(seq.req.request_id, RequestStatus.FINISHED_ABORTED)
                self._drop_seq(seq.req.request_id)

    def _drop_seq(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)
        if self._structured is not None:
            self._structured.remove(seq_id)

    @property
    def structured(self):
        """Constrained decoding state (grammars, matchers, bitmasks); built on first use."""
        if self._structured is None:
            from jaxllm.structured.manager import StructuredManager
            self._structured = StructuredManager(self.tokenizer, self.model_cfg.vocab_size)
        return self._structured

    def prepare_structured_outputs(self) -> float | None:
        """Build the constrained-decoding state now (the llguidance tokenizer over the whole
        vocabulary: ~1 s for 128k ids), not at the first constrained request, where it stalls
        every running request (the server calls this at start-up). Seconds taken, or None when
        there is no tokenizer or no llguidance."""
        import importlib.util
        if self._structured is not None or self.tokenizer is None or importlib.util.find_spec("llguidance") is None:
            return None
        t0 = time.perf_counter()
        self.structured  # noqa: B018 (builds it)
        took = time.perf_counter() - t0
        log.info("structured outputs ready: grammar backend over %d token ids built in %.2f s",
                 self.model_cfg.vocab_size, took)
        return took

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def _fail_grammars(self) -> list[RequestOutput]:
        """Finish (aborted) the requests whose grammar failed to compile."""
        outputs = []
        for sid, reason in self._structured.failed():
            seq = self.seqs.get(sid)
            parent = self.parents.pop(seq.parent_id, None) if seq is not None else None
            if parent is None:
                self._structured.remove(sid)
                continue
            log.error("request %s: structured_outputs failed to compile: %s", parent.request_id, reason)
            for s in reversed(parent.seqs):
                self.scheduler.finish(s.req.request_id, RequestStatus.FINISHED_ABORTED)
                self._drop_seq(s.req.request_id)
            outputs.append(make_output(parent, True))
        return outputs
