"""One scheduler for prompts and generation alike (vLLM V1 style).

Each step has a token budget. Running requests go first (a generating request
needs one token, a request mid-prompt its next chunk), then waiting ones are
admitted while budget, `max_num_seqs` seats and free blocks last. When the
pool runs dry for a running request, the last running request is preempted:
the most recently admitted one (FCFS), or the lowest-priority one (policy
"priority": `running` is then kept sorted by `Request.sort_key`). Preemption
either frees the victim's blocks and resets its counter (recompute) or queues
its pages for host memory and keeps the counter (swap; recompute when the host
pool is full). Under "priority" a waiting request that does not fit also
preempts running requests of strictly lower priority.

Forks: an n > 1 leader reserves n seats; when its prompt's last chunk samples,
its pending siblings are forked off it, sharing its blocks. `fork()` does the
same for an arbitrary running or parked request (beam search). A request that
samples but is handed no token is *parked*: out of the running set, blocks
kept, until its owner forks or finishes it; parked blocks are the first to go
when the pool runs dry.

A KV connector (`jaxllm.kv_transfer`), if any, is asked on admission for tokens past the
device prefix hits it can load. Loaded inline, they count as computed and its worker loads
them before the forward pass. Loaded asynchronously (vLLM's `load_kv_async`), the request
gets its blocks for them and waits in `loading` (WAITING_FOR_REMOTE_KVS) while the batch
runs on; once the connector names its load done it rejoins the queue's front with them
computed, and only then are its loaded blocks offered to the prefix cache. A request whose
KV the connector cannot count yet (it is fetching) steps aside into `loading` too, without
blocks. Finished requests are handed to it (it may save their blocks, or hold them until
sent); one finished while loading is told to the connector, which drops the load.

Speculative decoding: a running request's `spec_token_ids` are fed after its
last token in the same chunk, counted in the budget (vLLM's
`num_tokens_with_spec`), fewer when the budget, `max_tokens` or the context
would be overshot. `update` takes the accepted drafts plus one sampled token
as a list, sets `num_computed_tokens` back over the rejected ones and frees
their blocks; drafts are never hashed (only known tokens are). A step with drafts
counts 1 + drafts in `num_pending`, as if every draft were accepted (vLLM V1's
optimistic count): overlapped, the next step is scheduled after them and the device
moves its tokens back over the rejected ones (jaxllm/spec/shift.py).

The output is plain data (`SchedulerOutput`): which tokens of which request to
run, where their K/V go, which rows produce sampled tokens, and the page copies
and swaps the engine must run before the step.
"""

from __future__ import annotations

import bisect
import itertools

from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.padding import fit_chunk
from jaxllm.runtime.request import Request, RequestStatus
from jaxllm.runtime.request_queue import make_queue
from jaxllm.runtime.scheduler_loading import RemoteLoads
from jaxllm.runtime.scheduler_output import (PLACEHOLDER, ScheduledRequest, SchedulerConfig,
                                             SchedulerOutput)
from jaxllm.runtime.scheduler_requests import Requests
from jaxllm.runtime.scheduler_update import StepUpdate

__all__ = ["PLACEHOLDER", "Scheduler", "SchedulerConfig", "SchedulerOutput", "ScheduledRequest"]


