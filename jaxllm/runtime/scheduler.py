"""One scheduler for prompts and generation alike (vLLM V1 style).

Each step has a token budget. Running requests go first (a generating request
needs one token, a request mid-prompt its next chunk), then waiting ones are
admitted while budget, `max_num_seqs` and free blocks last. When the pool runs
dry for a running request, the most recently admitted running request is
preempted by recompute: its blocks are freed and it returns to the head of the
waiting queue with its counter at zero.

The output is plain data (`SchedulerOutput`): which tokens of which request to
run, where their K/V go, and which rows produce a sampled token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prompt chunk may take the whole budget


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the new tokens fed this step
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # this chunk reaches the end of the known tokens: sample one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: last = first to preempt
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management --------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is and free its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not req.finished:
            req.status = status
        req.finished_time = time.time()
        self.kv.free(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the step -----------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _preempt(self) -> Request:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[Request, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self._preempt()
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                picked.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing after it is left in running

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hits = self.kv.get_computed_blocks(req)
                num_hit = len(hits) * self.kv.block_size
                n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
                if self.config.long_prefill_token_threshold > 0:
                    n = min(n, self.config.long_prefill_token_threshold)
                if self.kv.allocate_slots(req, n, hits) is None:
                    break
                self.waiting.popleft()
                req.num_computed_tokens += num_hit
                if req.num_preemptions == 0:
                    req.num_cached_tokens = num_hit
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                picked.append((req, n))
                budget -= n

        for req, n in picked:
            start = req.num_computed_tokens
            out.scheduled.append(ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.token_slice(start, start + n),
                start_pos=start,
                block_ids=self.kv.block_ids(req.request_id),
                sample=start + n == req.num_tokens,
            ))
            out.num_batched_tokens += n
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance counters after the step ran; append sampled tokens.

        Returns the requests that received a token (finished ones included:
        their blocks are already freed and they are no longer tracked).
        """
        now = time.time()
        touched = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens = s.start_pos + len(s.token_ids)
            self.kv.cache_full_blocks(req)
            if not s.sample:
                continue
            req.output_token_ids.append(int(sampled[s.request_id]))
            if req.first_token_time is None:
                req.first_token_time = now
            touched.append(req)
            if req.check_stop(self.config.max_model_len):
                self.finish(req.request_id, req.status)
        return touched
