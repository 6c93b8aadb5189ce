"""What the scheduler decides each step, as plain data: its config and its output.

`SchedulerOutput` lists which tokens of which request to run, where their K/V
go (each request's whole block table), which rows sample (and which n > 1
siblings sample from the same row), and the page moves the engine must run
before the forward pass: swap-outs, copy-on-write copies, swap-ins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEHOLDER = -1  # a token id sampled by the step still in flight (async scheduling)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prompt chunk may take the whole budget
    policy: str = "fcfs"  # "fcfs" | "priority"
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    # Speculative decoding: KV slots kept allocated past a request's tokens, so a draft
    # model can write its own K/V for the positions it guesses (vLLM's num_lookahead_tokens).
    num_lookahead_tokens: int = 0
    # The device's padded token counts (ascending; empty: no padding to fit). A prompt chunk that
    # would push the step just past a bucket of at least `fit_min_bucket` tokens is cut back to
    # it, the rest going into the next step (runtime/padding.py).
    token_buckets: tuple[int, ...] = ()
    fit_min_bucket: int = 256

    def __post_init__(self):
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption mode {self.preemption_mode!r}")


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the new tokens fed this step; PLACEHOLDER where still in flight
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # this chunk reaches the end of the known tokens: sample one
    fork_ids: list[str] = field(default_factory=list)  # siblings sampling from this row too
    # Draft tokens: the last len(spec_token_ids) entries of token_ids. The step scores them
    # all; `Scheduler.update` gets the accepted ones plus one more and rolls back the rest.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    kv_connector_metadata: object = None  # the KV connector's loads and saves for this step

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def has_kv_ops(self) -> bool:
        return bool(self.swap_out or self.copies or self.swap_in) or self.kv_connector_metadata is not None
