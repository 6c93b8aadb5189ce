"""Asynchronous host-tier loads of the OffloadingConnector (vLLM's load_kv_async).

A request admitted with host-tier blocks gets a ticket; its loads start with the next
step's meta: the worker issues the host-to-device copies of all its blocks in one
`KVOps.put_blocks` call (one array per block: faster than one stacked array, whose host
copy alone costs as much) and hands them to a watcher thread, which blocks until the
copies are done and then wakes the engine (`notify_progress`).

The scheduler side looks at the copies itself, before every schedule (`_loads_done`, from
`get_finished`): a request whose copies are done is reported ready at once and scheduled in
that same step, whose meta carries the ticket in `finishes`, so the worker writes the
blocks into the pages (`scatter_blocks`) just before that step's forward pass. No step
round trip between the worker seeing the copies done and the scheduler hearing of it, no
per-step polling meta while loads are in flight, and an engine with nothing else to run
waits for the copies (`wait_for_progress`) instead of sleeping in a loop.

`load_log` keeps the last loads' timings (time.time(), as `RequestMetrics`): admitted (blocks
allocated), dispatched (the dispatch thread reached the load), issued / issued_end (the copies
started), copied (the watcher saw them done), ready (reported to the scheduler), written
(scattered into the pages).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("jaxllm")


@dataclasses.dataclass
class PendingLoad:
    """An asynchronous load on the worker: its host-to-device copies in flight."""

    dev: list  # device blocks (KVOps.put_blocks)
    ids: list[int]  # the request's device blocks they go to
    start: float  # perf_counter() when the copies were issued
    nbytes: int
    copied: float | None = None  # perf_counter() when the watcher saw them done
    copied_at: float | None = None  # the same, time.time()


class AsyncLoads:
    """Mixed into OffloadingConnector (which holds `_lock`, `host`, `ctx`, `io`)."""

    def _init_async(self) -> None:
        self._tickets = 0
        self._async: list[tuple[int, list[tuple[int, int]]]] = []  # (ticket, (key, block)) to start
        self._inflight: dict[str, int] = {}  # request -> ticket of its async load, until reported
        self._cancels: list[int] = []  # tickets of dropped loads, for the worker
        self._finish: list[int] = []  # tickets reported ready: the worker writes them next step
        self._pending: dict[int, PendingLoad] = {}  # worker side: ticket -> copies in flight
        self._times: dict[int, dict] = {}
        self.load_log: collections.deque[dict] = collections.deque(maxlen=64)
        self._watcher = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-kv-load")

    # -- scheduler side -----------------------------------------------------
    def _queue_load(self, rid: str, pairs: list[tuple[int, int]]) -> None:
        self._tickets += 1
        self._async.append((self._tickets, pairs))
        self._inflight[rid] = self._tickets
        self._times[self._tickets] = {"request_id": rid, "blocks": len(pairs), "admitted": time.time()}

    def _loads_done(self) -> set[str]:
        """Requests whose copies are done: ready now; their blocks are written with the
        meta of the step being scheduled (before its forward pass)."""
        out = set()
        for rid, t in list(self._inflight.items()):
            with self._lock:
                p = self._pending.get(t)
            if p is not None and self._load_done(p):
                del self._inflight[rid]
                self._finish.append(t)
                self._times.get(t, {})["ready"] = time.time()
                out.add(rid)
        return out

    def _load_done(self, p: PendingLoad) -> bool:
        return p.copied is not None

    def _drop_load(self, rid: str) -> None:
        """rid finished while loading: unpin what is not started, cancel what is."""
        ticket = self._inflight.pop(rid, None)
        if ticket is None:
            return
        self._times.pop(ticket, None)
        for i, (t, pairs) in enumerate(self._async):
            if t == ticket:
                del self._async[i]
                self.host.unpin([k for k, _ in pairs])
                return
        self._cancels.append(ticket)  # the worker drops it before the blocks' next owner writes

    def _take_async(self) -> tuple[list, list[int], list[int]]:
        out = self._async, self._cancels, self._finish
        self._async, self._cancels, self._finish = [], [], []
        return out

    # -- worker side --------------------------------------------------------
    def _start_async(self, meta) -> None:
        """Drop cancelled loads, start new ones."""
        mover = self.ctx.mover
        for t in meta.cancels:
            with self._lock:
                self._pending.pop(t, None)
        for t, pairs in meta.async_loads:
            tm = self._times.get(t, {})
            tm["dispatched"] = time.time()  # the dispatch thread reached this load
            keys = [k for k, _ in pairs]
            blocks = self._host_blocks(keys)
            tm["issued"], start = time.time(), time.perf_counter()
            p = PendingLoad(mover.put_blocks(blocks), [b for _, b in pairs], start,
                            sum(b.nbytes for b in blocks))
            tm["issued_end"] = time.time()
            self.host.unpin(keys)  # the copies hold the arrays; host blocks are never rewritten
            with self._lock:
                self._pending[t] = p
            self._watcher.submit(self._watch, p)

    def finish_load_kv(self, pages, meta):
        """The loads this step's schedule found copied: into the pages, first of the step's
        page moves (a held request's blocks may be freed and given to another request in
        that schedule, whose swap-ins, copies and forward pass then write them after)."""
        if not meta or not meta.finishes:
            return pages
        mover = self.ctx.mover
        for t in meta.finishes:
            with self._lock:
                p = self._pending.pop(t)
            pages = mover.scatter_blocks(pages, p.dev, p.ids)
            self.io["kv_offload_cpu_load_bytes"] += p.nbytes
            self.io["kv_offload_cpu_load_seconds"] += (p.copied or time.perf_counter()) - p.start
            tm = self._times.pop(t, None)
            if tm is not None:
                tm.update(copied=p.copied_at, written=time.time(), bytes=p.nbytes,
                          copy_s=(p.copied or time.perf_counter()) - p.start)
                self.load_log.append(tm)
        return pages

    def _wait_copies(self, p: PendingLoad) -> None:
        for a in p.dev:
            a.block_until_ready()

    def _watch(self, p: PendingLoad) -> None:
        """Watcher thread: wait for a load's copies, then wake the engine."""
        try:
            self._wait_copies(p)
        except Exception:  # the scatter on the dispatch thread raises it again
            log.exception("KV host tier: an asynchronous load's copy failed")
        p.copied_at = time.time()
        p.copied = time.perf_counter()
        self.notify_progress()
