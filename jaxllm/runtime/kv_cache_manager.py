"""Per-request block tables over the shared block pool: prefix caching, forks, swap.

A request's table is a plain list of blocks: slot i of the request lives in
block table[i // block_size] at offset i % block_size. Allocation is all or
nothing and returns None when the pool is short, leaving the choice of what to
preempt to the scheduler.

Prefix caching: a full block is named by a hash chained over its parent's hash,
its tokens and the request's cache salt, so equal hashes mean equal prefixes.
Cached blocks keep their K/V after their owner finishes and are reused until
the pool evicts them (least recently freed first).

Forks (parallel sampling, beam search) share every block of the parent by
reference count. The only block a sharer ever writes is the partly filled one
at its `num_computed_tokens`; when that block is shared, `allocate_slots` gives
the writer a private copy (copy-on-write). Device work is not done here: the
copies, and the page moves of swap preemption, are queued as (source,
destination) pairs that the scheduler hands to the engine with the step.
"""

from __future__ import annotations

import hashlib
from array import array

from jaxllm.runtime.block_pool import Block, BlockPool, HostBlockPool
from jaxllm.runtime.request import Request


def block_hash(parent: int | None, tokens: list[int], salt: str | None) -> int:
    """128 bits of SHA-256 over (parent hash, salt, tokens).

    Python's own hash of an int tuple can be collided on purpose, and a
    collision here would serve one request another's K/V, across cache salts
    too; SHA-256 (vLLM's choice as well) makes that impractical at ~1 us a block.
    """
    h = hashlib.sha256(b"\x01" + parent.to_bytes(16, "little") if parent is not None else b"\x00")
    if salt is None:
        h.update(b"\x00")
    else:
        s = salt.encode()
        h.update(b"\x01" + len(s).to_bytes(4, "little") + s)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest()[:16], "little")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.host = HostBlockPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[Block]] = {}
        # The same tables as block ids, rebuilt only when a table changes: the scheduler
        # reads every running request's ids each step, and a tuple per change is cheaper
        # than a list comprehension over the whole table per step.
        self._ids: dict[str, tuple[int, ...]] = {}
        self.swapped: dict[str, list[int]] = {}  # request id -> host slots of its pages, in order
        self._hashes: dict[str, list[int]] = {}  # hashes of each request's full blocks
        # Request id -> leading blocks of its table already offered to the prefix cache. Each
        # step then registers only the blocks that filled since, not the whole table again
        # (that rescan was O(context) per request per step: 14 ms a step at 64 x 2048 tokens).
        self._num_cached: dict[str, int] = {}
        self._lookups: dict[str, int] = {}  # request id -> hit tokens, counted once admitted
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (first admission)
        self.prefix_hits = 0  # of which found
        self.num_cow_copies = 0  # blocks copied on write since start-up
        # Device work for the step being scheduled; see take_ops().
        self._out_ops: list[tuple[int, int]] = []  # (device block, host slot)
        self._copy_ops: list[tuple[int, int]] = []  # (source block, destination block)
        self._in_ops: list[tuple[int, int]] = []  # (host slot, device block)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._ids.get(request_id, ()))  # a C-speed copy: callers may keep it

    def _set_table(self, request_id: str, table: list[Block], appended: list[Block] | None = None) -> None:
        """Install a request's table; `appended`: it is the old table plus these blocks."""
        self.tables[request_id] = table
        if appended is not None and request_id in self._ids:
            self._ids[request_id] += tuple(b.block_id for b in appended)
        else:
            self._ids[request_id] = tuple(b.block_id for b in table)

    def _drop_table(self, request_id: str) -> list[Block]:
        self._ids.pop(request_id, None)
        return self.tables.pop(request_id, [])

    def is_swapped(self, req: Request) -> bool:
        return req.request_id in self.swapped

    # -- prefix cache ---------------------------------------------------------
    def _full_block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(req.request_id, [])
        S = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, req.token_slice(i * S, (i + 1) * S), req.cache_salt))
        return hashes[:num_blocks]

    block_hashes = _full_block_hashes  # (req, n): hashes of its first n full blocks (KV connectors)

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """Longest run of cached full blocks matching a new request's prefix.

        Stops one token short of the whole sequence: the last token must run
        through the model to produce logits. Has no side effect on the pool;
        the lookup counts towards the stats only when the request is admitted
        (a request waiting for room is looked up again every step).
        """
        if not self.enable_prefix_caching or req.request_id in self.tables or self.is_swapped(req):
            return []
        hits: list[Block] = []
        for h in self._full_block_hashes(req, (req.num_tokens - 1) // self.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        self._lookups[req.request_id] = len(hits) * self.block_size
        return hits

    def cache_full_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Register the request's blocks that are full within its first `num_tokens`
        tokens (default: the computed ones).

        The scheduler calls this as it schedules a chunk, with the tokens the
        chunk will have computed: a request admitted later in the same step can
        then share blocks still being written, which is sound because every
        layer writes the step's K/V to the pages before any row attends (vLLM V1
        registers at scheduling time too).
        """
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(req.request_id, [])
        upto = req.num_computed_tokens if num_tokens is None else num_tokens
        upto = min(upto, req.num_tokens)  # tokens still in flight (async steps) have no hash yet
        n = min(upto // self.block_size, len(table))
        start = self._num_cached.get(req.request_id, 0)
        if n <= start:
            return
        hashes = self._full_block_hashes(req, n)
        for i in range(start, n):
            if self.pool.cache(table[i], hashes[i]) and self.pool.events is not None:
                self.pool.events.append(("stored", hashes[i], hashes[i - 1] if i else None,
                                         req.token_slice(i * self.block_size, (i + 1) * self.block_size)))
        self._num_cached[req.request_id] = n

    def reset_prefix_cache(self) -> None:
        """Forget all cached hashes (e.g. after the weights change)."""
        for b in self.pool.blocks:
            b.block_hash = None
        self.pool.cached.clear()
        self._num_cached.clear()
        if self.pool.events is not None:
            self.pool.events.append(("cleared",))

    def take_events(self) -> list[tuple]:
        """Prefix-cache events since the last call (KV events): ("stored", hash, parent,
        tokens), ("removed", hash), ("cleared",), in the order they happened."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    # -- allocation -------------------------------------------------------------
    def _needs_cow(self, table: list[Block], num_computed: int, num_new: int) -> bool:
        """Will the next write land in a partly filled block that others share?"""
        i = num_computed // self.block_size
        return (num_new > 0 and num_computed % self.block_size != 0 and i < len(table)
                and table[i].ref_cnt > 1)

    def num_blocks_needed(self, req: Request, num_new_tokens: int,
                          computed_blocks: list[Block] = ()) -> int:
        """Free blocks `allocate_slots` would take (reclaimed cache hits and copies included)."""
        S = self.block_size
        if self.is_swapped(req):
            return _cdiv(req.num_computed_tokens + num_new_tokens, S)
        table = self.tables.get(req.request_id, [])
        nc = req.num_computed_tokens + len(computed_blocks) * S
        need = max(0, _cdiv(nc + num_new_tokens, S) - len(table) - len(computed_blocks))
        need += self._needs_cow(table, nc, num_new_tokens)
        return need + sum(1 for b in computed_blocks if b.ref_cnt == 0)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[Block] = ()) -> list[Block] | None:
        """Grow req's table to hold num_new_tokens more tokens; None if the pool is short.

        `computed_blocks` (prefix-cache hits from get_computed_blocks) are
        prepended by reference rather than allocated. A swapped-out request
        gets fresh blocks for its pages plus the new tokens, and its swap-in
        is queued. Returns the blocks allocated for new tokens.
        """
        if self.num_blocks_needed(req, num_new_tokens, computed_blocks) > self.pool.num_free:
            return None
        if self.is_swapped(req):
            return self._swap_in(req, num_new_tokens)
        S = self.block_size
        table = list(self.tables.get(req.request_id, [])) + list(computed_blocks)
        nc = req.num_computed_tokens + len(computed_blocks) * S
        cow = self._needs_cow(table, nc, num_new_tokens)
        for b in computed_blocks:
            self.pool.touch(b)
        need = max(0, _cdiv(nc + num_new_tokens, S) - len(table))
        new = self.pool.allocate(need + cow) if need + cow else []
        if cow:
            dst, src = new.pop(), table[nc // S]
            table[nc // S] = dst
            self.pool.release([src])  # still held by the other sharers
            self._copy_ops.append((src.block_id, dst.block_id))
            self.num_cow_copies += 1
        self._set_table(req.request_id, table + new, None if cow or computed_blocks else new)
        hit = self._lookups.pop(req.request_id, None)
        if hit is not None and req.num_preemptions == 0:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += hit
        return new

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` slots (rejected draft tokens).

        The freed blocks hold no full block of known tokens, so none has a hash.
        """
        table = self.tables.get(req.request_id)
        keep = _cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        self.pool.release(table[keep:])
        self._set_table(req.request_id, table[:keep])

    def fork(self, parent: Request, child: Request) -> None:
        """Give child a table sharing parent's blocks up to parent's computed tokens."""
        nc = parent.num_computed_tokens
        shared = self.tables[parent.request_id][:_cdiv(nc, self.block_size)]
        for b in shared:
            self.pool.touch(b)
        self._set_table(child.request_id, list(shared))
        self._num_cached.pop(child.request_id, None)
        self._hashes[child.request_id] = self._hashes.get(parent.request_id, [])[:nc // self.block_size]

    def free(self, req: Request) -> None:
        """Drop the request's blocks (device and host); cached ones stay reusable."""
        self.pool.release(self._drop_table(req.request_id))
        self._hashes.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        self._lookups.pop(req.request_id, None)
        slots = self.swapped.pop(req.request_id, None)
        if slots:
            self.host.release(slots)

    # -- swap preemption ----------------------------------------------------------
    def swap_out(self, req: Request) -> bool:
        """Queue the pages holding req's computed tokens for host memory and free
        its device blocks; False (nothing done) if the host pool is short."""
        table = self.tables.get(req.request_id, [])
        keep = table[:_cdiv(req.num_computed_tokens, self.block_size)]
        slots = self.host.allocate(len(keep))
        if slots is None:
            return False
        self._out_ops.extend(zip((b.block_id for b in keep), slots))
        self.swapped[req.request_id] = slots
        self.pool.release(self._drop_table(req.request_id))
        self._num_cached.pop(req.request_id, None)  # the swap-in's fresh blocks register anew
        self._lookups.pop(req.request_id, None)
        return True

    def _swap_in(self, req: Request, num_new_tokens: int) -> list[Block]:
        slots = self.swapped.pop(req.request_id)
        blocks = self.pool.allocate(_cdiv(req.num_computed_tokens + num_new_tokens, self.block_size))
        self._in_ops.extend(zip(slots, (b.block_id for b in blocks)))
        self.host.release(slots)  # reusable from the next step on, once the copy has read them
        self._set_table(req.request_id, blocks)
        return blocks[len(slots):]

    # -- per-step device work -------------------------------------------------------
    def begin_step(self) -> None:
        self.host.release_pending()

    def take_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap_out, copies, swap_in) queued since the last call.

        The engine must run them before the step's forward pass, in this order:
        swap-outs and copies read pages as they were before the step (a block
        freed by a preemption this step may already be someone's destination),
        and swap-ins write blocks that nothing else reads this step.
        """
        ops = (self._out_ops, self._copy_ops, self._in_ops)
        self._out_ops, self._copy_ops, self._in_ops = [], [], []
        return ops
