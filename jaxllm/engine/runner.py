"""The device side: KV pages, the jitted step, and start-up compilation.

`step(params, kv_pages, batch, prev_ids) -> (kv_pages, logits, greedy_ids)` is a pure
function jitted once per (token bucket, request bucket) pair with the KV pages donated,
so XLA updates them in place. `prev_ids` ([max_rows]) are the previous step's sampled
ids: with async scheduling a decode token still in flight is read from them on the
device. Every bucket is compiled at start-up; `stats()` exposes a trace counter so
tests can assert that serving never compiles again.

With tensor_parallel_size > 1 (or several processes) the same step runs over a
`jaxllm.parallel.TensorParallel` mesh: parameters and pages are placed shard by
shard, attention runs per shard, and KV blocks are sized from per-device memory.

The pool's sizing (`engine/pool_sizing.py`) and the start-up's kernel choice, compiles and
warm-up runs (`engine/warmup.py`) are mixins of `ModelRunner`, each in its own file.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import EngineConfig
from jaxllm.engine.batch import HostBatch
from jaxllm.engine.device_batch import Batch
from jaxllm.engine.compile import enable_persistent_cache
from jaxllm.engine.memory import describe
from jaxllm.engine.pool_sizing import PoolSizing
from jaxllm.engine.sampler import pad_ids
from jaxllm.engine.warmup import Warmup
from jaxllm.kernels import kv_quant
from jaxllm.quantization.methods import ONLINE_METHODS, check_weights_device
from jaxllm.quantization.quantize import draw_quantized, quantize_state
from jaxllm.models.config import ModelConfig
from jaxllm.models import registry
from jaxllm.models.llama_state import load_state
from jaxllm.models.params import value

log = logging.getLogger("jaxllm")

DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16, "half": jnp.bfloat16}


def resolve_dtype(name: str, platform: str):
    if name == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    return DTYPES[name]


def pick_attention(backend: str | None, platform: str, queries_per_request: int = 1):
    """`queries_per_request`: tokens a decode-kernel step carries per request at most as a rule
    (k + 1 with speculative decoding), read against the request's pages once (kernels/)."""
    if backend in (None, "reference") and platform == "cpu":
        from jaxllm.kernels.ref import ragged_paged_attention
        log.info("attention backend: reference (jnp) on %s", platform)
        return ragged_paged_attention
    from jaxllm.kernels import get_attention_fn
    return get_attention_fn(backend, platform, queries_per_request)


def stable_batch() -> bool:
    """JAXLLM_STABLE_BATCH=1: the step reads its batch from a copy it makes (`Batch.copied`)."""
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_STABLE_BATCH", "0", ("0", "1")) == "1"


