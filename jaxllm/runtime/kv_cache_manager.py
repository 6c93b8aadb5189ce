"""Per-request block tables over the shared block pool, with prefix caching.

A request's table is a plain list of blocks: slot i of the request lives in
block table[i // block_size] at offset i % block_size. Allocation is all or
nothing and returns None when the pool is short, leaving the choice of what to
preempt to the scheduler.

Prefix caching: a full block is named by a hash chained over its parent's hash,
its tokens and the request's cache salt, so equal hashes mean equal prefixes.
Cached blocks keep their K/V after their owner finishes and are reused until
the pool evicts them (least recently freed first).
"""

from __future__ import annotations

from jaxllm.runtime.block_pool import Block, BlockPool
from jaxllm.runtime.request import Request


def block_hash(parent: int | None, tokens: list[int], salt: str | None) -> int:
    return hash((parent, tuple(tokens), salt))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[int]] = {}  # hashes of each request's full blocks
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def _full_block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(req.request_id, [])
        S = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, req.token_slice(i * S, (i + 1) * S), req.cache_salt))
        return hashes[:num_blocks]

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """Longest run of cached full blocks matching a new request's prefix.

        Stops one token short of the whole sequence: the last token must run
        through the model to produce logits.
        """
        if not self.enable_prefix_caching or req.request_id in self.tables:
            return []
        hits: list[Block] = []
        for h in self._full_block_hashes(req, (req.num_tokens - 1) // self.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[Block] = ()) -> list[Block] | None:
        """Grow req's table to hold num_new_tokens more tokens; None if the pool is short.

        `computed_blocks` (prefix-cache hits from get_computed_blocks) are
        prepended by reference rather than allocated.
        """
        table = self.tables.get(req.request_id, [])
        S = self.block_size
        total = req.num_computed_tokens + len(computed_blocks) * S + num_new_tokens
        need = -(-total // S) - len(table) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free - reclaimed:
            return None
        for b in computed_blocks:
            self.pool.touch(b)
        new = self.pool.allocate(need) if need > 0 else []
        self.tables[req.request_id] = table + list(computed_blocks) + new
        return new

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(req.request_id, [])
        n = min(req.num_computed_tokens // self.block_size, len(table))
        for b, h in zip(table[:n], self._full_block_hashes(req, n)):
            self.pool.cache(b, h)

    def free(self, req: Request) -> None:
        self.pool.release(self.tables.pop(req.request_id, []))
        self._hashes.pop(req.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget all cached hashes (e.g. after the weights change)."""
        for b in self.pool.blocks:
            b.block_hash = None
        self.pool.cached.clear()
