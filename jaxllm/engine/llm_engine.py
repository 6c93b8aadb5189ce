"""The engine core: requests in, one scheduled step at a time, outputs out.

Both the offline `LLM` and the async server drive this one class: `add_request`,
`step`, `abort_request`. A request with n > 1 becomes n sequences (ids
"<i>_<parent>"): sequence 0 computes the prompt, and when it samples, the other
n - 1 sample from the same logits row (each with its own seed, seed + i) and
are forked off it, sharing its KV blocks by reference count (the scheduler
copies the shared partial block on write). Before each forward pass the step
runs the page copies and swaps the scheduler asked for (`kv_ops`). With async
scheduling the device work runs on a dispatch thread (`dispatch.py`) one step
ahead of the host's reading of outputs.
"""

from __future__ import annotations

import itertools
import logging
import time

from jaxllm.config import EngineConfig
from jaxllm.engine.dispatch import Dispatcher, Launched
from jaxllm.engine.kv_ops import KVOps
from jaxllm.engine.intake import Intake
from jaxllm.engine.outputs_builder import ParentRequest, Sequence
from jaxllm.engine.runner import ModelRunner, resolve_dtype
from jaxllm.engine.sampler import Sampler
from jaxllm.engine.startup import load_checkpoint, step_shapes
from jaxllm.engine.step_io import StepIO
from jaxllm.models import registry
from jaxllm.kv_transfer.events import make_publisher, to_vllm
from jaxllm.kv_transfer.factory import build_for_engine, transfer_config
from jaxllm.outputs import RequestOutput
from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

log = logging.getLogger("jaxllm")


