"""Host runtime: request, block pool, KV cache manager and scheduler (pure Python).

The scheduler is driven by hand: `schedule()`, then `update(out, {rid: token})`
with fake sampled tokens, exactly as the engine would after running the step.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from jaxllm.runtime.block_pool import Block, BlockPool, FreeQueue
from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.request import Request, RequestStatus, StopRule
from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig

EOS = 0


# -- helpers -------------------------------------------------------------------

def make_req(rid: str, prompt, max_tokens: int = 16, salt: str | None = None,
             eos: tuple[int, ...] = (EOS,)) -> Request:
    return Request(rid, list(prompt), StopRule(max_tokens=max_tokens, eos_token_ids=eos),
                   cache_salt=salt)


def make_sched(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
               budget: int = 64, prefix: bool = True, max_model_len: int = 4096,
               threshold: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, long_prefill_token_threshold=threshold)
    return Scheduler(cfg, kv)


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sched.update(out, {s.request_id: token for s in out.scheduled if s.sample})
    return out


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def compute(kv: KVCacheManager, req: Request, n: int, hits=()) -> list[Block]:
    """Allocate n new tokens for req, mark them computed and cache full blocks."""
    assert kv.allocate_slots(req, n, hits) is not None
    req.num_computed_tokens += len(hits) * kv.block_size + n
    kv.cache_full_blocks(req)
    return kv.tables[req.request_id]


# -- (a) no jax on the host runtime's import path -----------------------------

def test_runtime_import_does_not_pull_in_jax_or_flax() -> None:
    code = textwrap.dedent("""
        import sys
        import jaxllm.runtime
        import jaxllm.runtime.request, jaxllm.runtime.block_pool
        import jaxllm.runtime.kv_cache_manager, jaxllm.runtime.scheduler
        bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))
        print(repr(bad))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"runtime import pulled in {res.stdout.strip()}"


# -- (b) BlockPool ---------------------------------------------------------------

def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_from_front_with_ref_one() -> None:
    pool = BlockPool(5)
    got = pool.allocate(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free == 2 and free_ids(pool) == [3, 4]


def test_allocate_short_returns_none_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    before = free_ids(pool)
    assert pool.allocate(3) is None
    assert pool.num_free == 2 and free_ids(pool) == before
    assert all(pool.blocks[i].ref_cnt == 0 for i in before)
    assert pool.allocate(0) == []


def test_release_to_zero_returns_blocks_shared_block_stays() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.touch(a[0])  # a second owner of block 0
    assert a[0].ref_cnt == 2
    pool.release(a)
    assert a[0].ref_cnt == 1 and a[1].ref_cnt == 0
    assert free_ids(pool) == [2, 3, 1]
    pool.release([a[0]])
    assert a[0].ref_cnt == 0 and free_ids(pool) == [2, 3, 1, 0]
    assert pool.num_free == 4


def test_double_release_raises() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError):
        pool.release([b])


def test_free_queue_is_lru_and_release_puts_tail_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # 0 1 2
    b = pool.allocate(2)  # 3 4
    assert free_ids(pool) == [5]
    pool.release(b)  # reversed: 4 then 3
    pool.release(a)  # reversed: 2 1 0
    assert free_ids(pool) == [5, 4, 3, 2, 1, 0]
    # the least recently freed block goes first
    assert [x.block_id for x in pool.allocate(3)] == [5, 4, 3]
    assert free_ids(pool) == [2, 1, 0]


def test_touch_of_free_cached_block_removes_it_from_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    pool.cache(blocks[2], 1234)
    pool.release(blocks)  # queue: 4 3 2 1 0
    assert pool.lookup(1234) is blocks[2]
    pool.touch(blocks[2])
    assert blocks[2].ref_cnt == 1
    assert free_ids(pool) == [4, 3, 1, 0] and pool.num_free == 4
    assert blocks[2].prev is None and blocks[2].next is None
    # neighbours are linked both ways
    assert blocks[3].next is blocks[1] and blocks[1].prev is blocks[3]
    # still cached while in use; allocation never hands it out
    assert pool.lookup(1234) is blocks[2]
    got = pool.allocate(4)
    assert blocks[2] not in got and pool.allocate(1) is None
    pool.touch(blocks[2])  # touch of a used block does not touch the queue
    assert blocks[2].ref_cnt == 2 and pool.num_free == 0


