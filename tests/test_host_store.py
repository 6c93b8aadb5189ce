"""The host tier's LRU store (kv_transfer/host_store.py): bound, pins, and that evicted blocks
are freed outside its lock (freeing pinned host memory can wait on the device, and a load's
lookups must not wait behind it)."""

import threading
import time

import numpy as np

from jaxllm.kv_transfer.host_store import HostStore


class SlowFree:
    """A block whose release takes a while (as freeing a pinned host buffer can)."""

    nbytes = 100

    def __del__(self):
        time.sleep(0.3)


def test_lru_bound_and_pins():
    s = HostStore(300)
    for k in range(3):
        assert s.put(k, np.zeros(100, np.uint8))
    assert s.pin([0]) == [0]
    assert s.put(3, np.zeros(100, np.uint8))  # evicts 1, the oldest unpinned
    assert 1 not in s and 0 in s and s.nbytes == 300
    assert s.take_evicted() == [1]
    s.unpin([0])
    assert s.put(4, np.zeros(100, np.uint8)) and 2 not in s  # (0 was refreshed by the pin)
    assert not s.put(9, np.zeros(400, np.uint8))  # larger than the bound, not pinned: not held


def test_evicted_blocks_are_freed_outside_the_lock():
    s = HostStore(200)
    s.put(0, SlowFree())
    s.put(1, np.zeros(100, np.uint8))
    done = {}

    def evict():
        s.put(2, np.zeros(100, np.uint8))  # drops block 0: its release sleeps 0.3 s
        done["put"] = time.perf_counter()

    t = threading.Thread(target=evict)
    t.start()
    time.sleep(0.05)  # the put is releasing block 0 now
    t0 = time.perf_counter()
    assert s.get(1) is not None
    waited = time.perf_counter() - t0
    t.join()
    assert waited < 0.1, f"a lookup waited {waited:.2f}s behind an eviction's free"
    assert 0 not in s and s.nbytes == 200
