"""KV a connector loads for a request (`jaxllm.kv_transfer`), as the scheduler tracks it: a
request that loads asynchronously waits in `loading` with its blocks until the connector names
the load done, then rejoins the queue's front with those tokens computed (`_holding`: its
blocks may still be taken back when the pool runs dry); finished requests whose blocks the
connector still sends wait in `delayed`.

`RemoteLoads` is a mixin of `Scheduler` (scheduler.py)."""

from __future__ import annotations

from jaxllm.runtime.request import Request, RequestStatus


class RemoteLoads:
    def _evict_parked(self, keep: Request | None = None) -> bool:
        """Free the blocks of the oldest parked request that still has some, else of a
        waiting one back from a KV load (its blocks stay in the prefix cache; it starts over,
        so it can never hold blocks a request queued before it needs)."""
        for req in self.parked.values():
            if req.request_id in self.kv.tables:
                self.kv.free(req)
                return True
        for rid, req in self._holding.items():
            if req is not keep:
                del self._holding[rid]
                self.kv.free(req)
                req.num_computed_tokens = 0
                return True
        return False

    def _park_loading(self, req: Request, hits: list, ext: int) -> None:
        """req holds its blocks (hits + `ext` tokens the connector loads asynchronously):
        it waits off the batch until the connector names the load done."""
        num_hit = len(hits) * self.kv.block_size
        req.num_computed_tokens += num_hit
        self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), ext)
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit + ext
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[req.request_id] = req
        self._loading_ext[req.request_id] = ext

    def _poll_connector(self) -> None:
        """Requests whose KV the connector fetched rejoin the queue; sent ones free blocks."""
        sent, ready = self.connector.get_finished()
        for rid in ready:
            req = self.loading.pop(rid, None)
            if req is not None:
                if rid in self._loading_ext:  # its blocks hold the loaded tokens now
                    req.num_computed_tokens += self._loading_ext.pop(rid)
                    req.status = RequestStatus.WAITING
                    self.kv.cache_full_blocks(req)  # (their writes precede any later step)
                    self._holding[rid] = req
                self.waiting.add_preempted(req)
        for rid in sent:
            req = self.delayed.pop(rid, None)
            if req is not None:
                self.kv.free(req)