def _lines_executed(fn) -> int:
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    # A collection during `fn` runs other objects' finalizers (earlier tests' engines, executors)
    # under the tracer and counts their lines: collect first and keep the collector off meanwhile.
    gc.collect()
    gc.disable()
    old = sys.gettrace()  # e.g. a coverage tracer: put it back afterwards
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(old)
        gc.enable()
    return count


def test_touch_from_middle_of_queue_is_constant_work(monkeypatch) -> None:
    """Removing a block from the middle of the free queue costs the same at any size."""
    def forbid_iter(self):
        raise AssertionError("touch must not walk the free queue")

    monkeypatch.setattr(FreeQueue, "__iter__", forbid_iter)
    counts = []
    for n in (10, 20_000):
        pool = BlockPool(n)
        mid = pool.blocks[n // 2]
        counts.append(_lines_executed(lambda: pool.touch(mid)))
        assert mid.ref_cnt == 1 and pool.num_free == n - 1
        assert pool.blocks[n // 2 - 1].next is pool.blocks[n // 2 + 1]
        assert pool.blocks[n // 2 + 1].prev is pool.blocks[n // 2 - 1]
    assert counts[0] == counts[1] < 20, counts


def test_eviction_drops_hash_of_reused_free_block() -> None:
    pool = BlockPool(2)
    a = pool.allocate(2)
    pool.cache(a[0], 11)
    pool.cache(a[1], 22)
    pool.release(a)  # queue: 1 0
    (x,) = pool.allocate(1)
    assert x is a[1] and x.block_hash is None
    assert pool.lookup(22) is None and pool.lookup(11) is a[0]


def test_cache_first_writer_wins() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, 5)
    pool.cache(b, 5)
    assert pool.lookup(5) is a and b.block_hash is None
    pool.cache(a, 6)  # a block keeps its first hash
    assert a.block_hash == 5 and pool.lookup(6) is None


# -- (c) KVCacheManager ------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 16, 17, 33])
def test_allocate_slots_size(block_size: int, n: int) -> None:
    kv = KVCacheManager(64, block_size)
    req = make_req("r", range(1, n + 1))
    new = kv.allocate_slots(req, n)
    assert len(new) == ceil_div(n, block_size)
    assert len(kv.tables["r"]) == ceil_div(n, block_size)
    assert kv.num_free_blocks == 64 - ceil_div(n, block_size)


def test_allocate_slots_grows_incrementally() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    req = make_req("r", range(10))
    assert len(kv.allocate_slots(req, 10)) == 3
    req.num_computed_tokens = 10
    for total in range(11, 30):
        req.output_token_ids.append(1)
        new = kv.allocate_slots(req, 1)
        assert len(new) == (1 if total % 4 == 1 else 0)
        assert len(kv.tables["r"]) == ceil_div(total, 4)
        req.num_computed_tokens = total
    assert kv.block_ids("r") == sorted(set(kv.block_ids("r")))


def test_allocate_slots_short_has_no_side_effects() -> None:
    kv = KVCacheManager(3, 4)
    other = make_req("o", range(4))
    kv.allocate_slots(other, 4)
    req = make_req("r", range(9))  # needs 3 blocks, 2 free
    before = free_ids(kv.pool)
    assert kv.allocate_slots(req, 9) is None
    assert "r" not in kv.tables and kv.block_ids("r") == []
    assert free_ids(kv.pool) == before and kv.num_free_blocks == 2
    # growing a running request that does not fit leaves its table alone
    other.num_computed_tokens = 4
    assert kv.allocate_slots(other, 9) is None
    assert len(kv.tables["o"]) == 1 and kv.num_free_blocks == 2


def test_free_returns_all_blocks() -> None:
    kv = KVCacheManager(10, 4)
    reqs = [make_req(f"r{i}", [i] * 11) for i in range(3)]
    for r in reqs:
        compute(kv, r, 11)
    assert kv.num_free_blocks == 1 and kv.usage == pytest.approx(0.9)
    for r in reqs:
        kv.free(r)
    assert kv.num_free_blocks == 10 and kv.tables == {}
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    kv.free(reqs[0])  # freeing an unknown request is a no-op
    assert kv.num_free_blocks == 10


def test_prefix_hit_returns_shared_full_blocks() -> None:
    kv = KVCacheManager(16, 4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    a = make_req("a", prompt)
    table_a = compute(kv, a, 10)
    b = make_req("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert hits == table_a[:2]  # two full blocks; the third is partial
    new = kv.allocate_slots(b, 2, hits)
    assert len(new) == 1
    assert kv.tables["b"][:2] == table_a[:2] and kv.tables["b"][2] is not table_a[2]
    assert [blk.ref_cnt for blk in table_a] == [2, 2, 1]
    assert kv.prefix_hits == 8 and kv.prefix_queries == 10


@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_prefix_hit_never_covers_last_token(n_blocks: int) -> None:
    kv = KVCacheManager(16, 4)
    prompt = list(range(1, 4 * n_blocks + 1))  # exact multiple of block_size
    a = make_req("a", prompt)
    table_a = compute(kv, a, len(prompt))
    assert all(blk.block_hash is not None for blk in table_a)  # all full, all cached
    b = make_req("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert hits == table_a[: n_blocks - 1]
    assert len(hits) * 4 < b.num_tokens  # at least one token left to compute


def test_prefix_hit_needs_request_without_table_and_caching_on() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    a = make_req("a", range(9))
    compute(kv, a, 9)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_req("b", range(9))) == []
    kv = KVCacheManager(16, 4)
    a = make_req("a", range(9))
    compute(kv, a, 9)
    assert kv.get_computed_blocks(a) == []  # a running request is never re-matched


def test_prefix_chain_stops_at_first_difference() -> None:
    kv = KVCacheManager(16, 4)
    a = make_req("a", list(range(1, 13)) + [99])
    table_a = compute(kv, a, 13)
    b = make_req("b", list(range(1, 5)) + [50, 6, 7, 8] + list(range(9, 13)) + [1])
    assert kv.get_computed_blocks(b) == table_a[:1]  # block 2 equal but its parent differs


def test_prefix_hit_on_freed_blocks_and_salt_isolation() -> None:
    kv = KVCacheManager(16, 4)
    prompt = list(range(20, 29))
    a = make_req("a", prompt, salt="s1")
    table_a = list(compute(kv, a, 9))
    kv.free(a)
    assert all(blk.ref_cnt == 0 for blk in table_a)
    assert kv.get_computed_blocks(make_req("x", prompt, salt="s2")) == []
    assert kv.get_computed_blocks(make_req("y", prompt)) == []
    c = make_req("c", prompt, salt="s1")
    hits = kv.get_computed_blocks(c)
    assert hits == table_a[:2]
    free_before = kv.num_free_blocks
    kv.allocate_slots(c, 1, hits)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert all(blk not in list(kv.pool.free) for blk in hits)
    assert kv.num_free_blocks == free_before - 3


def test_reclaimed_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(3, 4)
    a = make_req("a", range(1, 10))
    table_a = list(compute(kv, a, 9))
    kv.free(a)  # all 3 blocks free, the first two cached
    b = make_req("b", list(range(1, 9)) + [40, 41, 42, 43, 44])  # 13 tokens: 2 hits + 2 new blocks
    hits = kv.get_computed_blocks(b)
    assert hits == table_a[:2]
    before = free_ids(kv.pool)
    assert kv.allocate_slots(b, 5, hits) is None
    assert free_ids(kv.pool) == before and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert "b" not in kv.tables and kv.pool.lookup(table_a[0].block_hash) is table_a[0]
    c = make_req("c", list(range(1, 9)) + [40, 41])  # 10 tokens: 2 hits + 1 new block
    hits = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 2, hits) == [table_a[2]]
    assert kv.num_free_blocks == 0


def test_cached_blocks_evicted_in_lru_order() -> None:
    kv = KVCacheManager(6, 4)
    pa, pb = [1] * 8 + [2], [3] * 8 + [4]
    a, b = make_req("a", pa), make_req("b", pb)
    ta = list(compute(kv, a, 9))  # blocks 0 1 2
    tb = list(compute(kv, b, 9))  # blocks 3 4 5
    kv.free(a)  # queue: 2 1 0
    kv.free(b)  # queue: 2 1 0 5 4 3
    assert free_ids(kv.pool) == [2, 1, 0, 5, 4, 3]
    assert len(kv.pool.cached) == 4  # a's and b's two full blocks each
    c = make_req("c", [9] * 12)
    kv.allocate_slots(c, 12)  # takes 2 (uncached) then evicts 1, then 0
    assert kv.block_ids("c") == [ta[2].block_id, ta[1].block_id, ta[0].block_id]
    assert kv.get_computed_blocks(make_req("a2", pa)) == []
    assert kv.get_computed_blocks(make_req("b2", pb)) == tb[:2]
    d = make_req("d", [8] * 4)
    kv.allocate_slots(d, 4)  # next LRU is b's uncached tail block 5
    assert kv.block_ids("d") == [tb[2].block_id]
    assert kv.get_computed_blocks(make_req("b3", pb)) == tb[:2]
    e = make_req("e", [7] * 4)
    kv.allocate_slots(e, 4)  # evicts b's second block; its first stays reachable
    assert kv.block_ids("e") == [tb[1].block_id]
    assert kv.get_computed_blocks(make_req("b4", pb)) == tb[:1]


def test_lru_refreshed_by_reuse() -> None:
    """A cached block that is hit and freed again moves to the back of the queue."""
    kv = KVCacheManager(4, 4)
    a, b = make_req("a", [1] * 5), make_req("b", [2] * 5)
    ta, tb = list(compute(kv, a, 5)), list(compute(kv, b, 5))
    kv.free(a)
    kv.free(b)  # queue: a1 a0 b1 b0
    a2 = make_req("a2", [1] * 5)
    compute(kv, a2, 1, kv.get_computed_blocks(a2))
    kv.free(a2)  # a0 freed again: now most recent
    assert free_ids(kv.pool)[-1] == ta[0].block_id
    kv.allocate_slots(make_req("z", [5] * 12), 12)
    assert kv.num_free_blocks == 1 and free_ids(kv.pool) == [ta[0].block_id]
    assert kv.get_computed_blocks(make_req("a3", [1] * 5)) == ta[:1]
    assert kv.get_computed_blocks(make_req("b3", [2] * 5)) == []
    assert tb[0].block_hash is None


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(8, 4)
    a = make_req("a", range(9))
    compute(kv, a, 9)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.pool.cached == {} and all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(make_req("b", range(9))) == []


def test_decode_registers_each_full_block_once(monkeypatch) -> None:
    """A long running request costs the prefix cache only its newly filled blocks per step
    (rescanning the whole table each step was 14 ms of host time at 64 x 2048 tokens)."""
    sched = make_sched(num_blocks=128, block_size=4, budget=64)
    req = make_req("a", range(1, 41), max_tokens=30)
    sched.add(req)
    step(sched)  # the 40-token prompt: 10 full blocks
    calls = []
    orig = sched.kv.pool.cache
    monkeypatch.setattr(sched.kv.pool, "cache", lambda b, h: (calls.append(b.block_id), orig(b, h)))
    for _ in range(12):  # 12 decode steps fill blocks 10, 11 and 12
        step(sched)
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 3, calls
    assert len(sched.kv.pool.cached) == 13


def test_reset_prefix_cache_reregisters_running_requests() -> None:
    kv = KVCacheManager(16, 4)
    a = make_req("a", range(12))
    compute(kv, a, 9)
    kv.reset_prefix_cache()
    compute(kv, a, 3)  # 12 tokens: all three blocks full, registered again
    assert len(kv.pool.cached) == 3


# -- (d) Scheduler ---------------------------------------------------------------

def test_duplicate_request_id_rejected() -> None:
    sched = make_sched()
    sched.add(make_req("a", [1, 2]))
    with pytest.raises(ValueError):
        sched.add(make_req("a", [3]))


def test_token_budget_and_max_num_seqs_never_exceeded() -> None:
    sched = make_sched(num_blocks=256, budget=24, max_num_seqs=3)
    reqs = [make_req(f"r{i}", [i % 5 + 1] * (5 + 7 * i), max_tokens=4 + i) for i in range(8)]
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_unfinished():
        out = step(sched)
        steps += 1
        assert 0 < out.num_batched_tokens <= 24
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert len(out.scheduled) <= 3 and sched.num_running <= 3
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        assert steps < 500
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert [len(r.output_token_ids) for r in reqs] == [4 + i for i in range(8)]
    assert sched.kv.num_free_blocks == 256


def test_long_prompt_is_chunked() -> None:
    sched = make_sched(budget=10)
    prompt = list(range(1, 26))
    r = make_req("a", prompt, max_tokens=3)
    sched.add(r)
    got = []
    for tok in (100, 101, 102):
        out = step(sched, tok)
        got += [(s.start_pos, s.token_ids, s.sample) for s in out.scheduled]
    assert got == [(0, prompt[0:10], False), (10, prompt[10:20], False), (20, prompt[20:25], True)]
    assert r.output_token_ids == [102] and r.num_computed_tokens == 25
    out = step(sched, 103)
    assert [(s.start_pos, s.token_ids, s.sample) for s in out.scheduled] == [(25, [102], True)]
    out = step(sched, 104)
    assert [(s.start_pos, s.token_ids) for s in out.scheduled] == [(26, [103])]
    assert r.output_token_ids == [102, 103, 104] and r.status is RequestStatus.FINISHED_LENGTH
    assert not sched.has_unfinished()


def test_long_prefill_token_threshold_caps_chunk() -> None:
    sched = make_sched(budget=64, threshold=4)
    sched.add(make_req("a", range(1, 11), max_tokens=1))
    sched.add(make_req("b", range(1, 3), max_tokens=1))
    out = step(sched)
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [
        ("a", 0, 4), ("b", 0, 2)]


def test_block_table_sent_covers_scheduled_tokens() -> None:
    sched = make_sched(block_size=4, budget=7)
    sched.add(make_req("a", range(1, 20), max_tokens=5))
    while sched.has_unfinished():
        out = step(sched)
        for s in out.scheduled:
            assert len(s.block_ids) == ceil_div(s.start_pos + len(s.token_ids), 4)


def test_running_scheduled_before_waiting() -> None:
    sched = make_sched(budget=10)
    sched.add(make_req("a", range(1, 26), max_tokens=2))
    step(sched)  # a: 10 tokens
    sched.add(make_req("b", range(30, 34), max_tokens=2))
    out = step(sched)  # a takes the whole budget, b waits
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 10)]
    assert sched.num_waiting == 1
    out = step(sched)
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [
        ("a", 20, 5), ("b", 0, 4)]
    sched.add(make_req("c", [9], max_tokens=2))
    out = step(sched)  # decode rows of running requests come first, in admission order
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]


