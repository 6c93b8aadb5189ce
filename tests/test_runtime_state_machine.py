"""Stateful property test of the host runtime: scheduler + KV cache manager + block pool.

Each machine draws a configuration (block size, a pool small enough to force
recompute preemption, token budget, max_num_seqs, prefix caching on or off) and
then interleaves adding requests, running steps and aborting requests. After
every rule the block accounting and scheduling invariants are checked.

On top of the accounting, the test keeps a shadow of the KV cache: every slot
written by a step records the token prefix whose K/V it would hold (and the
request's cache salt). Before each step, every scheduled request's table must
already hold exactly its own tokens for positions [0, start_pos): this checks
prefix-cache hits, preemption/recompute and block-table bookkeeping end to end.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.request import Request, RequestStatus, StopRule
from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig

EOS = 0
ALPHABET = (1, 2, 3)  # small, so equal blocks (prefix hits) happen
MAX_PROMPT = 200
MAX_TOKENS = 32


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


ADD_ARGS = dict(
    length=st.integers(1, MAX_PROMPT),
    max_tokens=st.integers(1, MAX_TOKENS),
    share=st.sampled_from(["none", "none", "prefix", "prefix", "duplicate"]),
    pick=st.integers(0, 10**6),
    share_frac=st.floats(0.0, 1.0),
    align=st.booleans(),
    salt=st.sampled_from([None, None, None, "x"]),
    seed=st.integers(0, 2**32 - 1),
)


class RuntimeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.prompts: list[list[int]] = []
        self.all_reqs: list[Request] = []
        self.aborted: set[str] = set()
        self.last_out = None
        self.slots: dict[tuple[int, int], tuple] = {}  # (block id, offset) -> (salt, prefix key)
        self.keys: dict[str, list[int]] = {}  # request id -> chained key of each token prefix
        self.n = 0

    # -- configuration ---------------------------------------------------------
    @initialize(
        block_size=st.sampled_from([4, 8, 16]),
        extra_blocks=st.integers(0, 6),
        budget=st.sampled_from([8, 24, 64, 256]),
        max_num_seqs=st.integers(1, 8),
        prefix=st.sampled_from([True, True, False]),
        threshold=st.sampled_from([0, 0, 0, 5]),
        initial=st.lists(st.fixed_dictionaries(ADD_ARGS), max_size=3),
    )
    def configure(self, block_size, extra_blocks, budget, max_num_seqs, prefix, threshold,
                  initial):
        # The pool always fits one maximal request alone (so every request can
        # finish) but only a few together, which forces preemption.
        need_one = ceil_div(MAX_PROMPT + MAX_TOKENS, block_size)
        kv = KVCacheManager(need_one + extra_blocks, block_size, enable_prefix_caching=prefix)
        cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                              max_model_len=10_000, long_prefill_token_threshold=threshold)
        self.sched = Scheduler(cfg, kv)
        for args in initial:  # start most runs with a few requests in flight
            self.add(**args)

    def prefix_keys(self, req: Request, n: int) -> list[int]:
        """keys[p] names the token prefix [0, p]; equal keys mean equal prefixes."""
        keys = self.keys.setdefault(req.request_id, [])
        while len(keys) < n:
            keys.append(hash((keys[-1] if keys else None, req.all_token_ids[len(keys)])))
        return keys

    @property
    def kv(self) -> KVCacheManager:
        return self.sched.kv

    # -- rules -------------------------------------------------------------------
    @rule(**ADD_ARGS)
    def add(self, length, max_tokens, share, pick, share_frac, align, salt, seed):
        """A new prompt: fresh, or an earlier prompt's prefix plus fresh tokens, or an
        exact duplicate of an earlier prompt; optionally cut to whole blocks."""
        rnd = random.Random(seed)
        S = self.kv.block_size
        base = self.prompts[pick % len(self.prompts)] if self.prompts else []
        if share == "duplicate" and base:
            prompt = list(base)
        else:
            prompt = base[: int(len(base) * share_frac)] if share == "prefix" else []
            prompt = (prompt + [rnd.choice(ALPHABET) for _ in range(length)])[:MAX_PROMPT]
            if align and len(prompt) >= S:
                prompt = prompt[: len(prompt) // S * S]
        self.prompts.append(prompt)
        req = Request(f"r{self.n}", prompt,
                      StopRule(max_tokens=max_tokens, eos_token_ids=(EOS,)), cache_salt=salt)
        self.n += 1
        self.all_reqs.append(req)
        self.sched.add(req)
        assert req.status is RequestStatus.WAITING

    @rule(seed=st.integers(0, 2**32 - 1), n_steps=st.integers(1, 6),
          abort_inflight=st.integers(0, 9))
    def step(self, seed, n_steps, abort_inflight):
        """n_steps engine steps; with abort_inflight == 0 the first one aborts a
        scheduled request between schedule() and update()."""
        rnd = random.Random(seed)
        for i in range(n_steps):
            self._step(rnd, abort_inflight == 0 and i == 0)

    @rule(pick=st.integers(0, 10**6), go=st.integers(0, 2))
    def abort(self, pick, go):
        live = sorted(self.sched.requests)
        if not live or go:  # abort one time in three, so requests live long enough to collide
            return
        rid = live[pick % len(live)]
        req = self.sched.finish(rid, RequestStatus.FINISHED_ABORTED)
        assert req.status is RequestStatus.FINISHED_ABORTED
        assert rid not in self.kv.tables and rid not in self.sched.requests
        self.aborted.add(rid)

    # -- one step: schedule, check, "run", update ---------------------------------------
    def _step(self, rnd: random.Random, abort_inflight: bool = False):
        sched, kv, S = self.sched, self.kv, self.kv.block_size
        before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
        out = sched.schedule()
        self.last_out = out
        cfg = sched.config
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert not set(ids) & set(out.preempted)
        if sched.requests:
            assert out.scheduled, "live requests but nothing scheduled: the scheduler stalled"
        for rid in out.preempted:
            r = sched.requests[rid]
            assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0
            assert rid not in kv.tables and r in sched.waiting
        for s in out.scheduled:
            req = sched.requests[s.request_id]
            assert req.status is RequestStatus.RUNNING
            n = len(s.token_ids)
            assert n >= 1
            # start_pos is the old counter, or past it by whole prefix-hit blocks
            # for a newly admitted request
            if before[s.request_id] > 0:
                assert s.start_pos == before[s.request_id]
            else:
                assert s.start_pos % S == 0 and s.start_pos == req.num_computed_tokens
            assert s.token_ids == req.all_token_ids[s.start_pos:s.start_pos + n]
            assert s.sample == (s.start_pos + n == req.num_tokens)
            assert s.block_ids == kv.block_ids(s.request_id)
            assert len(s.block_ids) == ceil_div(s.start_pos + n, S)
            # the K/V the step attends to is this request's own (prefix-cache hits included)
            keys = self.prefix_keys(req, s.start_pos + n)
            for p in range(s.start_pos):
                got = self.slots.get((s.block_ids[p // S], p % S))
                assert got == (req.cache_salt, keys[p]), (
                    f"{s.request_id}: wrong K/V at position {p}")
            # write this step's K/V; written blocks must be private and not cached
            for p in range(s.start_pos, s.start_pos + n):
                blk = kv.pool.blocks[s.block_ids[p // S]]
                assert blk.ref_cnt == 1, "writing into a shared block"
                assert blk.block_hash is None, "writing into a cached block"
                self.slots[(blk.block_id, p % S)] = (req.cache_salt, keys[p])
        if abort_inflight and out.scheduled:
            rid = rnd.choice(ids)
            sched.finish(rid, RequestStatus.FINISHED_ABORTED)
            self.aborted.add(rid)
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                sampled[s.request_id] = EOS if rnd.random() < 0.05 else rnd.choice(ALPHABET)
        touched = sched.update(out, sampled)
        for req in touched:
            assert req.output_token_ids[-1] == sampled[req.request_id]
            if req.finished:
                assert req.request_id not in sched.requests
                assert req.request_id not in kv.tables
        return out

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def block_accounting(self):
        if self.sched is None:
            return
        kv, pool = self.kv, self.kv.pool
        holders = Counter()
        for rid, table in kv.tables.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"{rid} holds a block twice"
            holders.update(ids)
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt}, held by {holders[b.block_id]} tables")
        # the free queue, walked both ways
        fwd = list(pool.free)
        back, node = [], pool.free.tail.prev
        while node is not pool.free.head:
            back.append(node)
            node = node.prev
        assert back[::-1] == fwd and len(fwd) == len(pool.free) == pool.num_free
        free_set = {b.block_id for b in fwd}
        assert len(free_set) == len(fwd)
        assert all(b.ref_cnt == 0 for b in fwd)
        assert free_set == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free + used == pool.num_blocks
        # the prefix cache maps each hash to the one block carrying it
        for h, b in pool.cached.items():
            assert b.block_hash == h
        assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached)
        if not kv.enable_prefix_caching:
            assert not pool.cached

    @invariant()
    def request_state(self):
        if self.sched is None:
            return
        sched, kv, S = self.sched, self.kv, self.kv.block_size
        running_ids = {r.request_id for r in sched.running}
        waiting_ids = {r.request_id for r in sched.waiting}
        assert len(running_ids) == len(sched.running) and len(waiting_ids) == len(sched.waiting)
        assert not running_ids & waiting_ids
        assert running_ids | waiting_ids == set(sched.requests)
        assert set(kv.tables) == running_ids
        assert len(sched.running) <= sched.config.max_num_seqs
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            table = kv.tables[r.request_id]
            assert len(table) * S >= r.num_computed_tokens
            assert len(table) == ceil_div(r.num_computed_tokens, S)  # nothing over-allocated
            assert 0 < r.num_computed_tokens < r.num_tokens
            # every full cached block of the table matches this request's tokens
            keys = self.prefix_keys(r, r.num_computed_tokens)
            for i, b in enumerate(table):
                if b.block_hash is not None:
                    assert (i + 1) * S <= r.num_computed_tokens
                    assert self.slots[(b.block_id, S - 1)] == (r.cache_salt, keys[(i + 1) * S - 1])
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
        for r in sched.requests.values():
            assert not r.finished and len(r.output_token_ids) < r.stop.max_tokens

    @invariant()
    def last_step_within_limits(self):
        out = self.last_out
        if out is None:
            return
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.config.max_num_seqs

    # -- teardown: drain -------------------------------------------------------------------
    def teardown(self):
        if self.sched is None:
            return
        rnd = random.Random(0)
        # Generous bound: every request fits the pool alone, so each step makes progress.
        limit = 50 + sum(r.num_prompt_tokens + r.stop.max_tokens for r in self.all_reqs) * 4
        steps = 0
        while self.sched.has_unfinished():
            self._step(rnd)
            self.block_accounting()
            self.request_state()
            steps += 1
            assert steps <= limit, f"did not drain in {limit} steps: {self.sched.requests.keys()}"
        assert not self.sched.running and not self.sched.waiting
        assert self.kv.tables == {}
        event(f"prefix caching {'on' if self.kv.enable_prefix_caching else 'off'}")
        event(f"preemptions: {'none' if not self.sched.num_preemptions else 'some'}")
        event(f"prefix hits: {'none' if not self.kv.prefix_hits else 'some'}")
        event(f"requests: {min(len(self.all_reqs), 10)}{'+' if len(self.all_reqs) >= 10 else ''}")
        event(f"stopped by EOS: {any(r.status is RequestStatus.FINISHED_STOPPED for r in self.all_reqs)}")
        pool = self.kv.pool
        assert pool.num_free == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        for r in self.all_reqs:
            assert r.finished
            if r.request_id in self.aborted:
                assert r.status is RequestStatus.FINISHED_ABORTED
            elif r.status is RequestStatus.FINISHED_STOPPED:
                assert r.output_token_ids[-1] == EOS
                assert len(r.output_token_ids) <= r.stop.max_tokens
            else:
                assert r.status is RequestStatus.FINISHED_LENGTH
                assert len(r.output_token_ids) == r.stop.max_tokens
                assert EOS not in r.output_token_ids


RuntimeMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRuntimeStateMachine = RuntimeMachine.TestCase
