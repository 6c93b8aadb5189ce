"""Prometheus metrics for /metrics, named after vLLM's (prefix `jaxllm:` instead of `vllm:`).

Latencies are observed by `AsyncLLM` as outputs reach the event loop (it calls
the `StatObserver` methods below); gauges are read from the engine's stats at
scrape time, so they cost nothing between scrapes. Each app has its own
registry so several servers can live in one process (the tests do).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's metric set; implements `jaxllm.engine.async_engine.StatObserver`."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("jaxllm:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("jaxllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("jaxllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("jaxllm:request_queue_time_seconds", "Time a request waited before it was "
                               "first scheduled (arrival to first step).", labels, buckets=_LATENCY_BUCKETS,
                               registry=r).labels(model_name)
        self.prefill = Histogram("jaxllm:request_prefill_time_seconds", "Time from a request's first step to "
                                 "its first token.", labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.running = Gauge("jaxllm:num_requests_running", "Sequences running in the engine.",
                             labels, registry=r).labels(model_name)
        self.waiting = Gauge("jaxllm:num_requests_waiting", "Sequences waiting to be scheduled.",
                             labels, registry=r).labels(model_name)
        self.kv_usage = Gauge("jaxllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                              labels, registry=r).labels(model_name)
        self.prompt_tokens = Counter("jaxllm:prompt_tokens", "Prompt tokens admitted.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("jaxllm:generation_tokens", "Tokens generated.",
                                         labels, registry=r).labels(model_name)
        self._success = Counter("jaxllm:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.preemptions = Gauge("jaxllm:num_preemptions", "Requests preempted so far (cumulative).",
                                 labels, registry=r).labels(model_name)
        self.prefix_queries = Gauge("jaxllm:prefix_cache_queries", "Prefix-cache block queries (cumulative).",
                                    labels, registry=r).labels(model_name)
        self.prefix_hits = Gauge("jaxllm:prefix_cache_hits", "Prefix-cache block hits (cumulative).",
                                 labels, registry=r).labels(model_name)
        self.ext_queries = Gauge("jaxllm:external_prefix_cache_queries",
                                 "Prompt tokens looked up in the KV connector's tiers (cumulative).",
                                 labels, registry=r).labels(model_name)
        self.ext_hits = Gauge("jaxllm:external_prefix_cache_hits",
                              "Prompt tokens loaded from the KV connector's tiers (cumulative).",
                              labels, registry=r).labels(model_name)
        io = labels + ["tier", "direction"]
        self.offload_bytes = Gauge("jaxllm:kv_offload_bytes", "KV bytes moved per offload tier and "
                                   "direction (load: into the engine; save: out of it; cumulative).",
                                   io, registry=r)
        self.offload_seconds = Gauge("jaxllm:kv_offload_seconds", "Seconds spent moving KV per offload "
                                     "tier and direction (cumulative).", io, registry=r)
        self.offload_used = Gauge("jaxllm:kv_offload_store_bytes", "Bytes held by each offload tier.",
                                  labels + ["tier"], registry=r)
        self.offload_blocks = Gauge("jaxllm:kv_offload_store_blocks", "Blocks held by each offload tier.",
                                    labels + ["tier"], registry=r)
        self.mask_seconds = Gauge("jaxllm:structured_mask_seconds", "Host seconds spent filling "
                                  "structured-output token bitmasks (cumulative).", labels, registry=r).labels(model_name)
        self.mask_steps = Gauge("jaxllm:structured_mask_steps", "Steps that filled a structured-output "
                                "bitmask (cumulative).", labels, registry=r).labels(model_name)
        self.compile_seconds = Gauge("jaxllm:structured_compile_seconds", "Seconds spent compiling "
                                     "grammars (cumulative).", labels, registry=r).labels(model_name)
        self.compiles = Gauge("jaxllm:structured_compiles", "Grammars compiled (cumulative; cache hits "
                              "not counted).", labels, registry=r).labels(model_name)
        self.rejected = Counter("jaxllm:request_rejected", "Requests refused because the server was overloaded.",
                                labels, registry=r).labels(model_name)
        self.model_name = model_name

        # Speculative decoding (vLLM's counters), advanced at scrape time from the engine's totals.
        self.spec_drafts = Counter("jaxllm:spec_decode_num_drafts", "Draft runs verified.",
                                   labels, registry=r).labels(model_name)
        self.spec_draft_tokens = Counter("jaxllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                         labels, registry=r).labels(model_name)
        self.spec_accepted = Counter("jaxllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                     labels, registry=r).labels(model_name)
        self.spec_per_pos = Counter("jaxllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft.",
                                    labels + ["position"], registry=r)
        self._spec_seen: dict = {}

    # -- StatObserver ------------------------------------------------------
    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, new_tokens: int, ttft: float | None, itl: float | None) -> None:
        self.generation_tokens.inc(new_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def on_request_finished(self, e2e: float, finish_reason: str | None,
                            queue: float | None = None, prefill: float | None = None) -> None:
        self.e2e.observe(e2e)
        if queue is not None:
            self.queue.observe(queue)
        if prefill is not None:
            self.prefill.observe(prefill)
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    # -- scrape ------------------------------------------------------------
    def _render_offload(self, stats: dict) -> None:
        m = self.model_name
        self.ext_queries.set(stats["external_prefix_cache_queries"])
        self.ext_hits.set(stats["external_prefix_cache_hits"])
        for tier in ("cpu", "disk"):
            for d in ("load", "save"):
                self.offload_bytes.labels(m, tier, d).set(stats.get(f"kv_offload_{tier}_{d}_bytes", 0))
                self.offload_seconds.labels(m, tier, d).set(stats.get(f"kv_offload_{tier}_{d}_seconds", 0))
            self.offload_used.labels(m, tier).set(stats.get(f"kv_offload_{tier}_bytes", 0))
            self.offload_blocks.labels(m, tier).set(stats.get(f"kv_offload_{tier}_blocks", 0))

    def _render_spec(self, stats: dict) -> None:
        seen = self._spec_seen
        for key, counter in (("spec_decode_num_drafts", self.spec_drafts),
                             ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_decode_num_accepted_tokens", self.spec_accepted)):
            counter.inc(stats[key] - seen.get(key, 0))
            seen[key] = stats[key]
        for pos, n in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            self.spec_per_pos.labels(self.model_name, str(pos)).inc(n - seen.get(pos, 0))
            seen[pos] = n

    def render(self, stats: dict) -> bytes:
        """Refresh the gauges from engine stats and return the exposition text."""
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        self.preemptions.set(stats.get("num_preemptions", 0))
        self.prefix_queries.set(stats.get("prefix_cache_queries", 0))
        self.prefix_hits.set(stats.get("prefix_cache_hits", 0))
        if "structured_mask_steps" in stats:
            self.mask_seconds.set(stats["structured_mask_seconds"])
            self.mask_steps.set(stats["structured_mask_steps"])
            self.compile_seconds.set(stats["structured_compile_seconds"])
            self.compiles.set(stats["structured_compiles"])
        if "external_prefix_cache_queries" in stats:
            self._render_offload(stats)
        if "spec_decode_num_drafts" in stats:
            self._render_spec(stats)
        return generate_latest(self.registry)
