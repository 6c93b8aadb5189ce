"""Host-memory tier: an LRU of KV blocks bounded in bytes, one array each: numpy, or a JAX
array in pinned host memory (`KVOps.pin_chunk`); the store only reads `nbytes`.

Each block is its own array, never a slot that is reused: the disk writer and a
load may still hold a block the LRU has just dropped, and must read what was put.
Blocks a scheduled load (or a background promotion) counts on are pinned and never
evicted; the store may exceed its bound by pinned blocks only. Thread safe: the
scheduler looks up and pins, the dispatch thread puts and gets, the disk reader puts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from typing import Any

Block = Any  # np.ndarray [L, 2, K, S, D] or a jax.Array of that shape in pinned host memory


class HostStore:
    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self._blocks: OrderedDict[int, Block] = OrderedDict()  # key -> block, LRU first
        self._pins: dict[int, int] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.evicted: list[int] = []  # keys dropped since the last take_evicted() (events)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: int, block: Block, pin: bool = False) -> bool:
        """Insert (or refresh) a block, pinned if asked; False if it is not held
        (it does not fit even after evicting, and is not pinned)."""
        with self._lock:
            if pin:
                self._pins[key] = self._pins.get(key, 0) + 1
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
            if block.nbytes > self.capacity and not self._pins.get(key):
                return False
            self._blocks[key] = block
            self.nbytes += block.nbytes
            dropped = self._shrink()
            held = key in self._blocks
        del dropped  # freed here, not under the lock: freeing pinned host memory can wait on the device
        return held

    def _shrink(self) -> list[Block]:
        """Evict LRU blocks that are not pinned until within the bound; the caller drops
        the returned blocks after releasing the lock."""
        victims, over = [], self.nbytes - self.capacity
        for key, block in self._blocks.items():  # from the LRU end, only as far as needed
            if over <= 0:
                break
            if not self._pins.get(key):
                victims.append(key)
                over -= block.nbytes
        dropped = [self._blocks.pop(k) for k in victims]
        self.nbytes -= sum(b.nbytes for b in dropped)
        self.evicted += victims
        return dropped

    def get(self, key: int) -> Block | None:
        with self._lock:
            b = self._blocks.get(key)
            if b is not None:
                self._blocks.move_to_end(key)
            return b

    def pin(self, keys: list[int]) -> list[int]:
        """Pin the leading keys present; returns them (stops at the first absent one)."""
        out = []
        with self._lock:
            for k in keys:
                if k not in self._blocks:
                    break
                self._pins[k] = self._pins.get(k, 0) + 1
                self._blocks.move_to_end(k)
                out.append(k)
        return out

    def unpin(self, keys: list[int]) -> None:
        with self._lock:
            for k in keys:
                n = self._pins.get(k, 0) - 1
                if n <= 0:
                    self._pins.pop(k, None)
                else:
                    self._pins[k] = n
            dropped = self._shrink()
        del dropped  # (outside the lock, as in put)

    def drop(self, key: int) -> None:
        with self._lock:
            b = self._blocks.pop(key, None)
            if b is not None:
                self.nbytes -= b.nbytes

    def take_evicted(self) -> list[int]:
        with self._lock:
            out, self.evicted = self.evicted, []
        return out

    @property
    def num_pinned(self) -> int:
        return len(self._pins)