class LLMEngine(Intake, StepIO):
    def __init__(self, cfg: EngineConfig, *, hf_config: dict | None = None, weights=None,
                 tokenizer=None):
        from jaxllm.parallel.multihost import init_distributed  # before anything touches jax
        init_distributed(cfg.distributed_coordinator, cfg.num_processes, cfg.process_id)
        import jax
        platform = jax.devices()[0].platform
        ckpt = load_checkpoint(cfg, hf_config, weights, tokenizer)
        weights = ckpt.weights
        self.cfg = cfg
        self.tokenizer = ckpt.tokenizer
        self.model_entry = registry.resolve(ckpt.hf_config)
        self.model_cfg = self.model_entry.config(ckpt.hf_config)
        shapes = step_shapes(cfg, self.model_cfg, platform)
        self.max_model_len = shapes.max_model_len
        self.seq_buckets, self.token_buckets = shapes.seq_buckets, shapes.token_buckets
        max_tokens = self.token_buckets[-1]
        spec_cfg = cfg.speculative_config

        dtype = resolve_dtype(cfg.dtype, platform)
        state = None
        if weights is not None:
            state = self.model_entry.to_state(self.model_cfg, weights, dtype, consume=ckpt.owned)
            del weights, ckpt
        # A draft's config, its KV bytes per block, the hidden states an EAGLE head reads (spec/)
        draft_hf, draft_bytes, capture = None, 0, ()
        if spec_cfg is not None:
            from jaxllm.spec.build import draft_config
            draft_hf, draft_bytes, capture = draft_config(spec_cfg, cfg, self.model_cfg, dtype)
        self.runner = ModelRunner(self.model_cfg, cfg, self.max_model_len, state,
                                  max_rows=self.seq_buckets[-1], max_num_tokens=max_tokens,
                                  extra_block_bytes=draft_bytes, capture=capture,
                                  token_buckets=self.token_buckets)
        if cfg.preemption_mode == "swap" and self.runner.channel is not None:
            raise ValueError("preemption_mode='swap' needs a single process (each process would "
                             "hold its own host pages); use preemption_mode='recompute'")
        pages = self.runner.kv_pages
        host_blocks = 0
        if cfg.preemption_mode == "swap":
            host_blocks = int(cfg.swap_space * (1 << 30)) // (pages.nbytes // self.runner.num_blocks)
        block_io = transfer_config(cfg) is not None
        self.kv_ops = KVOps(self.runner.num_blocks, cfg.max_num_seqs, host_blocks, pages, block_io,
                            compiler_options=self.runner.compiler_options)
        self.kv = KVCacheManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 num_host_blocks=host_blocks)
        self.connector = build_for_engine(cfg, self.model_cfg, self.kv, self.kv_ops, pages.dtype,
                                          random_weights=state is None)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=max_tokens,
            max_model_len=self.max_model_len, policy=cfg.scheduling_policy,
            preemption_mode=cfg.preemption_mode,
            num_lookahead_tokens=spec_cfg.num_lookahead_tokens if spec_cfg else 0,
            token_buckets=self.token_buckets), self.kv, self.connector)
        self.kv_events = make_publisher(cfg.kv_events_config)  # KV-cache events for routers
        if self.kv_events is not None:
            self.kv.pool.events = []
        self.beam = None  # the running jaxllm.beam_search.BeamSearch, if any
        self.sampler = Sampler(self.model_cfg.vocab_size, self.max_model_len,
                               pad_to=self.runner.max_rows)
        self.spec = None  # jaxllm.spec.decoder.SpecDecoder when speculative_config is set
        if spec_cfg is not None:
            from jaxllm.spec.build import build_decoder
            self.spec = build_decoder(self, spec_cfg, draft_hf, host_blocks)
        self.dispatcher = Dispatcher(self.runner, self.kv_ops, self.sampler,
                                     threaded=cfg.async_scheduling and self.runner.channel is None,
                                     connector=self.connector)
        self.dispatcher.spec_hook = self.spec.hook if self.spec is not None else None
        self._inflight: Launched | None = None
        self.parents: dict[str, ParentRequest] = {}
        self.seqs: dict[str, Sequence] = {}
        self._counter = itertools.count()
        self.eos_ids = self._eos_ids()
        self._structured = None  # jaxllm.structured.manager.StructuredManager, made on first use
        if self.tokenizer is not None:
            from jaxllm.structured import register_eos
            register_eos(self.tokenizer, self.eos_ids)
        self.warmup_seconds = 0.0
        if not cfg.skip_warmup:
            self.warmup()
        self.traces_after_warmup = self.num_traces()
        log.info("engine ready: %d KV blocks of %d tokens, max_num_batched_tokens %d (%s), buckets "
                 "tokens=%s seqs=%s, async scheduling %s, warm-up %.1fs", self.runner.num_blocks,
                 cfg.block_size, max_tokens, cfg.usage_context, self.token_buckets, self.seq_buckets,
                 "on" if self.async_scheduling else "off", self.warmup_seconds)

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # -- compilation --------------------------------------------------------
    def warmup(self) -> None:
        t0 = time.perf_counter()
        self.runner.warmup(self.token_buckets, self.seq_buckets)
        for r in self.seq_buckets:
            self.runner.warmup_sampler(self.sampler, r)  # as the runner's logits are placed
        self.runner.kv_pages = self.kv_ops.warmup(self.runner.kv_pages)
        if self.spec is not None:
            tp = self.runner.tp
            self.spec.warmup(self.sampler, self.seq_buckets, tp.local_devices[0] if tp is not None else None,
                             self.token_buckets, self.cfg.max_num_seqs)
        channel = self.runner.channel
        if channel is not None and channel.is_leader:
            channel.send_copies([])  # compiles the copy broadcast (followers copy nothing)
        self.warmup_seconds = time.perf_counter() - t0

    def num_traces(self) -> int:
        spec = self.spec.num_compiled() if self.spec is not None else 0
        return (self.runner.num_traces + self.sampler.num_compiled_variants()
                + self.kv_ops.num_compiled() + spec)

    # -- the step -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch a step; return the outputs of the last one finished.

        With `async_scheduling` the step scheduled here runs on the device while
        the host reads the step before (vLLM's async scheduling): tokens still
        in flight enter the batch as placeholders the device fills from the
        previous step's sampled ids. Steps that fork siblings, use penalties or
        beam search are read before the next is scheduled, and so are steps that
        verify drafts of sampled (not greedy) requests (`_overlaps`).
        """
        prev, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = self._fail_grammars() if self._structured is not None else []
        if prev is not None and not self._overlaps(prev):
            outputs, prev = outputs + self._process(prev), None
        out = self.scheduler.schedule()
        launched = self._launch(out, prev)
        try:
            if prev is not None:
                outputs += self._process(prev, then=launched)
        finally:  # the draw of `launched` waits for its mask, which needs prev's tokens
            if launched is not None:
                self._fill_mask(launched)
        if launched is not None:
            if self.dispatcher.threaded and self.beam is None:
                self._inflight = launched
            else:
                outputs += self._process(launched)
        if self.connector is not None and not self.scheduler.has_unfinished():
            self._flush_connector()
        if self.kv_events is not None:
            self.kv_events.publish(to_vllm(self.kv.take_events(), self.cfg.block_size))
        merged = {o.request_id: o for o in outputs}  # a request's later output supersedes
        return list(merged.values())

    def _flush_connector(self) -> None:
        """Idle: run the saves finished requests queued now, not at some later step."""
        meta = self.connector.build_connector_meta()
        if meta is not None:
            self.dispatcher.submit(SchedulerOutput(kv_connector_metadata=meta))

    def flush_kv(self) -> None:
        """Wait until the KV connector's queued saves, disk writes included, are done."""
        self.flush()
        if self.connector is not None:
            self._flush_connector()
            self.dispatcher.drain()
            getattr(self.connector, "flush", lambda: None)()

    @property
    def async_scheduling(self) -> bool:
        return self.dispatcher.threaded

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        """Switch overlapped steps on or off between steps (benchmarks compare both)."""
        if on and self.runner.channel is not None:
            raise ValueError("async scheduling needs a single process")
        if on != self.async_scheduling:
            self.flush()
            self.dispatcher.threaded = on

    def flush(self) -> list[RequestOutput]:
        """Read the step in flight, if any (async scheduling); nothing is left running."""
        prev, self._inflight = self._inflight, None
        return [] if prev is None else self._process(prev)

    def stats(self) -> dict:
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_total_blocks": self.runner.num_blocks,
            "kv_cache_usage": self.kv.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compiles": self.num_traces(),
            "compiles_after_warmup": self.num_traces() - self.traces_after_warmup,
            "warmup_seconds": self.warmup_seconds,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "num_swapped_out": self.scheduler.num_swapped_out,
            "num_cow_copies": self.kv.num_cow_copies,
            "num_host_blocks": self.kv.host.num_blocks,
            "num_free_host_blocks": self.kv.host.num_free + self.kv.host.num_pending,
            **(self.connector.stats() if self.connector is not None else {}),
            **(self._structured.stats() if self._structured is not None else {}),
            **(self.spec.stats() if self.spec is not None else {}),
        }
