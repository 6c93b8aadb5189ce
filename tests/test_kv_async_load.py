"""Asynchronous host-tier loads (vLLM's load_kv_async): a request whose KV is loading waits
in WAITING_FOR_REMOTE_KVS while the batch runs on; a slow load (its copies held back by a
gate) stalls nobody, the output is the recomputed one, and an abort while loading frees
everything and cancels the load before its blocks are reused.
"""

import threading
import time

import numpy as np
import pytest

from kv_tiny import GREEDY, gib, make, rand, run1

from jaxllm.engine.kv_ops import to_numpy
from jaxllm.runtime.request import RequestStatus
from jaxllm.runtime.kv_cache_manager import block_hash

A, B, C, D, X = rand(300, 11), rand(300, 12), rand(300, 13), rand(300, 15), rand(20, 14)


@pytest.fixture(scope="module")
def want():
    ref = make(enable_prefix_caching=False)
    return {k: run1(ref, p).outputs[0].token_ids for k, p in dict(A=A, B=B, C=C, D=D, X=X).items()}


@pytest.fixture(scope="module")
def llm():
    return make(kv_offload_cpu_gib=gib(64))


@pytest.fixture
def gate(llm):
    """Holds every async load's copies back while cleared (the injected delay)."""
    conn = llm.engine.connector
    g, done = threading.Event(), conn._load_done
    g.set()
    conn._load_done = lambda p: g.is_set() and done(p)
    yield g
    g.set()
    conn._load_done = done


def keys(prompt, n):
    out = []
    for i in range(n):
        out.append(block_hash(out[-1] if out else None, prompt[i * 16:(i + 1) * 16], None))
    return out


def device_is_host(llm, prompt, n):
    """The device blocks the prefix cache holds for prompt's first n full blocks hold the
    bytes of their host-tier copies (the output of a tiny random model is a weak witness)."""
    e, conn = llm.engine, llm.engine.connector
    pages = np.asarray(e.runner.kv_pages)
    for k in keys(prompt, n):
        b = e.kv.pool.lookup(k)
        h = conn.host.get(k)  # numpy, a pinned array, or a row of a pinned chunk (kv_ops.ChunkRow)
        h = None if h is None else to_numpy(h)
        if b is None or h is None or not np.array_equal(pages[:, :, :, b.block_id], h):
            return False
    return True


def idle(llm):
    e, conn = llm.engine, llm.engine.connector
    return (e.kv.num_free_blocks == e.runner.num_blocks and not e.scheduler.loading
            and not conn.host.num_pinned and not conn._inflight and not conn._pending)


def drive(e, until, limit=5000):
    """Step until `until()`; returns {request id: its outputs' token ids so far}."""
    toks = {}
    for _ in range(limit):
        if until():
            return toks
        for o in e.step():
            toks[o.request_id] = o.outputs[0].token_ids
    raise AssertionError("the engine made no progress")


def test_slow_load_does_not_stall_the_batch(llm, gate, want):
    e, conn = llm.engine, llm.engine.connector
    assert conn.load_async
    for p in (A, B):  # B evicts (most of) A from the device; A waits in the host tier
        run1(llm, p)
    gate.clear()
    e.add_request("x", X, GREEDY)
    e.add_request("a", A, GREEDY)
    req = e.scheduler.requests["a"]
    toks = drive(e, lambda: "x" not in e.scheduler.requests)
    assert toks["x"] == want["X"]  # x ran to its end while a's load was held back
    assert "a" not in toks and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert e.scheduler.loading == {"a": req} and len(conn._pending) == 1
    hit = req.num_computed_tokens  # the device prefix hits only, so far
    assert hit % 16 == 0 and hit < 288
    # Loaded blocks are offered to the prefix cache only once they hold their KV.
    assert e.kv.pool.lookup(keys(A, 18)[-1]) is None
    gate.set()
    toks.update(drive(e, lambda: not e.has_unfinished_requests()))
    assert toks["a"] == want["A"]
    st = llm.stats()
    assert st["kv_offload_loads_in_flight"] == 0 and st["external_prefix_cache_hits"] >= 288 - hit
    e.flush()
    assert idle(llm)
    assert device_is_host(llm, A, 18)
    assert e.kv_ops.num_compiled() == llm.kv_compiled