def test_prefix_hit_through_scheduler() -> None:
    sched = make_sched(block_size=4)
    prompt = list(range(1, 11))
    a = make_req("a", prompt, max_tokens=5)
    sched.add(a)
    step(sched)
    b = make_req("b", prompt, max_tokens=5)
    sched.add(b)
    out = step(sched)
    sb = [s for s in out.scheduled if s.request_id == "b"][0]
    assert (sb.start_pos, sb.token_ids, sb.sample) == (8, prompt[8:], True)
    assert sb.block_ids[:2] == sched.kv.block_ids("a")[:2]
    assert b.num_cached_tokens == 8
    # exact multiple of block size: the last block is recomputed
    c = make_req("c", prompt[:8], max_tokens=1)
    d = make_req("d", prompt[:8], max_tokens=1, salt="other")
    sched.add(c)
    sched.add(d)
    out = step(sched)
    rows = {s.request_id: s for s in out.scheduled}
    assert (rows["c"].start_pos, rows["c"].token_ids) == (4, prompt[4:8])
    assert (rows["d"].start_pos, rows["d"].token_ids) == (0, prompt[:8])


def test_preemption_of_latest_admitted_and_recovery() -> None:
    # 3 requests of 7 prompt tokens fill 6 blocks of 4; growing to token 9 needs a 3rd block.
    sched = make_sched(num_blocks=6, block_size=4, prefix=False)
    a, b, c = (make_req(x, [i] * 7, max_tokens=6) for i, x in enumerate("abc", 1))
    for r in (a, b, c):
        sched.add(r)
    out = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    assert sched.kv.num_free_blocks == 0
    step(sched)  # token 8 still fits in each second block
    d = make_req("d", [4] * 3, max_tokens=2)
    sched.add(d)  # waiting, behind no one
    assert [r.request_id for r in sched.waiting] == ["d"]
    c_outputs = list(c.output_token_ids)
    out = step(sched)
    # a needs a block: c (last admitted) goes, not a itself; b then fits too
    assert out.preempted == ["c"]
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert "c" not in sched.kv.tables and c not in sched.running
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # head of the queue
    assert c.output_token_ids == c_outputs  # generated tokens survive
    assert sched.kv.num_free_blocks == 0
    resumed = None
    steps = 0
    while sched.has_unfinished():
        out = step(sched)
        steps += 1
        assert steps < 100
        for s in out.scheduled:
            if s.request_id == "c" and resumed is None:
                resumed = s
    assert resumed is not None
    assert resumed.start_pos == 0 and resumed.sample
    assert resumed.token_ids == [3] * 7 + c_outputs
    for r in (a, b, c, d):
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert [len(r.output_token_ids) for r in (a, b, c, d)] == [6, 6, 6, 2]
    assert sched.kv.num_free_blocks == 6
    assert all(blk.ref_cnt == 0 for blk in sched.kv.pool.blocks)


