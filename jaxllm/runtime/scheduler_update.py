"""After a step ran: the scheduler's requests take their sampled tokens (accepted drafts and the
token after them as a list, the rejected drafts' K/V uncounted and their blocks freed), pending
n > 1 siblings are forked off their leader, requests handed no token are parked, and stop rules
finish requests.

`StepUpdate` is a mixin of `Scheduler` (scheduler.py)."""

from __future__ import annotations

import time

from jaxllm.runtime.request import Request, RequestStatus
from jaxllm.runtime.scheduler_output import ScheduledRequest, SchedulerOutput


class StepUpdate:
    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """After the step ran: fork pending siblings; append sampled tokens.

        A row that verified drafts gets a list: the accepted drafts, then the
        token sampled after them; the rejected drafts are rolled back here.

        A sampling request (or sibling) missing from `sampled` is parked.
        Returns the requests that received a token (finished ones included:
        their blocks are already freed and they are no longer tracked). With
        overlapped steps a request may have been preempted since `out` was
        scheduled: its token still counts (a recompute will include it).
        """
        now = time.time()
        touched: list[Request] = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:  # finished or aborted meanwhile
                continue
            req.num_pending -= s.sample * (1 + len(s.spec_token_ids))
            if s.spec_token_ids:
                self._roll_back(req, s, sampled.get(req.request_id))
            if s.sample:
                forks, req.pending_forks = req.pending_forks, []
                for child in forks:  # before req's own stop check can free the shared blocks
                    del self._leader_of[child.request_id]
                    self._share(req, child)
                    self._append(child, sampled.get(child.request_id), now, touched)
                self._append(req, sampled.get(req.request_id), now, touched)
            if req.status is RequestStatus.RUNNING:  # a block the new token completes gets its hash
                self.kv.cache_full_blocks(req)
        return touched

    def _roll_back(self, req: Request, s: ScheduledRequest, tokens: list[int] | None) -> None:
        """Uncount the K/V of rejected drafts and free the blocks only they used."""
        k = len(s.spec_token_ids)
        tokens = [] if tokens is None else tokens if isinstance(tokens, list) else [tokens]
        accepted = max(0, len(tokens) - 1)
        if accepted > k or s.spec_token_ids[:accepted] != list(tokens[:accepted]):
            raise ValueError(f"{req.request_id}: accepted tokens {tokens} do not extend the "
                             f"drafts {s.spec_token_ids}")
        if req.num_computed_tokens:  # (a recompute preemption since reset it to 0)
            req.num_computed_tokens -= k - accepted
        if req.status is RequestStatus.RUNNING:
            self.kv.trim(req, req.num_computed_tokens + self.config.num_lookahead_tokens)

    def _append(self, req: Request, token: int | list[int] | None, now: float,
                touched: list[Request]) -> None:
        if token is None:
            self.running.remove(req)
            req.status = RequestStatus.PARKED
            self.parked[req.request_id] = req
            return
        if req.first_token_time is None:
            req.first_token_time = now
        touched.append(req)
        for t in token if isinstance(token, list) else (token,):
            req.output_token_ids.append(int(t))
            if req.check_stop(self.config.max_model_len):  # later accepted tokens are dropped
                self.finish(req.request_id, req.status)
                return