@pytest.fixture
def copy_gate(llm):
    """Holds every async load's copies back on the watcher thread while cleared: the copies
    count as done (and the engine is woken) only once it is set."""
    conn = llm.engine.connector
    g, wait = threading.Event(), conn._wait_copies
    g.set()
    conn._wait_copies = lambda p: (g.wait(), wait(p))
    yield g
    g.set()
    conn._wait_copies = wait


def until_copied(conn):
    for _ in range(10000):
        if conn._pending and all(p.copied is not None for p in conn._pending.values()):
            return
        time.sleep(0.001)
    raise AssertionError("the watcher never saw the copies done")


def test_restored_request_runs_in_the_step_after_its_copies(llm, copy_gate, want):
    """With a batch running, a request whose copies are done is scheduled by the very next
    step (its blocks written before that step's forward), not after the worker's next look."""
    e, conn = llm.engine, llm.engine.connector
    for p in (A, B):
        run1(llm, p)
    e.flush_kv()
    copy_gate.clear()
    e.add_request("y", rand(20, 16), GREEDY)  # (a prompt the tiers have not seen: no load)
    e.add_request("a", A, GREEDY)
    req = e.scheduler.requests["a"]
    toks = {}
    while len(toks.get("y", ())) < 2:  # y decodes while a's copies are held back
        toks.update({o.request_id: o.outputs[0].token_ids for o in e.step()})
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    copy_gate.set()
    until_copied(conn)
    e.step()
    assert req.status is RequestStatus.RUNNING  # one step after its load completed
    toks.update(drive(e, lambda: not e.has_unfinished_requests()))
    assert toks["a"] == want["A"] and len(toks["y"]) == 8
    e.flush()
    assert idle(llm) and device_is_host(llm, A, 18)
    assert conn.load_log[-1]["request_id"] == "a" and conn.load_log[-1]["blocks"] > 0


def test_an_idle_engine_waits_for_the_copies(llm, copy_gate, want, monkeypatch):
    """Nothing else to run: the step waits for the copies (woken when they are done), it
    neither spins nor sleeps out its timeout."""
    from jaxllm.engine import step_io
    monkeypatch.setattr(step_io, "IDLE_WAIT_S", 30.0)
    e = llm.engine
    for p in (A, B):
        run1(llm, p)
    e.flush_kv()
    copy_gate.clear()
    e.add_request("a", A, GREEDY)
    req = e.scheduler.requests["a"]
    timer = threading.Timer(0.3, copy_gate.set)
    t0, steps = time.perf_counter(), 0
    timer.start()
    while req.status is not RequestStatus.RUNNING and steps < 100:
        e.step()
        steps += 1
    took = time.perf_counter() - t0
    assert steps <= 3 and 0.3 <= took < 10  # admission, the wait woken by the copies, scheduled
    toks = drive(e, lambda: not e.has_unfinished_requests())
    assert toks["a"] == want["A"]
    e.flush()
    assert idle(llm)


