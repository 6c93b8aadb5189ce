"""KV events over ZMQ: a subscriber rebuilds the prefix cache from vLLM-layout batches."""

import socket
import time

import msgpack
import zmq

from kv_tiny import POOL, make, rand, run1

from jaxllm.kv_transfer.events import hash_bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_events_match_the_pool():
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")  # before the engine binds: no message is missed
    llm = make(kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://*:{port}"})
    time.sleep(0.3)  # let the subscription reach the publisher
    prompts = [rand(300, s) for s in (1, 2, 3)] + [rand(300, 1)[:200] + rand(50, 9)]
    for p in prompts:  # each long prompt evicts most of the one before (POOL blocks)
        run1(llm, p)
    llm.engine.kv.reset_prefix_cache()  # between requests: AllBlocksCleared
    run1(llm, prompts[1])
    llm.engine.kv_events.flush()
    cached, seqs, kinds, cleared = set(), [], [], False
    deadline = time.time() + 10
    while time.time() < deadline:
        if not sub.poll(200):
            if seqs:
                break
            continue
        topic, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        ts, events = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float)
        for ev in events:
            kinds.append(ev[0])
            if ev[0] == "BlockStored":
                _, hashes, parent, tokens, block_size, lora_id, medium = ev
                assert block_size == 16 and len(tokens) == 16 * len(hashes) and medium == "GPU"
                assert parent is None or parent in cached  # a parent is cached while its child is
                assert not cached & set(hashes)
                cached |= set(hashes)
            elif ev[0] == "BlockRemoved":
                _, hashes, medium = ev
                assert set(hashes) <= cached, "removal of a block never stored"
                cached -= set(hashes)
            else:
                assert ev == ["AllBlocksCleared"]
                cleared = True
                cached.clear()
    assert seqs == list(range(len(seqs))) and seqs
    assert {"BlockStored", "BlockRemoved"} <= set(kinds) and cleared
    assert cached == {hash_bytes(h) for h in llm.engine.kv.pool.cached}
    assert len(cached) <= POOL
    sub.close(linger=0)
    llm.engine.kv_events.shutdown()