class ModelRunner(PoolSizing, Warmup):
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int,
                 state: dict | None = None, dtype=None, unroll_layers: bool | None = None,
                 max_rows: int | None = None, max_num_tokens: int | None = None,
                 extra_block_bytes: int = 0, capture: tuple[int, ...] = (),
                 token_buckets: tuple[int, ...] | None = None):
        self.cfg = cfg
        # Hidden states the step returns beside the logits (`Llama.capture`: an EAGLE head's
        # input, jaxllm/spec/eagle.py), kept on the device as `last_hidden` [T, n * E].
        self.capture, self.last_hidden = capture, None
        # Bytes per block held beside these pages (a draft model's own KV, jaxllm/spec), so
        # the pool is sized for both.
        self.extra_block_bytes = extra_block_bytes
        # Sampled ids travel between steps as one [max_rows] array (the largest request
        # bucket), so an overlapped step reads them whatever the previous bucket was.
        self.max_rows = max_rows or cfg.max_num_seqs
        self.platform = jax.devices()[0].platform
        self.dtype = dtype or resolve_dtype(cfg.dtype, self.platform)
        self.block_size = cfg.block_size
        self.max_blocks = -(-max_model_len // cfg.block_size)
        if cfg.quantization is not None and jax.process_count() > 1:
            raise ValueError(f"quantization={cfg.quantization!r} with several processes is not "
                             f"supported yet (one process: tensor_parallel_size > 1 is)")
        check_weights_device(cfg.quantization, state)
        spec = cfg.speculative_config
        attn = pick_attention(cfg.attention_backend, self.platform,
                              spec.num_speculative_tokens + 1 if spec is not None else 1)
        self.tp = self.channel = None
        self.model_entry = registry.get(model_cfg.architecture)
        if cfg.enable_expert_parallel and model_cfg.moe is None:
            raise ValueError(f"enable_expert_parallel: {model_cfg.architecture} is a dense model "
                             "(no experts to place); drop the flag")
        self.eplb = None  # jaxllm.eplb.balancer.ExpertBalancer when enable_eplb
        if cfg.enable_eplb:
            from jaxllm.eplb.balancer import ExpertBalancer
            self.eplb = ExpertBalancer(model_cfg.moe, cfg.eplb_config, cfg.tensor_parallel_size)
            state = self.eplb.expand_state(state) if state is not None else None
        if cfg.tensor_parallel_size > 1 or jax.process_count() > 1:
            from jaxllm.engine.multihost import leader_channel
            from jaxllm.parallel import TensorParallel
            self.tp = TensorParallel(model_cfg, cfg.tensor_parallel_size,
                                     split_axes=self.model_entry.split_axes(cfg.enable_expert_parallel),
                                     expert_parallel=cfg.enable_expert_parallel,
                                     num_expert_slots=self.eplb.num_slots if self.eplb else None,
                                     expert_parallel_size=cfg.expert_parallel_size)
            attn = self.tp.attention(attn)
            if self.tp.multi_process:
                self.channel = leader_channel(self.max_blocks, cfg.max_num_seqs)
        ckpt_cfg, model_cfg = model_cfg, (self.tp.model_cfg if self.tp else model_cfg)
        self.model_cfg = model_cfg  # with tp > K: the stored (repeated) KV head count
        embed_fn = self.tp.embedding() if self.tp else None
        model_cls = self.model_entry.model_cls
        hooks = (self.tp.model_hooks() if self.tp else {}) | (self.eplb.model_hooks() if self.eplb else {})
        self.gmm_chooser = None  # one GPU, MoE: grouped matmul picked by measurement at warm-up
        if self.tp is None and self.platform == "gpu":
            from jaxllm.engine import kernel_probes
            from jaxllm.kernels import rope_write
            # decode-sized steps: head norms, RoPE, K/V write in one kernel, once probed here
            if rope_write.enabled() and kernel_probes.rope_write_ok(model_cfg, self.dtype, cfg.block_size):
                hooks["rope_write_fn"] = rope_write.rope_write_small
        if model_cfg.moe is not None and self.tp is None and self.platform == "gpu":
            from jaxllm.models.gmm import Chooser
            from jaxllm.models.moe import experts
            self.gmm_chooser = Chooser()
            hooks["experts_fn"] = functools.partial(experts, gmm=self.gmm_chooser)
            from jaxllm.kernels import moe_router
            # decode-sized steps routed in one kernel (with the RMSNorm), once probed here
            if moe_router.enabled() and kernel_probes.router_ok(model_cfg, self.dtype):
                hooks["router_fn"] = moe_router.route_small
        # fp8 pages + calculate_kv_scales: the model calibrates layers whose kv_scale is 0 on
        # the first step with a real token and the step returns the scales it used (`Llama.calibrate_kv`).
        kv_dtype, _ = kv_quant.page_layout(cfg.kv_cache_dtype, self.dtype, model_cfg.head_dim)
        self.calibrate_kv = bool(cfg.calculate_kv_scales) and kv_quant.page_format(
            kv_dtype, model_cfg.head_dim, model_cfg.head_dim) == "fp8"
        if cfg.calculate_kv_scales and not self.calibrate_kv:
            log.info("calculate_kv_scales: ignored for kv_cache_dtype %s (per-tensor scales are fp8's)",
                     cfg.kv_cache_dtype)

        def make(c=model_cfg):
            m = model_cls(c, self.dtype, rngs=nnx.Rngs(cfg.seed), attention_fn=attn, embed_fn=embed_fn, **hooks)
            if capture:
                m.capture = capture
            m.calibrate_kv = self.calibrate_kv
            # MoE models may return per-expert loads (EPLB's hooks ask for them; a benchmark's
            # touched-expert count too): one more output of the step
            self.count_loads = bool(getattr(m, "count_loads", False))
            return m
        if self.tp is not None:
            self.graphdef, self.params = self.tp.build_params(make, lambda: make(ckpt_cfg), state)
        elif state is None:  # random weights (load_format="dummy", tests): drawn on the device
            self.graphdef, _ = nnx.split(nnx.eval_shape(make))
            if cfg.quantization in ONLINE_METHODS:  # linears drawn and quantized a layer at a time
                self.params = draw_quantized(make, cfg.quantization, cfg.seed)
            else:
                self.params = jax.jit(lambda: nnx.state(make()))()
        else:
            model = nnx.eval_shape(make)
            load_state(model, state)
            self.graphdef, self.params = nnx.split(model)
        if cfg.quantization in ONLINE_METHODS:  # fp8 / int8 / int4 at load (quantization/)
            t0 = time.perf_counter()
            self.params = quantize_state(self.params, cfg.quantization, self.tp and self.tp.mesh)
            log.info("weights quantized (%s) in %.1f s", cfg.quantization, time.perf_counter() - t0)
        self.weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.params))
        # Quantized KV caches store rows of W (not D) elements of kv_dtype (kernels/kv_quant.py).
        self.kv_dtype, self.kv_width = kv_quant.page_layout(cfg.kv_cache_dtype, self.dtype,
                                                            model_cfg.head_dim)
        # Accelerators: one array per layer, unrolled (see Llama.__call__); CPU: a scan over
        # stacked weights, which compiles far faster.
        if unroll_layers is None:
            unroll_layers = self.platform != "cpu"
        self.layer_params = self.model_entry.split_layers(
            self.params, model_cfg, shards=self.tp.tp if self.tp else 1) if unroll_layers else None
        if self.tp is not None and self.layer_params is not None:
            self.layer_params = self.tp.place_layers(self.params, self.layer_params)
        # The step takes its weights as a flat list of arrays, so a call does not walk the
        # nnx State (0.1 ms for 300 arrays on the CPU VM; the 4-8 ms host span of the jitted
        # call on an H200 is XLA launching the step's kernels, which this does not change).
        self.flat_params, self._params_def = jax.tree.flatten(self.step_params)
        # The flat entry of the model's fp8 KV scales [L, 2] (`kv_scales`); calibration starts
        # them at 0 ("not yet") and each step's returned scales replace them.
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.step_params)[0]]
        self._kv_scale_index = next((i for i, p in enumerate(paths) if "'kv_scale'" in p), None)
        if self.calibrate_kv:
            leaf = self.flat_params[self._kv_scale_index]
            # Placed as the leaf was: one device, uncommitted (a committed input would commit the
            # step's outputs, and the sampler would compile again for committed logits).
            zeros = jnp.zeros(leaf.shape, leaf.dtype)
            self.flat_params[self._kv_scale_index] = (
                jax.device_put(zeros, leaf.sharding) if leaf.committed else zeros)
        self.no_ids = jnp.zeros(self.max_rows, jnp.int32)  # `prev_ids` when every token is known
        self.max_num_tokens = max_num_tokens or max(512, cfg.max_num_seqs)
        # Overlapped speculative steps (host-side proposers, one process): each row carries the
        # previous step's acceptance inputs, from which the step corrects itself (spec/shift.py).
        self.spec_width = 0
        if spec is not None and spec.method == "ngram" and self.channel is None:
            from jaxllm.spec.shift import width
            self.spec_width = width(spec.num_speculative_tokens)
        self.compiler_options: dict = {}  # set by the pool sizing (XLA's memory limit, GPU)
        enable_persistent_cache(self.platform)
        self._compiled: dict[tuple[int, int], object] = {}  # (T, R) -> executable, from `warmup`
        self._kernels_measured = False
        self.step_choice: dict[tuple[int, int], tuple[str, float, float]] = {}  # `choose_decode_steps`
        if token_buckets is not None:  # before the pool sizing: its probe compiles the chosen kernels
            self.measure_kernels(token_buckets)
        self.num_traces = 0  # counts step traces (compilations); set before the sizing's probes trace
        self.num_blocks = self._num_blocks(max_model_len)
        self.num_traces = 0  # the sizing's probe compiles do not count
        shape = self._pages_shape(self.num_blocks)
        if self.tp is None:
            self.kv_pages = jnp.zeros(shape, self.kv_dtype)
            self._step = self._jit_step(self.compiler_options)
            self.device_bytes = {"weight_bytes": self.weight_bytes, "kv_bytes": self.kv_pages.nbytes}
        else:
            self.kv_pages = self.tp.zeros(shape, self.kv_dtype)
            self.no_ids = jax.device_put(self.no_ids, self.tp.replicated)
            self._step = self._jit_step(self.compiler_options)
            self.device_bytes = self.tp.report(self.step_params, self.kv_pages, self.num_blocks)
        log.info("%s (kv_cache_dtype %s, %s pages)", describe(
            self.num_blocks, self.block_size, self.device_bytes["kv_bytes"], max_model_len,
            self.tp.tp if self.tp else 1), cfg.kv_cache_dtype, jnp.dtype(self.kv_dtype).name)

    def _pages_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.model_cfg
        return (m.num_layers, 2, m.num_kv_heads, num_blocks, self.block_size, self.kv_width)

    def _jit_step(self, options: dict, fresh: bool = False):
        """`fresh`: a function jit has not traced before, so lowering it traces the step again."""
        if self.tp is None:
            fn = functools.partial(self._step_flat) if fresh else self._step_flat
            return jax.jit(fn, donate_argnums=(1,), compiler_options=options or None)
        return self.tp.jit_step(self._step_flat, self.flat_params, compiler_options=options or None,
                                num_aux=(1 if self.count_loads else 0) + (1 if self.capture else 0)
                                + (1 if self.calibrate_kv else 0))

    def _step_flat(self, flat_params: list[jax.Array], kv_pages, batch: Batch, prev_ids: jax.Array):
        return self._step_impl(self._params_def.unflatten(flat_params), kv_pages, batch, prev_ids)

    def _step_impl(self, params, kv_pages, batch: Batch, prev_ids: jax.Array):
        self.num_traces += 1  # runs only while tracing: counts compilations
        params, layers = params if isinstance(params, tuple) else (params, None)
        model = nnx.merge(self.graphdef, params)
        # float32 means float32: without this, GPUs run f32 matmuls as TF32.
        precision = "highest" if self.dtype == jnp.float32 else None
        if stable_batch():
            batch = batch.copied()
        with jax.default_matmul_precision(precision):
            tokens, md = batch.inputs(prev_ids, self.block_size)
            kv_pages, logits, *aux = model(kv_pages, tokens, md, batch.logits_indices, layers)
        if self.tp is not None:
            # Logits computed per vocabulary shard, then gathered once, and the argmax taken on
            # the gathered copy. Unpinned, XLA either all-gathers the whole LM head (replicated
            # logits) or adds two gathers for a per-shard argmax.
            logits = jax.lax.with_sharding_constraint(logits, self.tp.vocab_sharded)
            logits = jax.lax.with_sharding_constraint(logits, self.tp.replicated)
        if self.calibrate_kv:  # the fp8 KV scales this step used (calibrated if they were 0), last
            aux = [*aux, value(model.kv_scale)]
        # Greedy ids come out of the same program: a greedy batch needs no second dispatch.
        # aux: the model's extra outputs (MoE with EPLB: rows per expert), for `after_step`.
        return kv_pages, logits, pad_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32), self.max_rows), *aux

    @property
    def step_params(self):
        """What the jitted step takes as its weights."""
        return self.params if self.layer_params is None else (self.params, self.layer_params)

    def execute(self, hb: HostBatch, prev_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Run one step; returns (logits [R, V] float32, greedy ids [max_rows] int32), on device.

        `prev_ids` ([max_rows], on device) are the sampled ids of the step before,
        read where `hb.prev_index` >= 0 (overlapped steps; single process only).
        With several processes this is the leader's call: the batch is broadcast
        first, so the followers run the same step (`jaxllm.engine.multihost.follow`).
        """
        if self.channel is not None:
            if prev_ids is not None:
                raise ValueError("overlapped steps need one process: followers never see sampled ids")
            self.channel.send(hb)
        return self.run_step(hb, prev_ids)

    def run_step(self, hb: HostBatch, prev_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The jitted step alone (followers call this for each broadcast batch)."""
        prev_ids = self.no_ids if prev_ids is None else prev_ids
        step = self._compiled.get((len(hb.tokens), hb.block_tables.shape[0]), self._step)
        if self.tp is None:
            self.kv_pages, logits, ids, *aux = step(self.flat_params, self.kv_pages,
                                                    Batch.from_host(hb, None, self.spec_width), prev_ids)
            self._take_kv_scales(aux)
            if self.capture:
                self.last_hidden = aux.pop()
            self._after_step(aux)
            return logits, ids
        batch = Batch.from_host(hb, self.tp.replicated, self.spec_width)
        prev_ids = jax.device_put(prev_ids, self.tp.replicated)  # a no-op for the step's own ids
        self.kv_pages, logits, ids, *aux = step(self.flat_params, self.kv_pages, batch, prev_ids)
        self._take_kv_scales(aux)
        if self.capture:  # replicated, as the residual stream is: the head reads it in place
            self.last_hidden = aux.pop()
        self._after_step(aux)
        # One process: the ids stay replicated, so the next step takes them as they are.
        # Several: only this process's copy can be read on the host.
        return self.tp.local_logits(logits), self.tp.local_logits(ids) if self.tp.multi_process else ids

    def _take_kv_scales(self, aux: list) -> None:
        """Calibration: the scales the step used become the next step's (no host sync)."""
        if self.calibrate_kv:
            self.flat_params[self._kv_scale_index] = aux.pop()

    @property
    def kv_scales(self) -> np.ndarray | None:
        """Each layer's (k_scale, v_scale) of fp8 KV pages, float32 [L, 2] (0: not calibrated yet)."""
        if self._kv_scale_index is None:
            return None
        return np.asarray(jax.device_get(self.flat_params[self._kv_scale_index]))

    def _after_step(self, aux: list) -> None:
        if self.eplb is not None:
            self.eplb.record(aux[0])
            self.eplb.after_step(self)
