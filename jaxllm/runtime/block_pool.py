"""A fixed pool of KV pages ("blocks") with reference counts.

Free blocks sit in a doubly linked queue so that taking one from the front,
returning one to the back, and pulling one out of the middle (a prefix-cache hit
on a free but still cached block) are all O(1); a Python list would make the
middle removal O(n). Freed blocks go to the back, so the front is always the
least recently used one: eviction order for the prefix cache comes for free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and cached
    prev: "Block | None" = None
    next: "Block | None" = None


class FreeQueue:
    """Intrusive doubly linked list of free blocks, LRU at the front."""

    def __init__(self, blocks: list[Block]):
        self.head = Block(-1)
        self.tail = Block(-2)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, b: Block) -> None:
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.size += 1

    def remove(self, b: Block) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.size -= 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise IndexError("no free block")
        b = self.head.next
        self.remove(b)
        return b

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


class BlockPool:
    """Owns every block; hands them out and takes them back by ref count."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"need at least one KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeQueue(self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> block (prefix cache)
        # KV events (jaxllm.kv_transfer.events) in the order they happen, when enabled: the
        # KV manager adds BlockStored entries, evictions here add BlockRemoved ones.
        self.events: list | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[Block] | None:
        """n blocks with ref count 1, or None (nothing taken) if fewer are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b = self.free.popleft()
            if b.block_hash is not None:  # evict the least recently used cached block
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                    if self.events is not None:
                        self.events.append(("removed", b.block_hash))
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, block: Block) -> None:
        """Take one more reference (a prefix-cache hit or a shared fork)."""
        if block.ref_cnt == 0:
            self.free.remove(block)
        block.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference each; blocks reaching zero return to the free queue.

        Released in reverse so a request's tail blocks (least likely to be shared
        by a later prompt) are evicted before its head blocks.
        """
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise RuntimeError(f"block {b.block_id} released twice")
            if b.ref_cnt == 0:
                self.free.append(b)

    def cache(self, block: Block, block_hash: int) -> bool:
        """Register a full block under its prefix hash (first writer wins); True if it was."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)


class HostBlockPool:
    """Slots in host memory for swapped-out pages (ids only; kv_ops owns the bytes).

    Slots freed by a swap-in go to a *pending* list and become reusable only at
    the next `release_pending()` (the start of the next step): the device copy
    that reads them runs after the step is scheduled, so a swap-out scheduled
    in the same step must not be handed the same slot.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._pending: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self._pending.extend(ids)

    def release_pending(self) -> None:
        self._free.extend(reversed(self._pending))
        self._pending.clear()