def test_abort_while_loading_frees_and_cancels(llm, gate, want):
    e, conn = llm.engine, llm.engine.connector
    for p in (C, A, B):  # C back in the host tier only; A and B evict it from the device
        run1(llm, p)
    gate.clear()
    e.add_request("c", C, GREEDY)
    drive(e, lambda: "c" in conn._inflight and conn._pending)
    assert e.scheduler.requests["c"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    e.abort_request("c")
    assert not e.scheduler.loading and not conn._inflight
    e.flush()
    assert e.kv.num_free_blocks == e.runner.num_blocks and not conn.host.num_pinned
    # A new prompt takes the freed blocks; the cancelled copies, let through now, must not land
    # in them (D's second run reads them back as device prefix hits).
    e.add_request("d", D, GREEDY)
    toks = drive(e, lambda: e.scheduler.requests["d"].num_computed_tokens >= 300)
    e.flush()  # (the step in flight read: the worker is done with it)
    assert not conn._pending  # the cancel reached the worker with the step after the abort
    gate.set()
    toks.update(drive(e, lambda: not e.has_unfinished_requests()))
    assert toks["d"] == want["D"]
    e.flush_kv()
    assert idle(llm) and device_is_host(llm, D, 18)
    out = run1(llm, D)
    assert out.outputs[0].token_ids == want["D"] and out.num_cached_tokens == 288
    assert run1(llm, C).outputs[0].token_ids == want["C"]  # C still loads fine afterwards


def test_inline_loads_still_work(want):
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_gib": gib(48), "load_async": False}}
    inline = make(kv_transfer_config=cfg)
    for name, p in (("A", A), ("B", B)):
        assert run1(inline, p).outputs[0].token_ids == want[name]
    out = run1(inline, A)
    assert out.outputs[0].token_ids == want["A"] and out.num_cached_tokens == 288
    assert not inline.engine.connector.load_async and idle(inline)


class SlowConnector:
    """Scheduler side only: every request's first 16 prompt tokens load asynchronously,
    reported done when the test says so."""

    def __init__(self):
        self.ready, self.allocs = set(), []

    def get_num_new_matched_tokens(self, req, done):
        return (16, True) if done == 0 and req.num_tokens > 16 else (0, False)

    def update_state_after_alloc(self, req, block_ids, n):
        self.allocs.append((req.request_id, n))

    def build_connector_meta(self):
        return None

    def request_finished(self, req, block_ids):
        return False, None

    def request_preempted(self, req, block_ids):
        pass

    def get_finished(self):
        ready, self.ready = self.ready, set()
        return set(), ready


def test_a_loaded_request_never_blocks_the_queue():
    """W is loaded while the pool runs dry under R: W's blocks are taken back (they stay in
    the prefix cache) instead of R being preempted behind it for good."""
    from jaxllm.runtime.kv_cache_manager import KVCacheManager
    from jaxllm.runtime.request import Request, StopRule
    from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(10, 4)
    conn = SlowConnector()
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64), kv, conn)
    R = Request("r", list(range(1, 9)), StopRule(max_tokens=28))  # 9 of the 10 blocks, at the end
    W = Request("w", list(range(20, 40)), StopRule(max_tokens=2))
    sched.add(R)
    for i in range(200):
        if i == 1:
            sched.add(W)
        if W.status is RequestStatus.WAITING_FOR_REMOTE_KVS and kv.num_free_blocks == 0:
            conn.ready.add("w")
        elif i > 1 and "w" in sched.loading and R.finished:
            conn.ready.add("w")
        out = sched.schedule()
        sched.update(out, {s.request_id: 5 for s in out.scheduled if s.sample})
        if not sched.has_unfinished():
            break
    assert R.finished and W.finished and len(W.output_token_ids) == 2
    assert ("w", 16) in conn.allocs and kv.num_free_blocks == 10 and not sched._holding


def test_abort_of_a_loaded_waiting_request():
    """W's load is done but its seat is taken: it waits holding its blocks; an abort frees them."""
    from jaxllm.runtime.kv_cache_manager import KVCacheManager
    from jaxllm.runtime.request import Request, StopRule
    from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(16, 4)
    conn = SlowConnector()
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=64), kv, conn)
    W = Request("w", list(range(20, 40)), StopRule(max_tokens=2))
    N = Request("n", [1, 2, 3], StopRule(max_tokens=8))
    sched.add(W)
    sched.schedule()  # W gets 4 blocks and waits for its load (no seat taken)
    assert W.status is RequestStatus.WAITING_FOR_REMOTE_KVS and kv.num_free_blocks == 12
    sched.add(N)
    out = sched.schedule()  # N takes the one seat
    assert [s.request_id for s in out.scheduled] == ["n"]
    conn.ready.add("w")
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["n"] and "w" in sched._holding
    assert W.num_computed_tokens == 16 and kv.pool.lookup(kv.block_hashes(W, 4)[-1]) is not None
    sched.finish("w", RequestStatus.FINISHED_ABORTED)
    assert not sched._holding and len(sched.waiting) == 0 and "w" not in kv.tables
    sched.finish("n", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 16 and not sched.has_unfinished()
