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
from concurrent.futures import Future

from jaxllm.config import (EngineConfig, default_buckets, default_max_num_batched_tokens,
                           default_token_buckets)
from jaxllm.engine.batch import build_batch, with_fork_rows, with_logit_rows  # noqa: F401 (re-export)
from jaxllm.engine.dispatch import PAD_ROW, Dispatcher, Launched
from jaxllm.engine.kv_ops import KVOps
from jaxllm.engine.outputs_builder import ParentRequest, Sequence, make_output
from jaxllm.engine.runner import ModelRunner
from jaxllm.engine.sampler import SampleRow, Sampler
from jaxllm.models import registry
from jaxllm.kv_transfer.events import make_publisher, to_vllm
from jaxllm.kv_transfer.factory import build_for_engine, transfer_config
from jaxllm.outputs import RequestMetrics, RequestOutput
from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.request import Request, RequestStatus, StopRule
from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.spec.shift import host_rows

log = logging.getLogger("jaxllm")
IDLE_WAIT_S = 0.005  # at most, with only KV loads in flight (a finished load wakes it at once)


class LLMEngine:
    def __init__(self, cfg: EngineConfig, *, hf_config: dict | None = None, weights=None,
                 tokenizer=None):
        from jaxllm.parallel.multihost import init_distributed  # before anything touches jax
        init_distributed(cfg.distributed_coordinator, cfg.num_processes, cfg.process_id)
        owned = hf_config is None  # weights we loaded ourselves are consumed while stacking
        if hf_config is None and (cfg.load_format == "dummy" or cfg.random_shape):
            from jaxllm.models.dummy import dummy_model
            hf_config, loaded_tok = dummy_model(cfg.model, cfg.random_shape)
            tokenizer = tokenizer or loaded_tok
        elif hf_config is None:
            from jaxllm.models.loader import load_model_files
            from jaxllm.quantization.checkpoints import load_prequantized
            # Pre-quantized checkpoints (HF FP8, GGUF with quantization="gguf") load as stored.
            loaded = load_prequantized(cfg.model, cfg.quantization)
            hf_config, weights, loaded_tok = loaded or load_model_files(cfg.model, cfg.cache_dir)
            tokenizer = tokenizer or loaded_tok
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_entry = registry.resolve(hf_config)
        self.model_cfg = self.model_entry.config(hf_config)
        self.max_model_len = cfg.max_model_len or min(self.model_cfg.max_position_embeddings, 2048)
        window = self.model_cfg.sliding_window
        if window and self.max_model_len > window:
            log.warning("sliding-window attention is not implemented: capping max_model_len %d to "
                        "the window %d, where full attention is exact", self.max_model_len, window)
            self.max_model_len = window
        import jax
        max_tokens = cfg.max_num_batched_tokens or default_max_num_batched_tokens(
            jax.devices()[0].platform, cfg.usage_context, cfg.max_num_seqs)
        self.seq_buckets = cfg.seq_buckets or default_buckets(cfg.max_num_seqs, 8)
        spec_cfg = cfg.speculative_config
        if spec_cfg is not None:  # a logits row per draft position (jaxllm/spec/decoder.py)
            from jaxllm.spec.decoder import row_buckets
            self.seq_buckets = row_buckets(self.seq_buckets, cfg.max_num_seqs, spec_cfg,
                                           explicit=cfg.seq_buckets is not None)
        self.token_buckets = cfg.token_buckets or default_token_buckets(max_tokens, self.seq_buckets)
        max_tokens = self.token_buckets[-1]
        if self.seq_buckets[-1] < cfg.max_num_seqs:
            raise ValueError(f"largest seq bucket {self.seq_buckets[-1]} < max_num_seqs {cfg.max_num_seqs}")

        state = None
        if weights is not None:
            from jaxllm.engine.runner import resolve_dtype
            import jax
            dtype = resolve_dtype(cfg.dtype, jax.devices()[0].platform)
            state = self.model_entry.to_state(self.model_cfg, weights, dtype, consume=owned)
            del weights
        # A draft's config, its KV bytes per block, the hidden states an EAGLE head reads (spec/)
        draft_hf, draft_bytes, capture = None, 0, ()
        if spec_cfg is not None:
            from jaxllm.engine.runner import resolve_dtype
            from jaxllm.spec.build import draft_config
            draft_hf, draft_bytes, capture = draft_config(spec_cfg, cfg, self.model_cfg,
                                                 resolve_dtype(cfg.dtype, jax.devices()[0].platform))
        self.runner = ModelRunner(self.model_cfg, cfg, self.max_model_len, state,
                                  max_rows=self.seq_buckets[-1], max_num_tokens=max_tokens,
                                  extra_block_bytes=draft_bytes, capture=capture,
                                  token_buckets=tuple(self.token_buckets))
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
            token_buckets=tuple(self.token_buckets)), self.kv, self.connector)
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
                 cfg.block_size, max_tokens, cfg.usage_context, self.token_buckets, self.seq_buckets, "on" if self.async_scheduling else "off",
                 self.warmup_seconds)

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

    # -- requests -----------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} out of range for vocab size {self.model_cfg.vocab_size}")
        return None, ids

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt length {len(prompt_ids)} is longer than max_model_len "
                             f"{self.max_model_len}")
        if params.logprobs is not None and params.logprobs > self.sampler.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} > max {self.sampler.max_logprobs}")
        if params.n > self.cfg.max_num_seqs:  # the n sequences run side by side after the fork
            raise ValueError(f"n={params.n} is larger than max_num_seqs={self.cfg.max_num_seqs}")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (this engine has none)")
        if priority != 0 and self.cfg.scheduling_policy != "priority":
            raise ValueError(f"got priority {priority} but priority scheduling is not enabled "
                             "(scheduling_policy='priority')")

    def next_seed(self) -> int:
        """A fresh per-sequence seed for a request that did not set one."""
        return hash((self.cfg.seed, next(self._counter))) & 0x7FFFFFFFFFFFFFFF

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, kv_transfer_params: dict | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, ids = self.tokenize(prompt)
        self.validate(ids, params, priority)
        arrival = arrival_time or time.time()
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        stop = StopRule(max_tokens=max_tokens, min_tokens=params.min_tokens,
                        eos_token_ids=self.eos_ids, stop_token_ids=tuple(params.stop_token_ids or ()),
                        ignore_eos=params.ignore_eos)
        parent = ParentRequest(request_id, text, ids, params, [], RequestMetrics(arrival))
        grammar = self.structured.submit(params.structured_outputs) if params.structured_outputs else None
        n = params.n
        for i in range(n):
            sid = request_id if n == 1 else f"{i}_{request_id}"
            seed = params.seed + i if params.seed is not None else self.next_seed()
            req = Request(sid, ids, stop, arrival_time=arrival, priority=priority, cache_salt=cache_salt,
                          kv_transfer_params=kv_transfer_params)
            seq = Sequence(req, parent.request_id, i, seed, self.tokenizer, params)
            parent.seqs.append(seq)
            self.seqs[sid] = seq
            if grammar is not None:  # it waits in the queue until its grammar compiled
                self.structured.add(sid, params.structured_outputs, grammar)
                req.admit_check = self.structured.ready(grammar)  # (a sibling may become the leader)
        self.parents[request_id] = parent
        self.scheduler.add(parent.seqs[0].req, [seq.req for seq in parent.seqs[1:]])

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for seq in reversed(parent.seqs):  # siblings first: no heir takes over the prompt
                self.scheduler.finish(seq.req.request_id, RequestStatus.FINISHED_ABORTED)
                self._drop_seq(seq.req.request_id)

    def _drop_seq(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)
        if self._structured is not None:
            self._structured.remove(seq_id)

    @property
    def structured(self):
        """Constrained decoding state (grammars, matchers, bitmasks); built on first use."""
        if self._structured is None:
            from jaxllm.structured.manager import StructuredManager
            self._structured = StructuredManager(self.tokenizer, self.model_cfg.vocab_size)
        return self._structured

    def prepare_structured_outputs(self) -> float | None:
        """Build the constrained-decoding state now (the llguidance tokenizer over the whole
        vocabulary: ~1 s for 128k ids), not at the first constrained request, where it stalls
        every running request (the server calls this at start-up). Seconds taken, or None when
        there is no tokenizer or no llguidance."""
        import importlib.util
        if self._structured is not None or self.tokenizer is None or importlib.util.find_spec("llguidance") is None:
            return None
        t0 = time.perf_counter()
        self.structured  # noqa: B018 (builds it)
        took = time.perf_counter() - t0
        log.info("structured outputs ready: grammar backend over %d token ids built in %.2f s",
                 self.model_cfg.vocab_size, took)
        return took

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # -- the step -----------------------------------------------------------
    def _sample_row(self, request_id: str, own: int = 0) -> SampleRow:
        """`own`: the tokens the scheduler just counted in `num_pending` for this row's step
        (1, or 1 + its drafts), which are not in flight before it."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return self.beam.sample_row(request_id)
        return SampleRow(seq.params, seq.req.prompt_token_ids, seq.req.output_token_ids, seq.seed,
                         self.eos_ids[0] if self.eos_ids else None, seq.req.num_pending - own)

    def _overlaps(self, prev: Launched) -> bool:
        """Can the next step be scheduled while `prev` runs? Not when it forks siblings, has
        penalties, or beam search reads it; with speculative decoding, only when the step
        corrects itself on the device (spec/shift.py) and every request that verifies drafts in
        `prev` is greedy past its min_tokens: their counts in flight assume every draft
        accepted, which a sampled row's random stream and EOS suppression would read."""
        if not prev.overlappable or self.beam is not None:
            return False
        if not prev.spec_rows:  # a draft model or EAGLE head proposes only between synchronous steps
            return self.spec is None or self.spec.overlap
        if not self.runner.spec_width:  # (the step cannot correct itself)
            return False
        for rid in prev.spec_rows:
            seq = self.seqs.get(rid)
            if seq is not None and not (seq.params.is_greedy
                                        and len(seq.req.output_token_ids) >= seq.params.min_tokens):
                return False
        return True

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

    def _launch(self, out: SchedulerOutput, prev: Launched | None) -> Launched | None:
        if out.empty:
            if out.has_kv_ops:  # saves, loads to start or write, page moves: nothing to compute
                self.dispatcher.submit(out)
            if self.scheduler.loading and prev is None and self.connector is not None:
                # only KV fetches and loads left: wait until one may be done (no spinning)
                self.connector.wait_for_progress(IDLE_WAIT_S)
            elif self.scheduler.waiting:
                # only requests waiting on their grammar's compile are left: do not spin hot
                # (a spinning loop holds the GIL the compile and the HTTP threads need)
                time.sleep(0.001)
            return None
        now = time.time()
        hb = build_batch(out, self.token_buckets, self.seq_buckets, self.cfg.block_size,
                         self.runner.max_blocks, prev.row_of if prev is not None else None)
        if prev is not None and prev.spec_rows:  # the device corrects for prev's acceptance
            hb = host_rows(hb, out, prev, self.runner.spec_width)
            if self.spec is not None:
                self.spec.num_overlapped += 1
        rows = [self._sample_row(s.request_id, 1 + len(s.spec_token_ids)) if s.sample else PAD_ROW
                for s in out.scheduled]
        row_of = {s.request_id: i for i, s in enumerate(out.scheduled)}
        extra = []  # token index of each logits row past the batch's own
        for i, s in enumerate(out.scheduled):
            for f in s.fork_ids:  # n > 1 siblings sample from their leader's row
                row_of[f] = len(rows)
                rows.append(self._sample_row(f))
                extra.append(int(hb.logits_indices[i]))
            seq = self.seqs.get(s.request_id)
            if seq is not None and self.parents[seq.parent_id].metrics.first_scheduled_time is None:
                self.parents[seq.parent_id].metrics.first_scheduled_time = now
        spec_rows, verify = {}, None
        if self.spec is not None and any(s.spec_token_ids for s in out.scheduled):
            idx, spec_rows = self.spec.add_rows(out, hb.query_start_loc, rows)
            extra += idx
        if extra:
            hb = with_logit_rows(hb, extra, self.token_buckets, self.seq_buckets)
        sbatch = self.sampler.prepare(rows, hb.block_tables.shape[0])
        if spec_rows:
            verify = self.spec.verifier.bind(self.spec.draft_ids(out, spec_rows, sbatch.num_rows))
        launched = Launched(out, rows, row_of, None, mask=Future() if sbatch.masked else None,
                            num_rows=sbatch.num_rows, spec_rows=spec_rows)
        if prev is None:  # every earlier token is known: fill now
            self._fill_mask(launched)
        # A speculative step the next `step` reads before scheduling runs on this thread when it can
        inline = self.spec is not None and not self._overlaps(launched)
        launched.sample = self.dispatcher.submit(out, hb, sbatch, prev.sample if prev else None, launched.mask,
                                                 verify, inline=inline)
        return launched

    def _fill_mask(self, launched: Launched) -> None:
        """Hand the step's draw its bitmask, made from the matchers (which have seen every
        earlier token) off the engine thread by default (`StructuredManager.hand_off`), so the
        host's detokenizing and the server's streaming go on meanwhile (the next advance of
        these matchers waits for this draw, so nothing moves them under it)."""
        if launched.mask is None or launched.mask_handed:  # unconstrained, or once per step
            return
        launched.mask_handed = True
        rows = [(sid, i) for sid, i in launched.row_of.items() if sid in self.structured]
        try:
            self.structured.hand_off(rows, launched.num_rows, launched.mask)
        except BaseException as exc:  # the dispatch thread must not wait forever
            launched.mask.set_exception(exc)
            raise

    def _fail_grammars(self) -> list[RequestOutput]:
        """Finish (aborted) the requests whose grammar failed to compile."""
        outputs = []
        for sid, reason in self._structured.failed():
            seq = self.seqs.get(sid)
            parent = self.parents.pop(seq.parent_id, None) if seq is not None else None
            if parent is None:
                self._structured.remove(sid)
                continue
            log.error("request %s: structured_outputs failed to compile: %s", parent.request_id, reason)
            for s in reversed(parent.seqs):
                self.scheduler.finish(s.req.request_id, RequestStatus.FINISHED_ABORTED)
                self._drop_seq(s.req.request_id)
            outputs.append(make_output(parent, True))
        return outputs

    def _process(self, launched: Launched, then: Launched | None = None) -> list[RequestOutput]:
        """Read a step's sampled tokens (the one device sync) and advance its requests.

        `then`: the step dispatched after this one; its bitmask (structured outputs) is filled
        as soon as the matchers have this step's tokens, before the detokenizing below."""
        out, rows, row_of = launched.out, launched.rows, launched.row_of
        sout = launched.result().fetch()
        # Beam-search rows get no token: the scheduler parks them for the beam search to fork.
        sampled = {rid: int(sout.token_ids[i]) for rid, i in row_of.items()
                   if rid in self.seqs and rows[i] is not PAD_ROW}
        spec_rows, first = launched.spec_rows, {}
        if spec_rows:  # accepted drafts + one token each
            sampled.update(self.spec.accepted(out, spec_rows, sout.token_ids))
            first = {rid: len(self.seqs[rid].req.output_token_ids) for rid in spec_rows if rid in self.seqs}
        touched = self.scheduler.update(out, sampled)
        if self.beam is not None:
            self.beam.on_step(out, sout, row_of)

        if self._structured is not None:
            for req in touched:
                if self._structured.advance(req.request_id, req.output_token_ids) and not req.finished:
                    self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)  # grammar complete
            if then is not None:
                self._fill_mask(then)

        outputs: dict[str, RequestOutput] = {}
        for req in touched:
            seq = self.seqs[req.request_id]
            if req.request_id in first:
                self._on_tokens(seq, sout, spec_rows[req.request_id], first[req.request_id])
            elif seq.on_token(sout, row_of[req.request_id]) and not req.finished:  # a stop string
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.finished:
                self._drop_seq(req.request_id)
            parent = self.parents[seq.parent_id]
            if parent.record(req):
                del self.parents[parent.request_id]
            if parent.finished or parent.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs[parent.request_id] = make_output(parent, parent.finished)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.max_model_len, self._structured or (), then)
        return list(outputs.values())

    def _on_tokens(self, seq: Sequence, sout, rows: list[int], first: int) -> None:
        """Several tokens appended in one step (accepted drafts): text, logprobs and stop
        strings token by token; tokens after a stop string are dropped, as without drafts."""
        req = seq.req
        for m, idx in enumerate(range(first, len(req.output_token_ids))):
            if seq.on_token(sout, rows[m], idx):
                del req.output_token_ids[idx + 1:]
                if req.finished:
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                return

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
