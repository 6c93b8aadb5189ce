"""Prefill/decode disaggregation over jax.experimental.transfer (CPU): a producer engine
prefills, a consumer engine pulls its pages and decodes; faults fall back to recompute."""

import time

import pytest

from kv_tiny import gen, make, rand

from jaxllm import SamplingParams
from jaxllm.kv_transfer.jax_transfer import transport_options

A, B, C = rand(300, 1), rand(200, 5), rand(200, 6)


def conf(role, **extra):
    return {"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def engines():
    ref = make(enable_prefix_caching=False)
    want = {k: gen(ref, p, 8).outputs[0].token_ids for k, p in (("A", A), ("B", B), ("C", C))}
    # three socket connections and 8 MiB slabs: a pull is spread over several sockets
    transport = dict(num_connections=3, transfer_size_mib=8, parallel_copies=4)
    prod = make(kv_transfer_config=conf("kv_producer", lease_s=3, **transport))
    cons = make(kv_transfer_config=conf("kv_consumer", timeout_s=1.5, **transport))
    return want, prod, cons


def free_all(llm):
    e = llm.engine
    return e.kv.num_free_blocks == e.runner.num_blocks and not e.scheduler.loading


def test_prefill_then_decode_elsewhere(engines):
    want, prod, cons = engines
    pre = gen(prod, A, 1, {"do_remote_decode": True}, rid="p1")
    params = pre.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_num_blocks"] == 18
    assert pre.outputs[0].token_ids == want["A"][:1]
    assert free_all(prod)  # the producer's blocks are free at once: the copies wait for the pull
    out = gen(cons, A, 8, params, rid="d1")
    assert out.outputs[0].token_ids == want["A"]
    assert out.num_cached_tokens == 288
    st = cons.stats()
    assert st["kv_transfer_pulls"] == 1 and st["external_prefix_cache_hits"] == 288
    assert free_all(cons) and not cons.engine.connector._fetched
    assert list(cons.engine.connector._conns) == [params["remote_address"]]  # kept for the next pull


def test_dead_producer_and_expired_lease_recompute(engines):
    want, prod, cons = engines
    dead = {"do_remote_prefill": True, "remote_address": "127.0.0.1:1", "remote_uuid": 1,
            "remote_num_blocks": 12}
    t0 = time.time()
    out = gen(cons, B, 8, dead, rid="d2")
    assert out.outputs[0].token_ids == want["B"] and out.num_cached_tokens == 0
    assert 1.4 < time.time() - t0 < 30  # waited for the pull's timeout, no longer
    params = gen(prod, C, 1, {"do_remote_decode": True}, rid="p3").kv_transfer_params
    time.sleep(3.5)  # the producer's lease runs out: nobody may pull these pages any more
    out = gen(cons, C, 8, params, rid="d3")
    assert out.outputs[0].token_ids == want["C"] and out.num_cached_tokens == 0
    assert cons.stats()["kv_transfer_failures"] == 2
    assert params["remote_address"] not in cons.engine.connector._conns  # dropped after its failure
    A2 = rand(300, 9)
    params = gen(prod, A2, 1, {"do_remote_decode": True}, rid="p3b").kv_transfer_params
    assert gen(cons, A2, 8, params, rid="d3b").num_cached_tokens == 288  # connects afresh
    assert free_all(cons) and free_all(prod)


def test_abort_mid_transfer_leaks_nothing(engines):
    want, prod, cons = engines
    e = cons.engine
    dead = {"do_remote_prefill": True, "remote_address": "127.0.0.1:1", "remote_uuid": 2,
            "remote_num_blocks": 12}
    e.add_request("d4", A, SamplingParams(temperature=0, max_tokens=4), kv_transfer_params=dead)
    e.step()
    assert "d4" in e.scheduler.loading  # waiting for its pages, off the waiting queue
    e.abort_request("d4")
    assert not e.has_unfinished_requests()
    time.sleep(2)  # the pull gives up
    assert free_all(cons) and not e.connector._fetching and not e.connector._fetched
    out = gen(cons, A, 8, rid="d5")  # the engine serves on
    assert out.outputs[0].token_ids == want["A"]


def test_abort_while_pulling_from_a_live_producer_leaks_nothing(engines):
    """The consumer aborts a request whose pull from a running producer has started: neither side
    keeps a block, the late pull's pages are dropped, and both serve on with the same output."""
    want, prod, cons = engines
    e = cons.engine
    A3 = rand(300, 11)
    params = gen(prod, A3, 1, {"do_remote_decode": True}, rid="p6").kv_transfer_params
    assert params["remote_num_blocks"] == 18 and free_all(prod)
    e.add_request("d6", A3, SamplingParams(temperature=0, max_tokens=4), kv_transfer_params=params)
    e.step()
    assert "d6" in e.scheduler.loading  # its pull is under way
    e.abort_request("d6")
    assert not e.has_unfinished_requests()
    deadline = time.time() + 10
    while (e.connector._fetching or e.connector._fetched) and time.time() < deadline:
        time.sleep(0.05)  # the pull ends (its pages have no request left to go to)
    assert free_all(cons) and free_all(prod)
    assert not e.connector._fetching and not e.connector._fetched
    ref = make(enable_prefix_caching=False)
    assert gen(cons, A3, 8, rid="d6b").outputs[0].token_ids == gen(ref, A3, 8).outputs[0].token_ids
    assert free_all(cons)


def test_no_page_move_compiles_after_warmup(engines):
    _, prod, cons = engines
    for llm in (prod, cons):
        assert llm.engine.kv_ops.num_compiled() == llm.kv_compiled


@pytest.mark.parametrize("key,value", [("num_connections", 0), ("num_connections", "4"),
                                       ("transfer_size_mib", 1.5), ("parallel_copies", True),
                                       ("pinned_buffers", 1)])
def test_bad_transport_option_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"kv_connector_extra_config.{key}"):
        transport_options({key: value})
    with pytest.raises(ValueError, match=f"kv_connector_extra_config.{key}"):
        make(kv_transfer_config=conf("kv_consumer", **{key: value}))


def test_transport_options_pass_through():
    assert transport_options({"num_connections": 4, "transfer_size_mib": 64, "pinned_buffers": True}) == {
        "num_connections": 4, "transfer_size": 64 << 20, "max_num_parallel_copies": 8,
        "supports_pinned_allocator": True}
