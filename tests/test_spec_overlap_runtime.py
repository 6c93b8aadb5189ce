"""Overlapped speculative steps at the runtime level: scheduler + KV manager + a simulated device.

The engine schedules step N+1 before it reads step N (async scheduling); a request verifying
drafts in step N is counted as if every draft were accepted, and the device moves step N+1 back
over the drafts step N rejected (jaxllm/spec/shift.py). Here a seeded random loop plays that
protocol with a deterministic "model" (each token a function of the prefix before it, so greedy
output is known), drafts that are partly right, a pool small enough to preempt (recompute or
swap), and prefix caching with shared prompts. A shadow of the KV pages (tests/runtime_shadow.py)
replays every step's writes at the device's corrected positions and its page moves, and before
each step checks that every scheduled request's table holds its own true tokens' K/V for every
position it attends to; block accounting after every step; nothing leaks at the end."""

from __future__ import annotations

import random

import pytest

from runtime_shadow import ShadowKV, ceil_div, check_block_accounting

from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.request import Request, StopRule
from jaxllm.runtime.scheduler import PLACEHOLDER, Scheduler, SchedulerConfig

ALPHABET = 5


def _next(prefix: tuple[int, ...]) -> int:
    """The model: greedy next token of a prefix."""
    return hash(prefix) % ALPHABET + 1


class _Truth:
    """Each request's true token sequence (prompt, then greedy tokens), grown on demand."""

    def __init__(self):
        self.seqs: dict[str, list[int]] = {}

    def add(self, rid: str, prompt: list[int]):
        self.seqs[rid] = list(prompt)

    def at(self, rid: str, p: int) -> int:
        seq = self.seqs[rid]
        while len(seq) <= p:
            seq.append(_next(tuple(seq)))
        return seq[p]


def _keys(truth: _Truth, rid: str, n: int) -> list[int]:
    keys, k = [], None
    for p in range(n):
        k = hash((k, truth.at(rid, p)))
        keys.append(k)
    return keys


def _run(seed: int, mode: str, prefix: bool, k: int) -> dict:
    rnd = random.Random(seed)
    S = 4
    kv = KVCacheManager(40, S, enable_prefix_caching=prefix, num_host_blocks=24 if mode == "swap" else 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=10_000,
                                      preemption_mode=mode), kv)
    shadow, truth = ShadowKV(S), _Truth()
    base = [rnd.randint(1, ALPHABET) for _ in range(40)]
    reqs = {}
    for i in range(10):
        cut = rnd.choice([0, 8, 13, 24])
        prompt = base[:cut] + [rnd.randint(1, ALPHABET) for _ in range(rnd.randint(1, 30))]
        r = Request(f"r{i}", prompt, StopRule(max_tokens=rnd.randint(4, 40)))
        reqs[r.request_id] = r
        truth.add(r.request_id, prompt)
        sched.add(r)
    stats = {"shifted": 0, "accepted": 0, "rejected": 0, "steps": 0}
    inflight = None  # (out, {rid: sampled}, {rid: rejected drafts}) of the step the host has not read

    def propose():
        """Drafts for decoding requests: the true continuation after the tokens counted so far
        (in flight included, as if its drafts were all accepted), cut short or corrupted at random."""
        for r in sched.running:
            if r.pending_forks or rnd.random() < 0.2:
                continue
            start = r.num_tokens + r.num_pending  # the next token the host will schedule
            if r.num_computed_tokens != start - 1:  # (mid-prompt)
                continue
            d = [truth.at(r.request_id, start + j) for j in range(rnd.randint(1, k))]
            if rnd.random() < 0.5:
                j = rnd.randrange(len(d))
                d[j] = d[j] % ALPHABET + 1  # wrong from here on
            r.spec_token_ids = d

    for _ in range(2000):
        if not sched.has_unfinished() and inflight is None:
            break
        out = sched.schedule()
        shadow.apply_ops(out)
        # The device runs `out` now, after the step in flight (in submission order).
        prev_sampled, prev_shift = (inflight[1], inflight[2]) if inflight else ({}, {})
        sampled, shift = {}, {}
        for s in out.scheduled:
            rid, n, d = s.request_id, len(s.token_ids), len(s.spec_token_ids)
            back = prev_shift.get(rid, 0)
            start = s.start_pos - back  # the corrected position of its first token
            stats["shifted"] += back > 0
            fed = list(s.token_ids)
            if fed[0] == PLACEHOLDER:  # the token the step in flight sampled after its accepted drafts
                got = prev_sampled[rid]
                fed[0] = got[-1] if isinstance(got, list) else got
            assert PLACEHOLDER not in fed[1:]
            assert ceil_div(start + n, S) <= len(s.block_ids), "no block for a corrected position"
            keys = _keys(truth, rid, start + n - d)
            for p in range(start):  # what the request attends to: its own true K/V
                assert shadow.slots.get((s.block_ids[p // S], p % S)) == (None, keys[p]), \
                    f"seed {seed}: {rid} reads wrong K/V at {p}"
            for j, t in enumerate(fed[:n - d]):  # known tokens (and the placeholder) are the truth
                assert t == truth.at(rid, start + j), f"seed {seed}: {rid} fed a wrong token at {start + j}"
            key = keys[start - 1] if start else None
            for j, t in enumerate(fed):
                key = keys[start + j] if j < n - d else hash((key, t))
                blk = kv.pool.blocks[s.block_ids[(start + j) // S]]
                if j >= n - d:
                    assert blk.block_hash is None, "a draft written into a cached block"
                shadow.slots[(blk.block_id, (start + j) % S)] = (None, key)
            if s.sample:
                end = start + n - d  # tokens before the drafts
                a = 0
                while a < d and s.spec_token_ids[a] == truth.at(rid, end + a):
                    a += 1
                bonus = truth.at(rid, end + a)
                sampled[rid] = s.spec_token_ids[:a] + [bonus] if d else bonus
                if d:
                    shift[rid] = d - a
                    stats["accepted"] += a
                    stats["rejected"] += d - a
        stats["steps"] += 1
        # The host reads the step in flight only now (overlapped), then proposes.
        if inflight is not None:
            sched.update(inflight[0], inflight[1])
            check_block_accounting(kv)
        inflight = (out, sampled, shift) if out.scheduled else None
        propose()
    assert not sched.has_unfinished(), f"seed {seed}: did not finish"
    for r in reqs.values():  # every output is the greedy truth
        assert r.all_token_ids == truth.seqs[r.request_id][:r.num_tokens], f"seed {seed}: {r.request_id}"
        assert len(r.output_token_ids) == r.stop.max_tokens
    check_block_accounting(kv)
    assert kv.num_free_blocks == 40 and not kv.tables
    return stats | {"preemptions": sched.num_preemptions, "hits": kv.prefix_hits}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix", [True, False])
def test_overlapped_speculative_steps_keep_the_kv_right(mode, prefix):
    totals = {}
    for seed in range(12):
        for key, v in _run(seed, mode, prefix, k=3).items():
            totals[key] = totals.get(key, 0) + v
    # the protocol was exercised: moved steps, partial acceptance, preemption, prefix hits
    assert totals["shifted"] > 50 and totals["accepted"] > 50 and totals["rejected"] > 50
    assert totals["preemptions"] > 0
    assert (totals["hits"] > 0) == prefix
