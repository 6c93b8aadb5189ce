"""MultiConnector: several connectors chained, as vLLM's.

Loads come from the first connector that matches tokens (in the configured order);
saves, finishes and the worker calls go to every connector. A request's blocks are
freed once every connector that delayed the free reported it sent.
`kv_connector_extra_config = {"connectors": [{"kv_connector": ..., "kv_role": ...,
"kv_connector_extra_config": {...}}, ...]}`.
"""

from __future__ import annotations

from jaxllm.kv_transfer.base import ConnectorContext, KVConnectorBase
from jaxllm.kv_transfer.config import KVTransferConfig


class MultiConnector(KVConnectorBase):
    def __init__(self, cfg: KVTransferConfig, ctx: ConnectorContext):
        super().__init__(cfg, ctx)
        from jaxllm.kv_transfer.factory import make_connector
        subs = cfg.kv_connector_extra_config.get("connectors")
        if not isinstance(subs, list) or not subs:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.connectors must be a "
                             "non-empty list of connector configs")
        self.connectors = [make_connector(KVTransferConfig.from_dict(c), ctx) for c in subs]
        for c in self.connectors:  # one event: any of them finishing wakes the engine
            c._progress = self._progress
        self._loader: dict[str, int] = {}  # request -> index of the connector loading it
        self._delays: dict[str, int] = {}  # request -> connectors still sending

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        for i, c in enumerate(self.connectors):
            n, is_async = c.get_num_new_matched_tokens(req, num_computed_tokens)
            if n is None or n > 0:
                self._loader[req.request_id] = i
                return n, is_async
        self._loader.pop(req.request_id, None)
        return 0, False

    def update_state_after_alloc(self, req, block_ids, num_external_tokens):
        chosen = self._loader.pop(req.request_id, None)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(req, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self):
        metas = [c.build_connector_meta() for c in self.connectors]
        return metas if any(m is not None for m in metas) else None

    def request_preempted(self, req, block_ids):
        for c in self.connectors:
            c.request_preempted(req, block_ids)

    def request_finished(self, req, block_ids):
        self._loader.pop(req.request_id, None)
        delays, params = 0, {}
        for c in self.connectors:
            d, p = c.request_finished(req, block_ids)
            delays += bool(d)
            params.update(p or {})
        if delays:
            self._delays[req.request_id] = delays
        return delays > 0, params or None

    def get_finished(self):
        self._progress.clear()
        sent, received = set(), set()
        for c in self.connectors:
            s, r = c.get_finished()
            received |= r
            for rid in s:
                left = self._delays.get(rid, 1) - 1
                if left <= 0:
                    self._delays.pop(rid, None)
                    sent.add(rid)
                else:
                    self._delays[rid] = left
        return sent, received

    def finish_load_kv(self, pages, meta):
        for c, m in zip(self.connectors, meta or [None] * len(self.connectors)):
            pages = c.finish_load_kv(pages, m)
        return pages

    def start_load_kv(self, pages, meta):
        for c, m in zip(self.connectors, meta or [None] * len(self.connectors)):
            pages = c.start_load_kv(pages, m)
        return pages

    def wait_for_layer_load(self, layer_name=None):
        for c in self.connectors:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, pages, meta):
        for c, m in zip(self.connectors, meta or [None] * len(self.connectors)):
            c.save_kv_layer(layer_name, pages, m)

    def wait_for_save(self):
        for c in self.connectors:
            c.wait_for_save()

    def flush(self):
        for c in self.connectors:
            getattr(c, "flush", lambda: None)()

    def stats(self):
        out: dict = {}
        for c in self.connectors:
            for k, v in c.stats().items():
                out[k] = out.get(k, 0) + v if isinstance(v, (int, float)) and not isinstance(v, bool) \
                    else (out.get(k) or v)
        return out

    def shutdown(self):
        for c in self.connectors:
            c.shutdown()
