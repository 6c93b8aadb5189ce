"""KV-cache events for cache-aware routers, in vLLM's names and msgpack layout, over ZMQ.

The block pool records `BlockStored` (blocks newly registered in the prefix cache, with
their parent hash and tokens), `BlockRemoved` (cached blocks evicted) and
`AllBlocksCleared` (prefix cache reset) in the order they happen; the engine hands each
step's events to the publisher, which sends one `KVEventBatch` per step from its own
thread as vLLM's `ZmqEventPublisher` does: a multipart message (topic, 8-byte big-endian
sequence number, msgpack payload). Payloads are msgspec's `array_like` encoding of
vLLM's structs: a batch is `[ts, [event, ...]]`, an event `[tag, field, ...]`:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. Block hashes are the
16-byte prefix-cache hashes (SHA-256 based, stable across processes), big-endian bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgpack

from jaxllm.kv_transfer.config import KVEventsConfig

log = logging.getLogger("jaxllm")


def hash_bytes(h: int) -> bytes:
    return h.to_bytes(16, "big")


def block_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
                 medium: str = "GPU") -> list:
    return ["BlockStored", [hash_bytes(h) for h in hashes],
            None if parent is None else hash_bytes(parent), list(token_ids), block_size, None, medium]


def block_removed(hashes: list[int], medium: str = "GPU") -> list:
    return ["BlockRemoved", [hash_bytes(h) for h in hashes], medium]


def all_cleared() -> list:
    return ["AllBlocksCleared"]


def to_vllm(events: list[tuple], block_size: int) -> list:
    """The KV manager's events as vLLM events: runs of a chain stored together become one
    BlockStored, runs of removals one BlockRemoved; order kept."""
    out: list = []
    run: list[tuple] = []  # ("stored", ...) entries of the current chain
    gone: list[int] = []

    def close():
        if run:
            out.append(block_stored([e[1] for e in run], run[0][2], [t for e in run for t in e[3]],
                                    block_size))
            run.clear()
        if gone:
            out.append(block_removed(list(gone)))
            gone.clear()

    for e in events:
        if e[0] == "stored":
            if gone or (run and e[2] != run[-1][1]):
                close()
            run.append(e)
        elif e[0] == "removed":
            if run:
                close()
            gone.append(e[1])
        else:
            close()
            out.append(all_cleared())
    close()
    return out


def encode_batch(events: list, ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, events], use_bin_type=True)


class ZmqEventPublisher:
    def __init__(self, cfg: KVEventsConfig):
        import zmq
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.bind(cfg.endpoint)
        self._topic = cfg.topic.encode()
        self._q: queue.Queue = queue.Queue(maxsize=cfg.buffer_steps)
        self._seq = 0
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="jaxllm-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events published on %s", cfg.endpoint)

    def publish(self, events: list) -> None:
        if not events:
            return
        try:
            self._q.put_nowait(encode_batch(events))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("KV events: the publisher queue is full; dropping batches")

    def _run(self) -> None:
        while True:
            payload = self._q.get()
            if payload is None:
                break
            self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
            self._seq += 1
            self._q.task_done()

    def flush(self, timeout: float = 5.0) -> None:
        end = time.time() + timeout
        while self._q.unfinished_tasks and time.time() < end:
            time.sleep(0.005)

    def shutdown(self) -> None:
        self.flush()
        self._q.put(None)
        self._thread.join(timeout=5)
        self._sock.close(linger=0)


def make_publisher(d: dict | None) -> ZmqEventPublisher | None:
    if d is None:
        return None
    cfg = KVEventsConfig.from_dict(d)
    if not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return None
    return ZmqEventPublisher(cfg)