def test_preempted_request_reuses_its_cached_prefix() -> None:
    sched = make_sched(num_blocks=4, block_size=4, prefix=True)
    a, b = make_req("a", [1] * 7, max_tokens=4), make_req("b", [2] * 7, max_tokens=4)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    out = step(sched)
    assert out.preempted == ["b"]
    # b's blocks went back tail first, so a's new block evicted b's second cached
    # block; b's first block (prompt tokens only) stays cached while free.
    assert sched.kv.num_free_blocks == 1
    (kept,) = sched.kv.pool.free
    assert kept.block_hash is not None and kept.ref_cnt == 0
    out = step(sched)  # a finishes; b cannot fit yet (2 new blocks needed, 1 free)
    assert [s.request_id for s in out.scheduled] == ["a"] and a.finished
    out = sched.schedule()
    (sb,) = out.scheduled
    assert sb.request_id == "b" and b.status is RequestStatus.RUNNING
    assert sb.block_ids[0] == kept.block_id and kept.ref_cnt == 1
    assert (sb.start_pos, sb.token_ids, sb.sample) == (4, b.all_token_ids[4:], True)
    assert b.num_cached_tokens == 0  # prefix-cache stats count first admission only
    sched.update(out, {"b": 7})
    while sched.has_unfinished():
        step(sched)
    assert len(b.output_token_ids) == 4 and sched.kv.num_free_blocks == 4


