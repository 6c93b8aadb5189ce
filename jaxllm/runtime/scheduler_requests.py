"""The scheduler's table of requests: adding one (with its n > 1 siblings, forked off it once
its prompt samples), finishing or aborting one wherever it is (queued, running, parked, loading
KV, or held for the connector's send), and forking a running or parked request (beam search).

`Requests` is a mixin of `Scheduler` (scheduler.py), whose state it reads and changes."""

from __future__ import annotations

import time

from jaxllm.runtime.request import Request, RequestStatus


class Requests:
    def add(self, req: Request, forks: list[Request] = ()) -> None:
        """Queue req; `forks` are its n > 1 siblings, forked once its prompt is done."""
        ids = [req.request_id] + [f.request_id for f in forks]
        if len(set(ids)) != len(ids) or any(i in self.requests for i in ids):
            raise ValueError(f"duplicate request id among {ids!r}")
        for r in [req, *forks]:
            r.seq_no = next(self._seq)
            self.requests[r.request_id] = r
        for f in forks:
            self._leader_of[f.request_id] = req
        req.pending_forks = list(forks)
        self.waiting.add(req)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is and free its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        leader = self._leader_of.pop(request_id, None)
        if leader is not None:
            leader.pending_forks.remove(req)
        elif self.loading.pop(request_id, None) is not None:
            self._loading_ext.pop(request_id, None)
        elif self._holding.pop(request_id, None) is not None:
            self.waiting.remove(req)
        elif self.parked.pop(request_id, None) is None:
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
        if req.pending_forks:  # the first sibling takes over the prompt
            heir, *rest = req.pending_forks
            req.pending_forks, heir.pending_forks = [], rest
            del self._leader_of[heir.request_id]
            for f in rest:
                self._leader_of[f.request_id] = heir
            self.waiting.add_preempted(heir)
        if not req.finished:
            req.status = status
        req.finished_time = time.time()
        if self.connector is not None:
            delay, req.kv_transfer_params_out = self.connector.request_finished(
                req, self.kv.block_ids(request_id))
            if delay:
                self.delayed[request_id] = req
                return req
        self.kv.free(req)
        return req

    def fork(self, parent: Request, child: Request) -> None:
        """Start `child`, whose tokens extend parent's computed ones, from parent's blocks.

        With parent's blocks resident (running, or parked and not evicted) the
        child shares them and computes only what follows; otherwise it queues
        as a new request (the prefix cache may still cover its full blocks).
        """
        if child.request_id in self.requests:
            raise ValueError(f"duplicate request id {child.request_id!r}")
        nc = parent.num_computed_tokens
        if parent.request_id not in self.kv.tables or nc == 0:
            self.add(child)
            return
        if child.num_tokens <= nc or child.token_slice(0, nc) != parent.token_slice(0, nc):
            raise ValueError("a fork must extend its parent's computed tokens")
        child.seq_no = next(self._seq)
        self.requests[child.request_id] = child
        self._share(parent, child)

    def _share(self, parent: Request, child: Request) -> None:
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self._insert_running(child)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)
