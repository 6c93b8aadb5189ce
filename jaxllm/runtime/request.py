"""A request as the scheduler sees it: token ids and one progress counter.

Following vLLM V1 there is no prefill/decode mode. `num_computed_tokens` counts
how many of `all_token_ids` already have K/V in the cache; the scheduler simply
feeds the rest, in chunks if the token budget is short. A request resumed after
recompute preemption just has its counter reset to 0; one resumed after swap
preemption keeps it (its pages come back from host memory).

With overlapped (async) scheduling the engine schedules step k+1 before step
k's sampled tokens reach the host. `num_pending` counts those tokens in flight:
the scheduler treats them as known (their positions get fed as placeholders
the device fills from step k's output), and `Scheduler.update` turns each into
a real token. Synchronous engines see it go 0 -> 1 -> 0 within one step.

Parallel sampling (n > 1) uses one *leader* request for the prompt; the other
n - 1 sequences wait as `pending_forks` and are forked off the leader, sharing
its blocks, the moment its prompt is computed and n first tokens are sampled.

Speculative decoding: `spec_token_ids` are draft tokens a proposer guessed to
follow the known ones (vLLM V1's field). The scheduler feeds them after the
last token in the same step, counted in the budget, and `Scheduler.update`
rolls `num_computed_tokens` back over the ones the target model rejected.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    PARKED = "parked"  # all tokens computed, waiting for its owner to fork or finish it
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, a KV connector loading them
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class StopRule:
    """The token-level stop conditions the scheduler can check without a tokenizer."""

    max_tokens: int
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    stop: StopRule
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_pending: int = 0  # sampled tokens scheduled for but not yet appended (async scheduling)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    data: object = None  # engine-side payload (sampling params, detokenizer, ...)
    pending_forks: list["Request"] = field(default_factory=list)  # n > 1: siblings to fork
    seq_no: int = 0  # admission tie-breaker, set by the scheduler
    kv_transfer_params: dict | None = None  # from the client (P/D: where the prefilled KV is)
    kv_transfer_params_out: dict | None = None  # from the KV connector when it finished
    # Admission gate (e.g. its grammar still compiling): the scheduler passes over a waiting
    # request while this returns False, admitting those behind it.
    admit_check: Callable[[], bool] | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # drafts for the next step

    @property
    def seats(self) -> int:
        """Running slots this request needs: itself plus the forks it will spawn."""
        return 1 + len(self.pending_forks)

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Priority order: lower priority value first, then arrival (FCFS)."""
        return (self.priority, self.arrival_time, self.seq_no)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus the draft tokens proposed to follow them (vLLM's name)."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_tokens_scheduled(self) -> int:
        """Known tokens plus the sampled ones still in flight."""
        return self.num_tokens + self.num_pending

    def will_stop_by_length(self, max_model_len: int) -> bool:
        """Its in-flight tokens already reach max_tokens or the context limit."""
        return self.num_pending > 0 and (
            len(self.output_token_ids) + self.num_pending >= self.stop.max_tokens
            or self.num_tokens_scheduled >= max_model_len)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: set a finished status if a stop rule fires."""
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n_out >= self.stop.min_tokens:
            if not self.stop.ignore_eos and last in self.stop.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self.stop.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if n_out >= self.stop.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