def test_finish_on_eos_and_abort_free_blocks() -> None:
    sched = make_sched(num_blocks=16, block_size=4)
    a = make_req("a", range(1, 10), max_tokens=10)
    b = make_req("b", range(11, 16), max_tokens=10)  # no prefix shared with a
    c = make_req("c", range(1, 4), max_tokens=10)
    for r in (a, b):
        sched.add(r)
    step(sched)
    used_b = len(sched.kv.tables["b"])
    assert sched.kv.num_free_blocks == 16 - 3 - used_b
    out = sched.schedule()
    sched.update(out, {"a": EOS, "b": 5})
    assert a.status is RequestStatus.FINISHED_STOPPED and "a" not in sched.requests
    assert "a" not in sched.kv.tables and sched.kv.num_free_blocks == 16 - used_b
    assert sched.finish("b", RequestStatus.FINISHED_ABORTED) is b
    assert b.status is RequestStatus.FINISHED_ABORTED and b not in sched.running
    assert sched.kv.num_free_blocks == 16
    sched.add(c)  # abort while waiting
    assert sched.finish("c", RequestStatus.FINISHED_ABORTED) is c
    assert not sched.waiting and not sched.has_unfinished()
    assert sched.finish("c", RequestStatus.FINISHED_ABORTED) is None


