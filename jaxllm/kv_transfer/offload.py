"""OffloadingConnector: device blocks offloaded to a host LRU and, written through, to disk.

Saves: when a request finishes, its full blocks that the host tier lacks are queued; the
worker gathers them on the device before the next step's page writes (so a block freed
and reused that step is read first); a saver thread waits for their copy to the host,
puts the blocks in the host tier and queues them for the disk tier, so the dispatch
thread never waits for a save. With a numpy host tier only `save_copies_ahead` chunks
(default 2) have their device-to-host copies started ahead of the saver, so a load's
host-to-device copies do not queue behind a whole prompt's pageable copies (on an H200 a
restore behind another prompt's saves: 0.55 of recomputing with 2, 2.36 with all at once).
With a pinned host tier (the default) all of them start at once (None): there the bound made
the dispatch thread wait in a `device_put` into pinned memory until the saver thread had
issued and finished the other chunks' copies (a sampled stack, 2026-12-03: 5.6 s in one
issue; restore 8.75x recomputing with 2, 0.20 with all).
Every block a device eviction drops has been offered this way, since a cached block is
evictable only once its owner finished or was preempted (preemption finishes its use too:
`request_finished` is called then as well).

Loads: on admission, the blocks past the device prefix hits are looked up by key in the
host tier and pinned. Asynchronously (`load_async`, the default, vLLM's async load): the
request gets its blocks and waits (WAITING_FOR_REMOTE_KVS) while the batch runs on; the
worker starts the host-to-device copies and a watcher thread waits for them; before each
schedule `get_finished()` reports the requests whose copies are done, and the step that
schedules them writes their blocks into the pages before its forward pass
(`async_load.py`); the request then computes the rest of its prompt. A request finished
while loading cancels its load before its blocks can be reused. Inline
(`"load_async": false`): the blocks are written before the step's forward pass, and the
same step computes the rest. Blocks only the disk holds are
first read (checksums verified) into the host tier on a background thread while the
request steps aside (`get_num_new_matched_tokens` returns None), then it is admitted from
the host tier. Keys are the prefix-cache hashes (SHA-256 over parent, salt and tokens),
stable across processes, so a restarted engine finds its disk blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxllm.kv_transfer.async_load import AsyncLoads
from jaxllm.kv_transfer.base import ConnectorContext, KVConnectorBase
from jaxllm.kv_transfer.config import KVTransferConfig
from jaxllm.kv_transfer.disk_store import DiskStore
from jaxllm.kv_transfer.host_store import HostStore

log = logging.getLogger("jaxllm")
GIB = 1 << 30


def mover_chunk(mover) -> int:
    return getattr(mover, "chunk", 16)


@dataclasses.dataclass
class OffloadMeta:
    loads: list[tuple[int, int]]  # (key, device block) host tier -> device, before this step
    saves: list[tuple[int, int | None, int]]  # (key, parent key, device block) device -> tiers
    async_loads: list[tuple[int, list[tuple[int, int]]]] = dataclasses.field(default_factory=list)
    cancels: list[int] = dataclasses.field(default_factory=list)  # tickets of dropped async loads
    finishes: list[int] = dataclasses.field(default_factory=list)  # copies done: into the pages now


class OffloadingConnector(AsyncLoads, KVConnectorBase):
    def __init__(self, cfg: KVTransferConfig, ctx: ConnectorContext):
        super().__init__(cfg, ctx)
        extra = cfg.kv_connector_extra_config
        cpu_gib = float(extra.get("cpu_gib", ctx.offload_cpu_gib or 0.0))
        disk_dir = extra.get("disk_dir", ctx.offload_disk_dir)
        disk_gib = extra.get("disk_gib", ctx.offload_disk_gib)
        if cpu_gib < 0:
            raise ValueError(f"kv_offload_cpu_gib must be >= 0, got {cpu_gib}")
        if not cpu_gib and not disk_dir:
            raise ValueError("OffloadingConnector needs kv_offload_cpu_gib > 0 or kv_offload_disk_dir")
        self.host = HostStore(int(cpu_gib * GIB))
        self.disk = None
        if disk_dir:
            cap = None if disk_gib is None else int(float(disk_gib) * GIB)
            self.disk = DiskStore(disk_dir, cap, ctx.fingerprint, ctx.block_bytes, ctx.block_shape, ctx.dtype)
        self._lock = threading.Lock()
        self._loads: list[tuple[int, int]] = []
        self.load_async = bool(extra.get("load_async", True))
        self._init_async()
        self._saves: list[tuple[int, int | None, int]] = []
        self._queued: set[int] = set()  # keys in _saves or with the worker, not yet in the host tier
        self._lookup_pins: dict[str, list[int]] = {}  # request -> host keys its last lookup pinned
        self._promo_pins: dict[str, list[int]] = {}  # request -> keys its disk promotion pinned
        self._promoting: set[str] = set()
        self._promoted: set[str] = set()  # promoted once: never made to wait again
        self._ready: set[str] = set()
        self._gone: set[str] = set()  # finished while promoting
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-kv-read") if self.disk is not None else None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-kv-save")
        # The host tier's blocks in page-locked memory (JAX's pinned_host), where the device has it:
        # a load is then a DMA at the link's speed, not a copy through a pageable staging buffer.
        self.pin_host_memory = bool(extra.get("pin_host_memory", True))
        ahead = extra.get("save_copies_ahead", "auto")
        if ahead not in ("auto", None) and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
            raise ValueError(f"kv_connector_extra_config.save_copies_ahead must be an integer >= 0, "
                             f"null or \"auto\", got {ahead!r}")
        self.save_copies_ahead = ahead
        # [chunk, copy claimed, blocks, pinned blocks, copy issued (Event)], FIFO. A copy is claimed
        # under the lock and issued outside it (a device_put into pinned memory can take ms).
        self._save_q: collections.deque[list] = collections.deque()
        self.queries = self.hits = 0
        self.io = {f"kv_offload_{t}_{d}_{u}": 0 for t in ("cpu", "disk") for d in ("load", "save")
                   for u in ("bytes", "seconds")}
        self.io.update({"kv_offload_save_dispatch_seconds": 0.0, "kv_offload_save_issue_seconds": 0.0,
                        "kv_offload_save_issue_max_seconds": 0.0})
        self.last_save_done: float | None = None

    # -- scheduler side -----------------------------------------------------
    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.cfg.is_consumer:
            return 0, False
        S, rid = self.ctx.block_size, req.request_id
        start, limit = num_computed_tokens // S, (req.num_tokens - 1) // S
        with self._lock:
            if rid in self._promoting:
                return None, False
        self.host.unpin(self._lookup_pins.pop(rid, []))
        if start >= limit:
            return 0, False
        keys = self.ctx.block_hashes(req, limit)[start:]
        pinned = self.host.pin(keys)
        self.host.unpin(self._promo_pins.pop(rid, []))  # the lookup's pins take over
        if len(pinned) < len(keys) and self.disk is not None and rid not in self._promoted:
            run = []
            for k in keys[len(pinned):]:
                if k not in self.disk and k not in self.host:
                    break
                run.append(k)
            if any(k not in self.host for k in run):
                self.host.unpin(pinned)
                with self._lock:
                    self._promoting.add(rid)
                self._reader.submit(self._promote, rid, keys[:len(pinned)] + run)
                return None, False
        self._lookup_pins[rid] = pinned
        return len(pinned) * S, self.load_async

    def _promote(self, rid: str, keys: list[int]) -> None:
        """Background: bring a request's disk blocks into the host tier, pinned for it."""
        pins: list[int] = []
        try:
            for k in keys:
                if self.host.pin([k]):
                    pins.append(k)
                    continue
                t0 = time.perf_counter()
                block = self.disk.read(k)
                if block is None:
                    break
                self.io["kv_offload_disk_load_bytes"] += block.nbytes
                self.io["kv_offload_disk_load_seconds"] += time.perf_counter() - t0
                self.host.put(k, self.ctx.mover.pin_block(block) if self.pinned() else block, pin=True)
                pins.append(k)
        except Exception:
            log.exception("KV disk tier: promotion failed; the prompt is recomputed")
        with self._lock:
            self._promoting.discard(rid)
            if rid in self._gone:
                self._gone.discard(rid)
                self.host.unpin(pins)
                return
            self._promoted.add(rid)
            self._ready.add(rid)
            self._promo_pins[rid] = pins
        self.notify_progress()

    def update_state_after_alloc(self, req, block_ids: list[int], num_external_tokens: int) -> None:
        rid, S = req.request_id, self.ctx.block_size
        pins = self._lookup_pins.pop(rid, [])
        n = num_external_tokens // S
        start = req.num_computed_tokens // S
        self.host.unpin(pins[n:])
        pairs = list(zip(pins[:n], block_ids[start:start + n]))
        if pairs and self.load_async:
            self._queue_load(rid, pairs)
        else:
            self._loads.extend(pairs)
        if req.num_preemptions == 0:
            self.queries += req.num_tokens
            self.hits += num_external_tokens

    def build_connector_meta(self) -> OffloadMeta | None:
        """This step's work (none while async loads only copy: nothing to look at)."""
        if not (self._loads or self._saves or self._async or self._cancels or self._finish):
            return None
        meta = OffloadMeta(self._loads, self._saves, *self._take_async())
        self._loads, self._saves = [], []
        return meta

    def request_preempted(self, req, block_ids: list[int]) -> None:
        self.request_finished(req, block_ids)

    def request_finished(self, req, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = req.request_id
        self.host.unpin(self._lookup_pins.pop(rid, []))
        self._drop_load(rid)
        with self._lock:
            self._ready.discard(rid)
            self._promoted.discard(rid)
            if rid in self._promoting:
                self._gone.add(rid)
            self.host.unpin(self._promo_pins.pop(rid, []))
        if not self.cfg.is_producer:
            return False, None
        S = self.ctx.block_size
        n = min(min(req.num_computed_tokens, req.num_tokens) // S, len(block_ids))
        if n:
            hashes = self.ctx.block_hashes(req, n)
            with self._lock:
                for i in range(n):
                    k = hashes[i]
                    if k not in self.host and k not in self._queued:
                        self._queued.add(k)
                        self._saves.append((k, hashes[i - 1] if i else None, block_ids[i]))
        return False, None

    def get_finished(self) -> tuple[set[str], set[str]]:
        self._progress.clear()  # (before looking: a notify after this wakes the next wait)
        with self._lock:
            ready, self._ready = self._ready, set()
        return set(), ready | self._loads_done()

    # -- worker side --------------------------------------------------------
    def save_kv_layer(self, layer_name, pages, meta: OffloadMeta | None) -> None:
        """Gather the blocks on the device (before this step's writes, in dispatch order) and
        start the first chunks' copies to the host; the saver thread waits for them (and
        starts the next ones), so this does not."""
        if not meta or not meta.saves:
            return
        mover, n = self.ctx.mover, mover_chunk(self.ctx.mover)
        t0 = time.perf_counter()
        for i in range(0, len(meta.saves), n):
            part = meta.saves[i:i + n]
            dev = mover.gather_chunk(pages, [b for _, _, b in part])
            with self._lock:
                entry = [dev, False, len(part), None, threading.Event()]
                self._save_q.append(entry)
                start = self.save_copies_ahead is None or len(self._save_q) <= self.save_copies_ahead
                entry[1] = start
            if start:
                self._start_copy(entry)
            self._saver.submit(self._finish_save, part, dev)
        self.io["kv_offload_save_dispatch_seconds"] += time.perf_counter() - t0  # the dispatch thread's

    @property
    def save_copies_ahead(self) -> int | None:
        """Chunks whose device-to-host copies start ahead of the saver (None: all); "auto"
        (the default) is 2 for a numpy host tier and None for a pinned one (the docstring)."""
        if self._ahead == "auto":  # (resolved late: the engine sets the mover after construction)
            return None if self.pinned() else 2
        return self._ahead

    @save_copies_ahead.setter
    def save_copies_ahead(self, ahead: int | str | None) -> None:
        self._ahead = ahead

    def pinned(self) -> bool:
        """Whether the host tier holds its blocks in pinned host memory."""
        return self.pin_host_memory and getattr(self.ctx.mover, "pinned_sharding", None) is not None

    def _start_copy(self, entry: list) -> None:
        """A claimed chunk's device-to-host copy (into pinned memory, or the chunk's own host
        copy); called without the lock."""
        t0 = time.perf_counter()
        try:
            if self.pinned():
                entry[3] = self.ctx.mover.pin_chunk(entry[0], entry[2])
            else:
                entry[0].copy_to_host_async()
        finally:
            entry[4].set()
            dt = time.perf_counter() - t0  # issuing a copy (it may run on after)
            self.io["kv_offload_save_issue_seconds"] += dt
            self.io["kv_offload_save_issue_max_seconds"] = max(self.io["kv_offload_save_issue_max_seconds"], dt)

    def _finish_save(self, part: list[tuple[int, int | None, int]], dev) -> None:
        t0 = time.perf_counter()
        with self._lock:
            mine = self._save_q.popleft()  # this chunk (one saver thread, in submission order)
            claimed = [] if mine[1] else [mine]
            mine[1] = True
            for entry in itertools.islice(self._save_q, self.save_copies_ahead):
                if not entry[1]:  # the next chunks' copies start while this one is stored
                    entry[1] = True
                    claimed.append(entry)
        for entry in claimed:
            self._start_copy(entry)
        mine[4].wait()  # (issued by whichever thread claimed it)
        try:
            if mine[3] is not None:  # pinned: rows of one chunk array, or one array per block
                blocks = mine[3]
                for b in blocks:
                    b.block_until_ready()
                host = None
                if self.disk is not None:  # the disk writer's numpy copy, once per chunk
                    arr = np.asarray(blocks[0].chunk) if hasattr(blocks[0], "chunk") else None
                    host = [arr[b.row] if arr is not None else np.asarray(b) for b in blocks]
            else:
                arr = np.asarray(dev)  # its own array per block: the host tier drops them one by one
                blocks = host = [np.array(arr[j]) for j in range(len(part))]
            for j, ((key, parent, _), block) in enumerate(zip(part, blocks)):
                self.host.put(key, block)
                self.io["kv_offload_cpu_save_bytes"] += block.nbytes
                if self.disk is not None:
                    self.disk.write_async(key, parent, host[j])
        except Exception:
            log.exception("KV host tier: a save failed; those blocks stay device-only")
        finally:
            with self._lock:
                self._queued.difference_update(k for k, _, _ in part)
            self.io["kv_offload_cpu_save_seconds"] += time.perf_counter() - t0
            self.last_save_done = time.time()  # (benchmarks: when the saver finished its last chunk)

    def _host_blocks(self, keys: list[int]) -> list[np.ndarray]:
        blocks = [self.host.get(k) for k in keys]
        if any(b is None for b in blocks):  # pinned since the lookup: cannot happen
            raise RuntimeError("a pinned host KV block went missing")
        return blocks

    def start_load_kv(self, pages, meta: OffloadMeta | None):
        if not meta:
            return pages
        mover = self.ctx.mover
        self._start_async(meta)  # (their copies run behind the steps; see finish_load_kv)
        if meta.loads:
            t0 = time.perf_counter()
            keys = [k for k, _ in meta.loads]
            blocks = self._host_blocks(keys)
            pages = mover.write_blocks(pages, blocks, [b for _, b in meta.loads])
            self.host.unpin(keys)
            self.io["kv_offload_cpu_load_bytes"] += sum(b.nbytes for b in blocks)
            self.io["kv_offload_cpu_load_seconds"] += time.perf_counter() - t0
        return pages

    def wait_for_save(self) -> None:
        pass  # saves to the host tier are done in save_kv_layer; disk writes go on behind

    # -- both ---------------------------------------------------------------
    def flush(self) -> None:
        """Wait for the saves and disk writes queued so far (tests, shutdown)."""
        self._saver.submit(lambda: None).result()
        if self.disk is not None:
            self.disk.flush()

    def stats(self) -> dict:
        d = self.disk
        out = {"external_prefix_cache_queries": self.queries, "external_prefix_cache_hits": self.hits,
               "kv_offload_cpu_bytes": self.host.nbytes, "kv_offload_cpu_blocks": len(self.host),
               "kv_offload_cpu_capacity_bytes": self.host.capacity,
               "kv_offload_disk_bytes": d.nbytes if d is not None else 0, "kv_offload_disk_blocks": len(d) if d is not None else 0,
               "kv_offload_disk_corrupt_blocks": d.num_corrupt if d is not None else 0,
               "kv_offload_disk_failed": bool(d is not None and d.failed),
               "kv_offload_loads_in_flight": len(self._inflight), **self.io}
        if d is not None:
            out["kv_offload_disk_save_bytes"] = d.bytes_written
            out["kv_offload_disk_save_seconds"] = d.seconds_written
        return out

    def shutdown(self) -> None:
        self.flush()
        self._saver.shutdown(wait=True)
        self._watcher.shutdown(wait=True)
        if self._reader is not None:
            self._reader.shutdown(wait=True)
