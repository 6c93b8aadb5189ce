"""A shadow of the KV cache for runtime tests: what each device slot and host slot holds.

Every slot written by a step records the token prefix whose K/V it would hold
(and the request's cache salt). The page moves the scheduler emits (swap-outs,
copy-on-write copies, swap-ins) are replayed on the shadow exactly as the
engine runs them, so a test can check before every step that a request's
block table holds exactly its own tokens for every position it attends to.
"""

from __future__ import annotations

from collections import Counter

from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.request import Request, RequestStatus
from jaxllm.runtime.scheduler import Scheduler, SchedulerOutput


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ShadowKV:
    def __init__(self, block_size: int):
        self.S = block_size
        self.slots: dict[tuple[int, int], tuple] = {}  # (block id, offset) -> (salt, prefix key)
        self.host: dict[int, dict[int, tuple]] = {}  # host slot -> offset -> (salt, prefix key)
        self.keys: dict[str, list[int]] = {}  # request id -> chained key of each token prefix

    def prefix_keys(self, req: Request, n: int) -> list[int]:
        """keys[p] names the token prefix [0, p]; equal keys mean equal prefixes."""
        keys = self.keys.setdefault(req.request_id, [])
        if len(keys) > n:
            return keys
        toks = req.all_token_ids
        while len(keys) < n:
            keys.append(hash((keys[-1] if keys else None, toks[len(keys)])))
        return keys

    def _block(self, block: int) -> dict[int, tuple]:
        return {o: self.slots[(block, o)] for o in range(self.S) if (block, o) in self.slots}

    def apply_ops(self, out: SchedulerOutput) -> None:
        """Replay the step's page moves in engine order; copies read pre-copy pages."""
        for dev, host in out.swap_out:
            self.host[host] = self._block(dev)
        reads = [(dst, self._block(src)) for src, dst in out.copies]
        for dst, content in reads + [(dev, self.host.get(h, {})) for h, dev in out.swap_in]:
            for o in range(self.S):
                self.slots.pop((dst, o), None)
            for o, v in content.items():
                self.slots[(dst, o)] = v

    def check_and_write(self, kv: KVCacheManager, req: Request, block_ids: list[int],
                        start: int, n: int, drafts: list[int] = ()) -> None:
        """The table holds req's own K/V for [0, start); then write [start, start + n) and
        the draft tokens after them (K/V of the prefix the drafts extend, right or not)."""
        S = self.S
        keys = self.prefix_keys(req, start + n)
        draft_keys = []
        for t in drafts:
            draft_keys.append(hash((draft_keys[-1] if draft_keys else keys[start + n - 1], t)))
        for j, key in enumerate(draft_keys):
            p = start + n + j
            blk = kv.pool.blocks[block_ids[p // S]]
            assert blk.block_hash is None and blk.ref_cnt == 1, "a draft written into a shared block"
            self.slots[(blk.block_id, p % S)] = (req.cache_salt, key)
        for p in range(start):
            got = self.slots.get((block_ids[p // S], p % S))
            assert got == (req.cache_salt, keys[p]), f"{req.request_id}: wrong K/V at position {p}"
        for p in range(start, start + n):
            i = p // S
            blk = kv.pool.blocks[block_ids[i]]
            if blk.ref_cnt > 1 or blk.block_hash is not None:
                # Only a block this very chunk fills may be cached (and then shared
                # by requests admitted after it in the same step): under its own hash.
                assert (i + 1) * S <= start + n, "writing into a shared or cached block"
                assert blk.block_hash == kv._hashes[req.request_id][i], "writing into a foreign block"
            self.slots[(blk.block_id, p % S)] = (req.cache_salt, keys[p])


def check_block_accounting(kv: KVCacheManager) -> None:
    """Ref counts equal table holders, the free queue is consistent, host slots add up."""
    pool = kv.pool
    holders = Counter()
    for rid, table in kv.tables.items():
        ids = [b.block_id for b in table]
        assert len(set(ids)) == len(ids), f"{rid} holds a block twice"
        holders.update(ids)
    for b in pool.blocks:
        assert b.ref_cnt == holders[b.block_id], (
            f"block {b.block_id}: ref_cnt {b.ref_cnt}, held by {holders[b.block_id]} tables")
    fwd = list(pool.free)
    back, node = [], pool.free.tail.prev
    while node is not pool.free.head:
        back.append(node)
        node = node.prev
    assert back[::-1] == fwd and len(fwd) == len(pool.free) == pool.num_free
    free_set = {b.block_id for b in fwd}
    assert len(free_set) == len(fwd)
    assert free_set == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for h, b in pool.cached.items():
        assert b.block_hash == h
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached)
    if not kv.enable_prefix_caching:
        assert not pool.cached
    held = [s for slots in kv.swapped.values() for s in slots]
    free = kv.host._free + kv.host._pending
    assert len(set(held)) == len(held) and not set(held) & set(free), "host slot owned twice"
    assert sorted(held + free) == list(range(kv.host.num_blocks)), "host slot leaked"


def check_request_state(sched: Scheduler) -> None:
    """Every live request is in exactly one place, with the blocks that place implies."""
    kv, S = sched.kv, sched.kv.block_size
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    parked = set(sched.parked)
    pending = set(sched._leader_of)
    assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
    groups = [running, waiting, parked, pending]
    assert sum(map(len, groups)) == len(set().union(*groups)), "a request in two places"
    assert set().union(*groups) == set(sched.requests)
    assert set(kv.tables) == running | {p for p in parked if p in kv.tables}
    assert set(kv.swapped) <= waiting
    assert sum(r.seats for r in sched.running) <= sched.config.max_num_seqs
    if sched.config.policy == "priority":
        keys = [r.sort_key for r in sched.running]
        assert keys == sorted(keys), "running not in priority order"
        keys = [r.sort_key for r in sched.waiting]
        assert keys == sorted(keys), "waiting not in priority order"
    look = sched.config.num_lookahead_tokens
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert (ceil_div(r.num_computed_tokens, S) <= len(kv.tables[r.request_id])
                <= ceil_div(r.num_computed_tokens + look, S)), "blocks of rolled-back drafts kept"
        assert 0 < r.num_computed_tokens < r.num_tokens
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if r.request_id in kv.swapped:
            assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens > 0
            assert len(kv.swapped[r.request_id]) == ceil_div(r.num_computed_tokens, S)
        else:
            assert r.num_computed_tokens == 0
        assert all(sched._leader_of[f.request_id] is r for f in r.pending_forks)
    for rid in parked:
        r = sched.parked[rid]
        assert r.status is RequestStatus.PARKED and r.num_computed_tokens == r.num_tokens
        if rid in kv.tables:
            assert ceil_div(r.num_computed_tokens, S) <= len(kv.tables[rid]) <= ceil_div(
                r.num_computed_tokens + look, S)
    for rid in pending:
        r, leader = sched.requests[rid], sched._leader_of[rid]
        assert r.num_computed_tokens == 0 and rid not in kv.tables
        assert r in leader.pending_forks and leader.request_id in running | waiting
    for r in sched.requests.values():
        assert not r.finished and len(r.output_token_ids) < r.stop.max_tokens