def test_abort_while_step_runs_is_skipped_by_update() -> None:
    sched = make_sched(num_blocks=8, block_size=4)
    a, b = make_req("a", range(1, 6)), make_req("b", range(1, 3))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    touched = sched.update(out, {"a": 3, "b": 4})
    assert touched == [b] and a.output_token_ids == [] and b.output_token_ids == [4]
    assert sched.kv.num_free_blocks == 8 - 1


def test_min_tokens_and_stop_token_ids() -> None:
    sched = make_sched()
    r = Request("a", [1, 2], StopRule(max_tokens=10, min_tokens=2, eos_token_ids=(EOS,),
                                      stop_token_ids=(9,)))
    sched.add(r)
    step(sched, EOS)  # below min_tokens: ignored
    assert not r.finished
    step(sched, 9)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_max_model_len_finishes_request() -> None:
    sched = make_sched(max_model_len=6)
    r = make_req("a", [1, 2, 3, 4], max_tokens=100)
    sched.add(r)
    while sched.has_unfinished():
        step(sched)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 6


# -- (e) overlapped steps (async scheduling) -------------------------------------

def test_overlapped_steps_feed_placeholders_and_keep_tokens():
    """Step k+1 is scheduled before step k's tokens are known: decode rows feed a
    PLACEHOLDER, counters already include it, and update(k) appends the real token."""
    from jaxllm.runtime.scheduler_output import PLACEHOLDER

    sched = make_sched(num_blocks=64, block_size=4, budget=64)
    a, b = make_req("a", range(1, 6), max_tokens=3), make_req("b", range(1, 8), max_tokens=10)
    sched.add(a), sched.add(b)
    k = sched.schedule()  # both prompts
    assert a.num_computed_tokens == 5 and a.num_pending == 1
    k1 = sched.schedule()  # before update(k)
    assert [s.token_ids for s in k1.scheduled] == [[PLACEHOLDER], [PLACEHOLDER]]
    assert [s.start_pos for s in k1.scheduled] == [5, 7] and all(s.sample for s in k1.scheduled)
    assert a.num_pending == 2 and a.num_computed_tokens == 6
    # b's placeholder fills its second block, but an unknown token has no hash yet
    assert b.num_computed_tokens == 8 and sched.kv._num_cached["b"] == 1
    sched.update(k, {"a": 11, "b": 21})
    assert sched.kv._num_cached["b"] == 2
    assert a.output_token_ids == [11] and a.num_pending == 1
    k2 = sched.schedule()  # a has 1 real + 1 in flight: its third token is the last one
    assert [s.token_ids for s in k2.scheduled] == [[PLACEHOLDER], [PLACEHOLDER]]
    sched.update(k1, {"a": 12, "b": 22})
    k3 = sched.schedule()  # a's max_tokens are all in flight: a is not scheduled again
    assert [s.request_id for s in k3.scheduled] == ["b"]
    sched.update(k2, {"a": 13, "b": 23})
    assert a.finished and a.output_token_ids == [11, 12, 13]
    sched.update(k3, {"b": 24})
    assert b.output_token_ids == [21, 22, 23, 24] and b.num_pending == 0
    assert b.num_computed_tokens == b.num_tokens - 1  # the last token's K/V comes next step


def test_token_of_a_request_preempted_in_flight_is_kept():
    sched = make_sched(num_blocks=6, block_size=4, budget=64, max_num_seqs=2)
    a, b = make_req("a", range(1, 9), max_tokens=20), make_req("b", range(1, 13), max_tokens=20)
    sched.add(a), sched.add(b)
    k = sched.schedule()  # 2 + 3 blocks of 6
    k1 = sched.schedule()  # b's decode needs a 4th block for... a's 3rd: the pool runs dry
    while not k1.preempted:
        sched.update(k, {"a": 5, "b": 6})
        k, k1 = k1, sched.schedule()
    victim = sched.requests[k1.preempted[0]]
    n_out = len(victim.output_token_ids)
    sched.update(k, {"a": 5, "b": 6})  # the step in flight when it was preempted
    assert len(victim.output_token_ids) == n_out + 1 and victim.num_pending == 0
    assert victim.num_computed_tokens == 0 and victim in sched.waiting
