"""Device-side page moves the scheduler asks for: copy-on-write and swap.

The scheduler (host, jax-free) only decides *which* pages move; this module
moves them in `kv_pages [L, 2, K, P, S, D]`:

* `copy`: block-to-block copies for copy-on-write when forked sequences
  diverge inside a shared, partly filled block. One gather-then-scatter per
  step, so every copy reads the pages as they were before the step even when
  a block freed this step is another copy's destination.
* `swap_out` / `swap_in`: pages of a preempted request to and from a bounded
  host pool `[H, L, 2, K, S, D]` (numpy; H from `swap_space`).
* `gather_chunk` / `scatter_chunk` / `write_blocks`: blocks for KV connectors
  (`jaxllm/kv_transfer/`): gathered into a device array of SWAP_CHUNK blocks, scattered
  back from one, or written from separate host arrays `[L, 2, K, S, D]` (each block sent
  as it is, no host copy into a staging buffer, and stacked on the device).
  `write_blocks` = `put_blocks` (start the host-to-device copies, asynchronous) then
  `scatter_blocks` (into the pages), so a connector can let the copies run behind steps.
  Over a mesh each block goes straight to the devices holding its KV heads.
* `pin_chunk` / `pin_block`: blocks into page-locked host memory (JAX's `pinned_host`
  memory kind, where the device has it), for a host tier whose blocks go back to the
  device by DMA at the link's speed rather than through a pageable staging copy. A
  gathered chunk stays one pinned array (`ChunkRow`s refer to its rows): on an H200 a
  list of 2 MiB pinned arrays crosses at 0.54 of one array's rate, 16-block chunks at
  0.96 (`scripts/h2d_pinned.py`), and `put_blocks` sends each chunk once.
  Every block `put_blocks` returns is committed to the pages' device, from numpy or
  pinned memory alike, so the scatters run one compiled variant (the one `warmup` built).

Every function has fixed shapes (copies padded to `max_copies`, swaps moved in
chunks of `SWAP_CHUNK` blocks; padding writes go to block index P and are
dropped), and `warmup` compiles them all at start-up, so serving never
compiles. Results keep the pages' sharding (tensor parallelism shards K).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

SWAP_CHUNK = 16  # blocks per swap transfer


def _copy(pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    return pages.at[:, :, :, dst].set(jnp.take(pages, src, axis=3), mode="drop")


def _gather(pages: jax.Array, src: jax.Array) -> jax.Array:
    return jnp.moveaxis(jnp.take(pages, src, axis=3), 3, 0)  # [C, L, 2, K, S, D]


def _scatter(pages: jax.Array, blocks: jax.Array, dst: jax.Array) -> jax.Array:
    return pages.at[:, :, :, dst].set(jnp.moveaxis(blocks, 0, 3), mode="drop")


def _scatter_list(pages: jax.Array, blocks: list[jax.Array], dst: jax.Array) -> jax.Array:
    return pages.at[:, :, :, dst].set(jnp.stack(blocks, axis=3), mode="drop")


def _split(chunk: jax.Array) -> list[jax.Array]:
    return [chunk[i] for i in range(chunk.shape[0])]  # [C, ...] -> C arrays [L, 2, K, S, D]


@dataclasses.dataclass(frozen=True)
class ChunkRow:
    """Row `row` of a chunk of blocks [C, L, 2, K, S, D] (pinned host memory, or on the device
    once `put_blocks` moved it): one block, kept inside the array it was copied in."""
    chunk: jax.Array
    row: int
    rows_used: int = 0  # rows of the chunk that hold blocks (0: all); they share its bytes

    @property
    def nbytes(self) -> int:
        return self.chunk.nbytes // (self.rows_used or self.chunk.shape[0])

    def is_ready(self) -> bool:
        return self.chunk.is_ready()

    def block_until_ready(self) -> "ChunkRow":
        self.chunk.block_until_ready()
        return self

    def numpy(self) -> np.ndarray:
        return np.asarray(self.chunk)[self.row]


def to_numpy(block) -> np.ndarray:
    """A host-tier block (numpy, a pinned array or a `ChunkRow`) as a numpy array [L, 2, K, S, D]."""
    return block.numpy() if isinstance(block, ChunkRow) else np.asarray(block)


def committed(pages: jax.Array) -> jax.Array:
    """`pages` committed to its devices (an alias: no copy). On one device the step leaves the
    pages uncommitted, while a scatter of committed blocks (put_blocks' results) leaves them
    committed, and jit caches tell the two apart: every function here takes committed pages,
    so each compiles one variant, at warm-up."""
    return pages if pages.committed else jax.device_put(pages, pages.sharding)


def has_pinned_host(sharding) -> bool:
    """Whether every device of `sharding` has JAX's `pinned_host` memory kind."""
    try:
        return all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in sharding.device_set)
    except Exception:  # noqa: BLE001 - a backend without memory kinds
        return False


