"""Stateful property test of the host runtime: scheduler + KV cache manager + block pool.

Each machine draws a configuration (block size, a pool small enough to force
preemption, token budget, max_num_seqs, prefix caching on or off, FCFS or
priority, recompute or swap preemption with a host pool from none to roomy)
and then interleaves arrivals (some with n > 1 siblings forked off the prompt),
steps, aborts, and the beam-search pattern: a request that samples but gets no
token is parked, then forked into children or finished; running requests are
forked mid-generation too. With speculation drawn on, decoding requests carry
random draft tokens each step; a random prefix of them is accepted and the rest
rolled back (KV lookahead slots drawn too, as a draft model keeps them). After every rule the block accounting and the
scheduling invariants are checked (`runtime_shadow`).

A shadow of the KV cache (device and host slots) replays every step's writes,
swaps and copy-on-write copies; before each step every scheduled request's
table must hold exactly its own tokens for positions [0, start_pos). This
checks prefix hits, forks, copy-on-write, swap round trips and recompute end
to end. At teardown everything drains and all ref counts are back to zero.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from runtime_shadow import ShadowKV, ceil_div, check_block_accounting, check_request_state

from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.request import Request, RequestStatus, StopRule
from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig

EOS = 0
ALPHABET = (1, 2, 3)  # small, so equal blocks (prefix hits) happen
MAX_PROMPT = 200
MAX_TOKENS = 32

ADD_ARGS = dict(
    length=st.integers(1, MAX_PROMPT),
    max_tokens=st.integers(1, MAX_TOKENS),
    share=st.sampled_from(["none", "none", "prefix", "prefix", "duplicate"]),
    pick=st.integers(0, 10**6),
    share_frac=st.floats(0.0, 1.0),
    align=st.booleans(),
    salt=st.sampled_from([None, None, None, "x"]),
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([1, 1, 1, 2, 3]),
    priority=st.integers(0, 2),
)


class RuntimeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.prompts: list[list[int]] = []
        self.all_reqs: list[Request] = []
        self.aborted: set[str] = set()
        self.last_out = None
        self.shadow: ShadowKV | None = None
        self.n = 0
        self.forks = 0
        self.groups = 0  # arrivals with n > 1
        self.moves = {"copies": 0, "swap-ins": 0}
        self.resolved: set[str] = set()  # parked requests finished by their "owner"

    # -- configuration ---------------------------------------------------------
    @initialize(
        block_size=st.sampled_from([4, 8, 16]),
        extra_blocks=st.integers(0, 6),
        budget=st.sampled_from([8, 24, 64, 256]),
        max_num_seqs=st.integers(1, 8),
        prefix=st.sampled_from([True, True, False]),
        threshold=st.sampled_from([0, 0, 0, 5]),
        policy=st.sampled_from(["fcfs", "priority"]),
        mode=st.sampled_from(["recompute", "swap", "swap"]),
        host_blocks=st.sampled_from([0, 8, 40, 400]),
        park_rate=st.sampled_from([0.0, 0.05, 0.2]),
        initial=st.lists(st.fixed_dictionaries(ADD_ARGS), max_size=3),
        spec_k=st.sampled_from([0, 0, 1, 3, 6]),
        lookahead=st.sampled_from([0, 0, 3]),
    )
    def configure(self, block_size, extra_blocks, budget, max_num_seqs, prefix, threshold,
                  policy, mode, host_blocks, park_rate, initial, spec_k, lookahead):
        # The pool always fits one maximal request alone (so every request can
        # finish) but only a few together, which forces preemption.
        self.spec_k = spec_k
        self.spec_steps = self.rollbacks = 0
        lookahead = lookahead if spec_k else 0
        need_one = ceil_div(MAX_PROMPT + MAX_TOKENS + lookahead, block_size)
        kv = KVCacheManager(need_one + extra_blocks, block_size, enable_prefix_caching=prefix,
                            num_host_blocks=host_blocks if mode == "swap" else 0)
        cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                              max_model_len=10_000, long_prefill_token_threshold=threshold,
                              policy=policy, preemption_mode=mode, num_lookahead_tokens=lookahead)
        self.sched = Scheduler(cfg, kv)
        self.shadow = ShadowKV(block_size)
        self.park_rate = park_rate
        for args in initial:  # start most runs with a few requests in flight
            self.add(**args)

    @property
    def kv(self) -> KVCacheManager:
        return self.sched.kv

    def _new_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    # -- rules -------------------------------------------------------------------
    @rule(**ADD_ARGS)
    def add(self, length, max_tokens, share, pick, share_frac, align, salt, seed, n, priority):
        """A new prompt: fresh, or an earlier prompt's prefix plus fresh tokens, or an
        exact duplicate of an earlier prompt; optionally cut to whole blocks; with n > 1
        its siblings wait to be forked off it."""
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
        n = min(n, self.sched.config.max_num_seqs)
        reqs = [Request(self._new_id(), prompt, StopRule(max_tokens=max_tokens, eos_token_ids=(EOS,)),
                        cache_salt=salt, priority=priority) for _ in range(n)]
        self.all_reqs += reqs
        self.groups += n > 1
        self.sched.add(reqs[0], reqs[1:])
        assert reqs[0].status is RequestStatus.WAITING and reqs[0].seats == n

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
        assert rid not in self.kv.swapped
        self.aborted.add(rid)

    @rule(pick=st.integers(0, 10**6), tok=st.sampled_from(ALPHABET), kids=st.integers(0, 3),
          extra=st.integers(1, 8))
    def fork_parked(self, pick, tok, kids, extra):
        """Beam-search pattern: fork a parked request into children (its tokens plus one),
        then finish it; with kids == 0 just finish it."""
        if not self.sched.parked:
            return
        parked = list(self.sched.parked.values())
        parent = parked[pick % len(parked)]
        room = self.sched.config.max_num_seqs - sum(r.seats for r in self.sched.running)
        for k in range(min(kids, room)):
            self._fork(parent, parent.output_token_ids + [(tok + k) % 3 + 1], extra)
        self.sched.finish(parent.request_id, RequestStatus.FINISHED_STOPPED)
        self.resolved.add(parent.request_id)

    @rule(pick=st.integers(0, 10**6), tok=st.sampled_from(ALPHABET), extra=st.integers(1, 8))
    def fork_running(self, pick, tok, extra):
        """Fork a generating request into a child that replaces its uncomputed last token."""
        cands = [r for r in self.sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
        room = self.sched.config.max_num_seqs - sum(r.seats for r in self.sched.running)
        if not cands or room < 1:
            return
        parent = cands[pick % len(cands)]
        out = parent.output_token_ids[:parent.num_computed_tokens - parent.num_prompt_tokens] + [tok]
        self._fork(parent, out, extra)

    def _fork(self, parent: Request, output: list[int], extra: int) -> None:
        # Capped so that every request still fits the pool alone.
        max_tokens = min(len(output) + extra, MAX_PROMPT + MAX_TOKENS - parent.num_prompt_tokens)
        if len(output) >= max_tokens:
            return
        child = Request(self._new_id(), parent.prompt_token_ids,
                        StopRule(max_tokens=max_tokens, eos_token_ids=(EOS,)),
                        cache_salt=parent.cache_salt, priority=parent.priority)
        child.output_token_ids = list(output)
        shared = parent.request_id in self.kv.tables
        self.sched.fork(parent, child)
        self.all_reqs.append(child)
        self.forks += 1
        if shared:
            assert child.status is RequestStatus.RUNNING
            assert self.kv.block_ids(child.request_id) == self.kv.block_ids(parent.request_id)[
                :ceil_div(parent.num_computed_tokens, self.kv.block_size)]
        else:
            assert child.status is RequestStatus.WAITING and child.num_computed_tokens == 0

    # -- one step: schedule, check, "run", update ---------------------------------------
    def _step(self, rnd: random.Random, abort_inflight: bool = False, park: bool = True):
        sched, kv, S = self.sched, self.kv, self.kv.block_size
        before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
        if self.spec_k:  # drafts for decoding requests, as a proposer would set them
            for r in sched.running:
                if r.num_pending == 0 and r.num_computed_tokens == r.num_tokens - 1 and rnd.random() < 0.7:
                    pool = ALPHABET + (EOS,) if rnd.random() < 0.1 else ALPHABET
                    r.spec_token_ids = [rnd.choice(pool) for _ in range(rnd.randint(1, self.spec_k))]
        out = sched.schedule()
        self.last_out = out
        cfg = sched.config
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        rows = len(out.scheduled) + sum(len(s.fork_ids) for s in out.scheduled)
        assert rows <= cfg.max_num_seqs
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert not set(ids) & set(out.preempted)
        if sched.running or len(sched.waiting):
            assert out.scheduled, "live requests but nothing scheduled: the scheduler stalled"
        for rid in out.preempted:
            r = sched.requests[rid]
            assert r.status is RequestStatus.PREEMPTED and rid not in kv.tables and r in sched.waiting
            assert r.num_computed_tokens == 0 or rid in kv.swapped
        assert len(out.copies) <= len(out.scheduled)
        self.shadow.apply_ops(out)  # the engine runs the page moves before the forward pass
        self.moves["copies"] += len(out.copies)
        self.moves["swap-ins"] += len(out.swap_in)
        for s in out.scheduled:
            req = sched.requests[s.request_id]
            assert req.status is RequestStatus.RUNNING
            n = len(s.token_ids)
            k = len(s.spec_token_ids)
            assert n >= 1 and k <= self.spec_k
            if k:  # drafts never run past max_tokens or the context
                assert len(req.output_token_ids) + k + 1 <= req.stop.max_tokens
                assert req.num_tokens + k + 1 <= cfg.max_model_len
            # start_pos is the old counter, or past it by whole prefix-hit blocks
            # for a newly admitted request; the counter already includes the chunk
            if before[s.request_id] > 0:
                assert s.start_pos == before[s.request_id]
            else:
                assert s.start_pos % S == 0
            assert req.num_computed_tokens == s.start_pos + n
            assert req.num_pending == int(s.sample) * (1 + k)  # drafts counted as if accepted
            assert s.token_ids == req.all_token_ids[s.start_pos:s.start_pos + n - k] + s.spec_token_ids
            assert s.sample == (s.start_pos + n - k == req.num_tokens)
            assert not k or s.sample
            assert s.fork_ids == ([f.request_id for f in req.pending_forks] if s.sample else [])
            assert s.block_ids == kv.block_ids(s.request_id)
            look = cfg.num_lookahead_tokens
            assert ceil_div(s.start_pos + n, S) <= len(s.block_ids) <= ceil_div(s.start_pos + n + look, S)
            self.shadow.check_and_write(kv, req, s.block_ids, s.start_pos, n - k, s.spec_token_ids)
        if abort_inflight and out.scheduled:
            rid = rnd.choice(ids)
            sched.finish(rid, RequestStatus.FINISHED_ABORTED)
            self.aborted.add(rid)
        sampled, lens = {}, {}
        for s in out.scheduled:
            if s.sample:
                for rid in [s.request_id, *s.fork_ids]:
                    if not park or rnd.random() >= self.park_rate:
                        sampled[rid] = EOS if rnd.random() < 0.05 else rnd.choice(ALPHABET)
            if s.spec_token_ids and s.request_id in sampled:  # accept a random prefix
                a = rnd.randint(0, len(s.spec_token_ids))
                sampled[s.request_id] = s.spec_token_ids[:a] + [sampled[s.request_id]]
                req = sched.requests.get(s.request_id)
                if req is not None:
                    lens[s.request_id] = (len(req.output_token_ids), s.start_pos + len(s.token_ids)
                                          - len(s.spec_token_ids) + a)
                self.spec_steps += 1
                self.rollbacks += a < len(s.spec_token_ids)
        touched = sched.update(out, sampled)
        for req in touched:
            got = sampled[req.request_id]
            if isinstance(got, list):  # appended up to the first stop, the rest dropped
                n0, nc = lens[req.request_id]
                new = req.output_token_ids[n0:]
                assert new == got[:len(new)] and new
                assert len(new) == len(got) or req.finished
                if not req.finished:
                    assert req.num_computed_tokens == nc == req.num_tokens - 1
                    assert req.output_token_ids[-1] == got[-1]
                continue
            assert req.output_token_ids[-1] == got
            if req.finished:
                assert req.request_id not in sched.requests
                assert req.request_id not in kv.tables
        return out

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def block_accounting(self):
        if self.sched is not None:
            check_block_accounting(self.kv)

    @invariant()
    def request_state(self):
        if self.sched is None:
            return
        check_request_state(self.sched)
        S = self.kv.block_size
        for r in self.sched.running:  # every full cached block matches this request's tokens
            keys = self.shadow.prefix_keys(r, r.num_computed_tokens)
            for i, b in enumerate(self.kv.tables[r.request_id]):
                if b.block_hash is not None:
                    assert (i + 1) * S <= r.num_computed_tokens
                    assert self.shadow.slots[(b.block_id, S - 1)] == (r.cache_salt, keys[(i + 1) * S - 1])

    @invariant()
    def last_step_within_limits(self):
        out = self.last_out
        if out is not None:
            assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
            assert len(out.scheduled) <= self.sched.config.max_num_seqs

    # -- teardown: drain -------------------------------------------------------------------
    def teardown(self):
        if self.sched is None:
            return
        rnd = random.Random(0)
        # Generous bound: every request fits the pool alone, so each step makes progress.
        limit = 50 + sum(r.num_tokens + r.stop.max_tokens for r in self.all_reqs) * 4
        steps = 0
        while self.sched.has_unfinished():
            for rid in list(self.sched.parked):
                self.sched.finish(rid, RequestStatus.FINISHED_STOPPED)
                self.resolved.add(rid)
            if not self.sched.has_unfinished():
                break
            self._step(rnd, park=False)
            self.block_accounting()
            self.request_state()
            steps += 1
            assert steps <= limit, f"did not drain in {limit} steps: {self.sched.requests.keys()}"
        assert not self.sched.running and not self.sched.waiting and not self.sched.parked
        assert self.kv.tables == {} and self.kv.swapped == {}
        cfg = self.sched.config
        event(f"{cfg.policy}, {cfg.preemption_mode}, prefix caching {self.kv.enable_prefix_caching}")
        event(f"preemptions: {'none' if not self.sched.num_preemptions else 'some'}")
        event(f"swaps: {'none' if not self.sched.num_swapped_out else 'some'}")
        event(f"prefix hits: {'none' if not self.kv.prefix_hits else 'some'}")
        event(f"public forks: {'none' if not self.forks else 'some'}")
        event(f"n>1 arrivals: {'none' if not self.groups else 'some'}")
        event(f"speculative steps: {'none' if not self.spec_steps else 'some'}")
        event(f"draft rollbacks: {'none' if not self.rollbacks else 'some'}")
        for kind, n in self.moves.items():
            event(f"{kind}: {'none' if not n else 'some'}")
        pool = self.kv.pool
        assert pool.num_free == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        self.kv.begin_step()
        assert self.kv.host.num_free == self.kv.host.num_blocks
        for r in self.all_reqs:
            assert r.finished
            if r.request_id in self.aborted:
                assert r.status is RequestStatus.FINISHED_ABORTED
            elif r.request_id in self.resolved:
                assert r.status is RequestStatus.FINISHED_STOPPED
            elif r.status is RequestStatus.FINISHED_STOPPED:
                assert r.output_token_ids[-1] == EOS
                assert len(r.output_token_ids) <= r.stop.max_tokens
            else:
                assert r.status is RequestStatus.FINISHED_LENGTH
                assert len(r.output_token_ids) == r.stop.max_tokens


RuntimeMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRuntimeStateMachine = RuntimeMachine.TestCase