class Scheduler(Requests, RemoteLoads, StepUpdate):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, connector=None):
        self.config = config
        self.kv = kv
        self.connector = connector  # a jaxllm.kv_transfer connector (scheduler side), or None
        self.loading: dict[str, Request] = {}  # waiting for the connector to fetch their KV
        self._loading_ext: dict[str, int] = {}  # of those, loading asynchronously: its tokens
        self._holding: dict[str, Request] = {}  # loaded, waiting with their blocks (evictable)
        self.delayed: dict[str, Request] = {}  # finished; blocks held until the connector sent them
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []  # the last one is the next to preempt
        self.parked: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self._leader_of: dict[str, Request] = {}  # pending fork id -> its leader
        self._seq = itertools.count()
        self.num_preemptions = 0
        self.num_swapped_out = 0

    # -- helpers -------------------------------------------------------------
    def _insert_running(self, req: Request) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
        else:
            self.running.append(req)

    def _chunk(self, num_tokens: int, budget: int) -> int:
        cfg = self.config
        n = min(num_tokens, budget)
        if cfg.long_prefill_token_threshold > 0:
            n = min(n, cfg.long_prefill_token_threshold)
        if cfg.token_buckets and n > 1:
            n = fit_chunk(cfg.max_num_batched_tokens - budget, n, cfg.token_buckets, cfg.fit_min_bucket)
        return n

    def _drafts(self, req: Request) -> list[int]:
        """Take req's drafts, cut to what max_tokens and the context leave room for."""
        spec, req.spec_token_ids = req.spec_token_ids, []
        if not spec or req.pending_forks:  # n > 1 siblings fork off the prompt's row alone
            return []
        room = min(req.stop.max_tokens - len(req.output_token_ids) - req.num_pending,
                   self.config.max_model_len - req.num_tokens_scheduled) - 1
        return spec[:max(0, room)]

    def _allocate(self, req: Request, n: int, hits: list = ()) -> list | None:
        """Slots for n new tokens, plus the lookahead a draft model writes into."""
        look = self.config.num_lookahead_tokens
        if look:
            look = max(0, min(look, self.config.max_model_len - req.num_computed_tokens
                              - len(hits) * self.kv.block_size - n))
        return self.kv.allocate_slots(req, n + look, hits)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        victim.spec_token_ids = []
        self.running.remove(victim)
        if self.config.preemption_mode == "swap" and self.kv.swap_out(victim):
            self.num_swapped_out += 1
        else:
            if self.connector is not None:
                self.connector.request_preempted(victim, self.kv.block_ids(victim.request_id))
            self.kv.free(victim)
            victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(victim)
        out.preempted.append(victim.request_id)

    def _next_waiting(self) -> Request | None:
        """The first waiting request that may be admitted (see `Request.admit_check`)."""
        for req in self.waiting:
            if req.admit_check is None or req.admit_check():
                return req
        return None

    def _admission(self, req: Request, budget: int) -> tuple[list, int | None, bool, int]:
        """(prefix-cache hits, tokens the connector loads (None: not known yet), whether it
        loads them asynchronously, tokens to schedule) if req were admitted now."""
        hits = self.kv.get_computed_blocks(req)
        done = req.num_computed_tokens + len(hits) * self.kv.block_size
        ext, is_async = 0, False
        if (self.connector is not None and req.request_id not in self.kv.tables
                and not self.kv.is_swapped(req)):
            ext, is_async = self.connector.get_num_new_matched_tokens(req, done)
        return hits, ext, bool(is_async and ext), self._chunk(req.num_tokens - done - (ext or 0), budget)

    def _preempt_for_priority(self, out: SchedulerOutput, budget: int) -> None:
        """Make room for a waiting request that outranks the lowest running one."""
        while len(self.waiting) and self.running:
            head, victim = self._next_waiting(), self.running[-1]
            if head is None:
                return
            if head.priority >= victim.priority:
                return
            hits, ext, _, n = self._admission(head, budget)
            n += ext or 0
            seats = sum(r.seats for r in self.running) + head.seats
            if (seats <= self.config.max_num_seqs
                    and self.kv.num_blocks_needed(head, n, hits) <= self.kv.num_free_blocks):
                return
            if seats <= self.config.max_num_seqs and self._evict_parked():
                continue
            self._preempt(victim, out)

    # -- the step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        cfg = self.config
        self.kv.begin_step()
        if self.connector is not None:
            self._poll_connector()
        budget = cfg.max_num_batched_tokens
        if cfg.policy == "priority":
            self._preempt_for_priority(out, budget)
        picked: list[tuple[Request, int]] = []
        drafts: dict[str, list[int]] = {}
        preempted_for_room = False

        i = 0
        while i < len(self.running) and budget > 0 and len(picked) < cfg.max_num_seqs:
            req = self.running[i]
            spec = self._drafts(req)
            left = req.num_tokens_scheduled - req.num_computed_tokens
            n = self._chunk(left + len(spec), budget)
            if n <= 0 or req.will_stop_by_length(cfg.max_model_len):
                i += 1  # its tokens in flight end it: nothing more to run
                continue
            if n > left:
                drafts[req.request_id] = spec[:n - left]
            while self._allocate(req, n) is None:
                if self._evict_parked():
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted_for_room = True
                if victim is req:
                    break
            else:
                self.kv.cache_full_blocks(req, req.num_computed_tokens + n)
                picked.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing after it is left in running

        if not preempted_for_room:  # no thrashing: a victim must not be readmitted at once
            seats = sum(r.seats for r in self.running)
            while len(self.waiting) and budget > 0:
                req = self._next_waiting()
                if req is None:
                    break
                if seats + req.seats > cfg.max_num_seqs or req.request_id in out.preempted:
                    break  # (a request preempted for priority this step waits at least one)
                hits, ext, is_async, n = self._admission(req, budget)
                if ext is None:  # the connector is still fetching its KV: step aside
                    self.waiting.remove(req)  # (not pop: req may stand behind a gated one)
                    self.loading[req.request_id] = req
                    continue
                if is_async:  # blocks for the loaded tokens now; scheduled once they are in
                    if self.kv.allocate_slots(req, ext, hits) is None:
                        if self._evict_parked(req):
                            continue
                        break
                    self.waiting.remove(req)
                    self._park_loading(req, hits, ext)
                    continue
                loaded = req.request_id in self.kv.tables  # back from an asynchronous load
                if self._allocate(req, ext + n, hits) is None:
                    if self._evict_parked(req):
                        continue
                    break
                self.waiting.remove(req)
                self._holding.pop(req.request_id, None)
                num_hit = len(hits) * self.kv.block_size
                req.num_computed_tokens += num_hit
                if self.connector is not None and not loaded:
                    self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), ext)
                    req.num_computed_tokens += ext
                if req.num_preemptions == 0 and not loaded:
                    req.num_cached_tokens = num_hit + ext
                req.status = RequestStatus.RUNNING
                self._insert_running(req)
                seats += req.seats
                self.kv.cache_full_blocks(req, req.num_computed_tokens + n)
                picked.append((req, n))
                budget -= n

        for req, n in picked:
            spec = drafts.get(req.request_id, [])
            start, known = req.num_computed_tokens, req.num_tokens
            end = start + n
            sample = end - len(spec) == req.num_tokens_scheduled
            fed = end - len(spec)
            ids = req.token_slice(start, min(fed, known)) + [PLACEHOLDER] * (fed - max(start, known))
            out.scheduled.append(ScheduledRequest(
                request_id=req.request_id,
                token_ids=ids + spec,
                start_pos=start,
                block_ids=self.kv.block_ids(req.request_id),
                sample=sample,
                fork_ids=[f.request_id for f in req.pending_forks] if sample else [],
                spec_token_ids=spec,
            ))
            out.num_batched_tokens += n
            # Counted as computed now (vLLM V1 does the same): the next schedule may come
            # before this step's update when the engine overlaps steps.
            req.num_computed_tokens = end
            req.num_pending += sample * (1 + len(spec))  # drafts: as if every one is accepted
        out.swap_out, out.copies, out.swap_in = self.kv.take_ops()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        return out