class KVOps:
    chunk = SWAP_CHUNK  # blocks per gather / scatter call
    def __init__(self, num_blocks: int, max_copies: int, num_host_blocks: int,
                 pages: jax.Array, block_io: bool = False, compiler_options: dict | None = None) -> None:
        self.num_blocks = num_blocks
        self.max_copies = max_copies
        self.num_host_blocks = num_host_blocks
        self.block_io = block_io
        L, two, K, _, S, D = pages.shape
        self.block_shape = (L, two, K, S, D)
        # np.empty is lazy: the host pool costs memory only as swaps touch it.
        self.host = np.empty((num_host_blocks, *self.block_shape), pages.dtype)
        # Where one block [L, 2, K, S, D] / one chunk [C, L, 2, K, S, D] lives: the pages'
        # sharding without the page axis (each device holds its KV heads); None on one device.
        self.block_sharding = self.chunk_sharding = None
        if len(pages.sharding.device_set) > 1 and isinstance(pages.sharding, NamedSharding):
            spec = tuple(pages.sharding.spec) + (None,) * (pages.ndim - len(pages.sharding.spec))
            mesh = pages.sharding.mesh
            block = spec[:3] + spec[4:]
            self.block_sharding = NamedSharding(mesh, PartitionSpec(*block))
            self.chunk_sharding = NamedSharding(mesh, PartitionSpec(None, *block))
        # Blocks on their way into the pages: committed (as over a mesh), whatever their source.
        self.device_sharding = self.block_sharding or SingleDeviceSharding(
            next(iter(pages.sharding.device_set)), memory_kind="device")
        self.pinned_sharding = (self.device_sharding.with_memory_kind("pinned_host")
                                if has_pinned_host(self.device_sharding) else None)
        self.device_chunk_sharding = self.chunk_sharding or self.device_sharding
        self.pinned_chunk_sharding = (self.device_chunk_sharding.with_memory_kind("pinned_host")
                                      if self.pinned_sharding is not None else None)
        # Over a mesh, results keep the pages' sharding; on one device no sharding is
        # pinned, so the pages stay uncommitted like the runner's (jit caches key on that).
        # XLA's memory limit as the step's (`engine/memory.py`): these programs hold the whole pool too.
        keep = dict(donate_argnums=0, compiler_options=compiler_options or None)
        if len(pages.sharding.device_set) > 1:
            keep["out_shardings"] = pages.sharding
        # partial(): a cache of our own, so num_compiled() counts this engine's variants only.
        self._copy = jax.jit(functools.partial(_copy), **keep)
        gather = dict(compiler_options=compiler_options or None)
        if self.chunk_sharding is not None:
            gather["out_shardings"] = self.chunk_sharding
        self._gather = jax.jit(functools.partial(_gather), **gather)
        self._scatter = jax.jit(functools.partial(_scatter), **keep)
        self._scatter_list = jax.jit(functools.partial(_scatter_list), **keep)
        split = {"out_shardings": self.block_sharding} if self.block_sharding is not None else {}
        self._split = jax.jit(functools.partial(_split), **split)
        self._zero_block = None  # padding of write_blocks, on the device

    def num_compiled(self) -> int:
        return sum(f._cache_size() for f in (self._copy, self._gather, self._scatter, self._scatter_list,
                                              self._split))

    def _pad(self, ids: list[int], n: int, fill: int) -> np.ndarray:
        out = np.full(n, fill, np.int32)
        out[:len(ids)] = ids
        return out

    def copy(self, pages: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
        """Copy block src -> dst for each pair, all reads before all writes."""
        if not pairs:
            return pages
        if len(pairs) > self.max_copies:
            raise RuntimeError(f"{len(pairs)} block copies in one step, more than {self.max_copies}")
        src, dst = zip(*pairs)
        return self._copy(committed(pages), self._pad(src, self.max_copies, 0),
                          self._pad(dst, self.max_copies, self.num_blocks))

    def swap_out(self, pages: jax.Array, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host slot for each pair."""
        pages = committed(pages)
        for i in range(0, len(pairs), SWAP_CHUNK):
            dev, host = zip(*pairs[i:i + SWAP_CHUNK])
            blocks = np.asarray(self._gather(pages, self._pad(dev, SWAP_CHUNK, 0)))
            self.host[list(host)] = blocks[:len(host)]

    def swap_in(self, pages: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
        """Host slot -> device block for each pair."""
        pages = committed(pages)
        for i in range(0, len(pairs), SWAP_CHUNK):
            host, dev = zip(*pairs[i:i + SWAP_CHUNK])
            blocks = np.zeros((SWAP_CHUNK, *self.block_shape), self.host.dtype)
            blocks[:len(host)] = self.host[list(host)]
            pages = self._scatter(pages, blocks, self._pad(dev, SWAP_CHUNK, self.num_blocks))
        return pages

    def write_blocks(self, pages: jax.Array, blocks: list[np.ndarray], ids: list[int]) -> jax.Array:
        """Host arrays [L, 2, K, S, D] -> device blocks `ids`."""
        return self.scatter_blocks(pages, self.put_blocks(blocks), ids)

    def put_blocks(self, blocks: list) -> list:
        """Start the host-to-device copies of host blocks: arrays [L, 2, K, S, D] (numpy or
        pinned) and `ChunkRow`s of pinned chunks, each chunk sent once (returns at once;
        `is_ready()` on each result says when its copy is done)."""
        out: list = [None] * len(blocks)
        moved: dict[int, jax.Array] = {}
        singles = []
        for i, b in enumerate(blocks):
            if isinstance(b, ChunkRow):
                dev = moved.get(id(b.chunk))
                if dev is None:
                    dev = moved[id(b.chunk)] = jax.device_put(b.chunk, self.device_chunk_sharding)
                out[i] = ChunkRow(dev, b.row)
            else:
                singles.append(i)
        if singles:
            for i, a in zip(singles, jax.device_put([blocks[i] for i in singles], self.device_sharding)):
                out[i] = a
        return out

    def pin_chunk(self, chunk: jax.Array, n: int) -> list:
        """The first n blocks of a gathered chunk -> pinned host memory (the copies run
        asynchronously: `block_until_ready()` on each result). Needs `pinned_sharding`.
        The whole chunk in one array when at least half of it is wanted (`ChunkRow`s:
        one copy each way), else one array per block (no padding rows held)."""
        if 2 * n >= chunk.shape[0]:
            host = jax.device_put(chunk, self.pinned_chunk_sharding)
            return [ChunkRow(host, j, n) for j in range(n)]  # the host tier counts the padding too
        return jax.device_put(self._split(chunk)[:n], self.pinned_sharding)

    def pin_block(self, block: np.ndarray) -> jax.Array:
        """A host block [L, 2, K, S, D] -> a copy in pinned host memory."""
        return jax.device_put(block, self.pinned_sharding)

    def scatter_blocks(self, pages: jax.Array, dev: list[jax.Array], ids: list[int]) -> jax.Array:
        """Device blocks (from put_blocks) -> device blocks `ids`: chunks moved whole by one
        scatter each (rows not asked for are skipped), single blocks 16 at a time."""
        pages = committed(pages)
        rows: dict[int, tuple[jax.Array, list[int | None]]] = {}
        singles: list[tuple[jax.Array, int]] = []
        for d, i in zip(dev, ids):
            if isinstance(d, ChunkRow):
                chunk, dst = rows.setdefault(id(d.chunk), (d.chunk, [None] * d.chunk.shape[0]))
                dst[d.row] = i
            else:
                singles.append((d, i))
        for chunk, dst in rows.values():
            pages = self.scatter_chunk(pages, chunk, dst)
        for i in range(0, len(singles), SWAP_CHUNK):
            part = [d for d, _ in singles[i:i + SWAP_CHUNK]]
            chunk = [b for _, b in singles[i:i + SWAP_CHUNK]]
            part += [self._padding(pages)] * (SWAP_CHUNK - len(chunk))
            pages = self._scatter_list(pages, part, self._pad(chunk, SWAP_CHUNK, self.num_blocks))
        return pages

    def gather_chunk(self, pages: jax.Array, ids: list[int]) -> jax.Array:
        """Up to SWAP_CHUNK device blocks as one device array [SWAP_CHUNK, L, 2, K, S, D]."""
        return self._gather(committed(pages), self._pad(ids, SWAP_CHUNK, 0))

    def scatter_chunk(self, pages: jax.Array, chunk: jax.Array, ids: list[int | None]) -> jax.Array:
        """Row i of a [SWAP_CHUNK, ...] device array -> block ids[i] (None: skipped)."""
        dst = [self.num_blocks if i is None else i for i in ids]
        return self._scatter(committed(pages), chunk, self._pad(dst, SWAP_CHUNK, self.num_blocks))

    def warmup(self, pages: jax.Array) -> jax.Array:
        """Compile every variant; the padded calls write nothing."""
        pages = committed(pages)
        pages = self._copy(pages, self._pad([], self.max_copies, 0),
                           self._pad([], self.max_copies, self.num_blocks))
        if self.block_io:  # host blocks from put_blocks, into pages as the step leaves them
            pages = self._warm_scatter_list(pages)
        if self.num_host_blocks or self.block_io:
            idx = self._pad([], SWAP_CHUNK, 0)
            blocks = np.asarray(self._gather(pages, idx))
            if self.block_io and self.pinned_sharding is not None:  # a pinned host tier's saves, loads
                jax.block_until_ready(self.pin_chunk(self._gather(pages, idx), 1))
                back = self.put_blocks(self.pin_chunk(self._gather(pages, idx), SWAP_CHUNK)[:1])
                pages = self.scatter_blocks(pages, back, [self.num_blocks])  # (dropped)
            if self.num_host_blocks or self.block_io:
                pages = self._scatter(pages, blocks, self._pad([], SWAP_CHUNK, self.num_blocks))
            if self.block_io:  # connectors scatter device arrays too (committed to a device)
                dev = jax.device_put(blocks, self.chunk_sharding or jax.devices()[0])
                pages = self._scatter(pages, dev, self._pad([], SWAP_CHUNK, self.num_blocks))
                pages = self._scatter(pages, self._gather(pages, idx), self._pad([], SWAP_CHUNK, self.num_blocks))
            if self.block_io:  # and into pages a committed chunk's scatter just wrote
                pages = self._warm_scatter_list(pages)
        return pages

    def _warm_scatter_list(self, pages: jax.Array) -> jax.Array:
        return self._scatter_list(pages, [self._padding(pages)] * SWAP_CHUNK,
                                  self._pad([], SWAP_CHUNK, self.num_blocks))

    def _padding(self, pages: jax.Array) -> jax.Array:
        if self._zero_block is None:
            self._zero_block = jax.device_put(np.zeros(self.block_shape, pages.dtype), self.device_sharding)
        return self._zero_block
