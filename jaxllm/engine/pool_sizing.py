"""How many KV blocks the pool gets: from the budget given, or on a GPU from a compiled probe
step's memory analysis beside the device's free memory (`engine/memory.py` plans it), as vLLM
profiles a dummy forward. A mixin of `ModelRunner` (engine/runner.py), which holds the state it
reads: the model config, the pages' dtype and width, the step's weights and buckets."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxllm.engine.device_batch import Batch
from jaxllm.engine.memory import GiB, StepMemory, base_limit, plan_pool, xla_limit_options

log = logging.getLogger("jaxllm")

# Programs outside the step that run beside the pool: the sampler, page moves and swaps, and
# the prompt-logprob scorer (its own one-sequence pages and [chunk, vocab] logits).
SIZING_HEADROOM = 2 << 30


class PoolSizing:
    def _compile_probe(self, num_blocks: int, options: dict):
        """The largest (tokens, rows) step compiled, not run, against a pool of `num_blocks`."""
        T, R = self.max_num_tokens, self.max_rows
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        pages = jax.ShapeDtypeStruct(self._pages_shape(num_blocks), self.kv_dtype)
        batch = Batch(i32(5, T), i32(R, self.max_blocks + 3 + self.spec_width), self.spec_width)
        return self._jit_step(options).lower(self.flat_params, pages, batch, i32(self.max_rows)).compile()

    def _memory_stats(self) -> tuple[int, int, int | None]:
        """(bytes_limit, bytes_in_use, largest free block or None) of the tightest local device
        (weights already placed)."""
        devices = self.tp.local_devices if self.tp else jax.devices()[:1]
        stats = [d.memory_stats() or {} for d in devices]
        free = [s.get("bytes_limit", 16 << 30) - s.get("bytes_in_use", 0) for s in stats]
        s = stats[free.index(min(free))]
        largest = [t["largest_free_block_bytes"] for t in stats if "largest_free_block_bytes" in t]
        return s.get("bytes_limit", 16 << 30), s.get("bytes_in_use", 0), min(largest) if largest else None

    def _step_io(self, num_blocks: int) -> tuple[int, int]:
        """(inputs + outputs with the pool once, outputs) of the step on one device, from shapes."""
        dev = self.tp.local_devices[0] if self.tp else None
        weights = sum(a.nbytes if dev is None else sum(s.data.nbytes for s in a.addressable_shards
                                                       if s.device == dev) for a in self.flat_params)
        pool = num_blocks * self._bytes_per_block()
        out = pool + self.max_rows * (self.model_cfg.vocab_size + 1) * 4  # pages, logits, ids
        return weights + pool + 4 * (5 * self.max_num_tokens + self.max_rows * (self.max_blocks + 4)) \
            + out - pool, out

    def _profiled_blocks(self, bytes_limit: int, bytes_in_use: int, largest_free: int | None,
                         min_blocks: int) -> int:
        """Blocks that fit beside the weights and the step's own buffers (`engine/memory.py`)."""
        options = lambda p: xla_limit_options(self.platform, bytes_limit, *self._step_io(p))
        p1 = max(self.max_blocks, 64)
        probes = [(p, StepMemory.of(self._compile_probe(p, options(p)).memory_analysis())) for p in (p1, 2 * p1)]
        cap = base_limit(bytes_limit) if self.platform == "gpu" else None
        plan = plan_pool(bytes_limit, bytes_in_use, self.cfg.gpu_memory_utilization,
                         self._bytes_per_block(), probes, min_blocks, io_cap_bytes=cap,
                         largest_free_bytes=largest_free, headroom_bytes=SIZING_HEADROOM)
        self.compiler_options = options(plan.num_blocks)
        log.info("KV pool sized from the compiled step (tokens %d, rows %d): %.2f GiB free of %.2f GiB at "
                 "gpu_memory_utilization %.2f (largest free block %s), the step's own buffers %.2f GiB; "
                 "XLA options %s", self.max_num_tokens, self.max_rows, plan.free_bytes / GiB, bytes_limit / GiB,
                 self.cfg.gpu_memory_utilization, "n/a" if largest_free is None else f"{largest_free / GiB:.2f} GiB",
                 plan.step_extra_bytes / GiB, self.compiler_options)
        return plan.num_blocks

    def _bytes_per_block(self) -> int:
        """Bytes one block takes on each device (its share of the KV heads)."""
        m = self.model_cfg
        heads = self.tp.layout.kv_heads_per_device if self.tp else m.num_kv_heads
        row = self.kv_width * jnp.dtype(self.kv_dtype).itemsize
        return m.num_layers * 2 * heads * self.block_size * row + self.extra_block_bytes

    def _num_blocks(self, max_model_len: int) -> int:
        blocks = self._given_blocks(max_model_len)
        if blocks is None:  # sized from the compiled step (sets its XLA options)
            blocks = self._profiled_blocks(*self._memory_stats(), min_blocks=self.max_blocks)
            return self.tp.agree(blocks) if self.tp is not None else blocks
        if self.platform == "gpu":  # a pool of given size: XLA still gets the real limit
            self.compiler_options = xla_limit_options(self.platform, self._memory_stats()[0],
                                                      *self._step_io(blocks))
        return blocks

    def _given_blocks(self, max_model_len: int) -> int | None:
        """The pool's blocks when given (`num_gpu_blocks_override`, `kv_cache_memory_bytes`, the
        CPU's budget); None on an accelerator that sizes it from the step."""
        cfg = self.cfg
        if cfg.num_gpu_blocks_override:
            return cfg.num_gpu_blocks_override
        per_block = self._bytes_per_block()
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes  # per device, as vLLM counts it
        elif self.platform == "cpu":
            # CPU: enough for every sequence at full length, at most 1 GiB.
            need = cfg.max_num_seqs * self.max_blocks * per_block
            budget = min(need, 1 << 30)
        else:
            return None
        blocks = budget // per_block
        if self.tp is not None:
            blocks = self.tp.agree(blocks)
        if blocks < self.max_blocks:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {blocks} blocks of {self.block_size} tokens, "
                f"fewer than one sequence of max_model_len={max_model_len} needs ({self.max_blocks}); "
                f"device memory stats: {jax.devices()[0].memory_stats()} (another engine in this process "
                f"still holding its KV pages? set kv_cache_memory_bytes)")
        return int(blocks)
