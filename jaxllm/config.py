"""Engine configuration: one frozen dataclass, passed explicitly everywhere.

Names follow vLLM's engine arguments so flags and keyword arguments carry over.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxllm.spec.config import SpeculativeConfig

from jaxllm.quantization.methods import check_kv_cache_dtype, check_method


USAGE_CONTEXTS = ("llm", "serve", "engine")
# Accelerator defaults of max_num_batched_tokens, as vLLM's for large-memory GPUs: offline
# generation fills the GPU with long prefill chunks (throughput); a server keeps each step
# short so running requests' inter-token latency stays low.
GPU_BATCHED_TOKENS = {"llm": 16384, "serve": 2048, "engine": 2048}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder, .gguf file, converted folder; None = embedded SmolLM2
    # "auto": the model's weights; "dummy": config.json only, random weights drawn on the device
    load_format: str = "auto"
    random_shape: str | None = None  # a named shape (jaxllm.models.shapes) with dummy weights
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on accelerators), "float32", "bfloat16"
    max_model_len: int | None = None  # None: min(model's max positions, 2048)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: by platform and usage_context (see below)
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; wins over the fraction
    gpu_memory_utilization: float = 0.9  # fraction of accelerator memory for weights + KV
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True  # reuse the K/V of full blocks of earlier prompts
    preemption_mode: str = "recompute"  # or "swap": preempted pages wait in host memory
    swap_space: float = 4.0  # GiB of host memory for swapped pages (preemption_mode="swap")
    scheduling_policy: str = "fcfs"  # or "priority": lower `priority` value runs first
    # Schedule and dispatch step k+1 while step k runs; its sampled ids feed k+1 on the device.
    async_scheduling: bool = True
    seed: int = 0
    # Who runs the engine, as vLLM's UsageContext: "llm" (offline LLM class), "serve" (the
    # OpenAI server) or "engine"; picks the defaults that depend on it (max_num_batched_tokens).
    usage_context: str = "engine"
    # KV pages: "auto" (model dtype), "fp8"/"fp8_e4m3"/"fp8_e5m2", "int8", "int4" (kernels/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # fp8 KV pages: set each layer's K and V scale from the first batch's amax / fp8 max
    # (vLLM's option; replaces checkpoint scales). Other KV dtypes ignore it.
    calculate_kv_scales: bool = False
    # Weights: None, "fp8" (W8A8 dynamic), "int8" (W8A16), "int4" (W4A16 g128); see quantization/
    quantization: str | None = None
    attention_backend: str | None = None  # None: by platform; "reference", "pallas", "mosaic"
    token_buckets: tuple[int, ...] | None = None  # padded token counts compiled at start-up
    seq_buckets: tuple[int, ...] | None = None  # padded request counts compiled at start-up
    tokenizer: str | None = None
    cache_dir: str | None = None  # converted-checkpoint cache ($JAXLLM_CACHE, ~/.cache/jaxllm)
    skip_warmup: bool = False
    tensor_parallel_size: int = 1  # devices (over all processes) one model is split across
    # MoE: whole experts per device (attention stays tensor-parallel); off: experts split by
    # their intermediate dimension. EPLB: redundant expert slots placed by measured load.
    enable_expert_parallel: bool = False
    # Expert-parallel groups (SGLang's --ep-size); None: tensor_parallel_size. Smaller: experts go
    # whole to `expert_parallel_size` groups of devices and are split by their intermediate
    # dimension over the tensor_parallel_size / expert_parallel_size devices of each group.
    expert_parallel_size: int | None = None
    enable_eplb: bool = False
    eplb_config: Any = None  # dict (JSON flag) -> jaxllm.eplb.config.EPLBConfig
    # Multi-host (jax.distributed): process 0 schedules and serves, the others follow its steps.
    distributed_coordinator: str | None = None  # "host:port" of process 0's coordinator service
    num_processes: int = 1
    process_id: int = 0
    # KV connector (jaxllm/kv_transfer/): vLLM's --kv-transfer-config, offload tiers, KV events.
    kv_transfer_config: dict | None = None  # {"kv_connector", "kv_role", "kv_connector_extra_config"}
    kv_offload_cpu_gib: float = 0.0  # host-memory tier for evicted / finished blocks (GiB)
    kv_offload_disk_dir: str | None = None  # disk tier (an fsspec URL or path), written through
    kv_offload_disk_gib: float | None = None  # bound of the disk tier; None: unbounded
    kv_events_config: dict | None = None  # {"enable_kv_cache_events", "publisher", "endpoint"}
    # Speculative decoding (jaxllm/spec): a dict of vLLM's keys, validated into a SpeculativeConfig.
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self):
        from jaxllm.spec.config import as_spec_config
        object.__setattr__(self, "speculative_config", as_spec_config(self.speculative_config))
        from jaxllm.eplb.config import EPLBConfig
        object.__setattr__(self, "eplb_config", EPLBConfig.parse(self.eplb_config))
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError("enable_expert_parallel needs tensor_parallel_size > 1 (experts are "
                             f"spread over the tensor-parallel devices), got {self.tensor_parallel_size}")
        ep = self.expert_parallel_size
        if ep is not None:
            if not self.enable_expert_parallel:
                raise ValueError("expert_parallel_size needs enable_expert_parallel")
            if not isinstance(ep, int) or ep < 2 or self.tensor_parallel_size % ep:
                raise ValueError(f"expert_parallel_size must be an integer >= 2 dividing "
                                 f"tensor_parallel_size={self.tensor_parallel_size}, got {ep!r}")
            if self.enable_eplb and ep != self.tensor_parallel_size:
                raise ValueError("enable_eplb with expert_parallel_size < tensor_parallel_size is not "
                                 "supported (EPLB moves whole experts between devices)")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel (it balances experts over devices)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float", "half", "bf16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.process_id < max(self.num_processes, 1):
            raise ValueError(f"process_id {self.process_id} is not in [0, num_processes={self.num_processes})")
        if self.num_processes > 1 and not self.distributed_coordinator:
            raise ValueError("num_processes > 1 needs distributed_coordinator (host:port of process 0)")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_method(self.quantization)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {self.usage_context!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.random_shape is not None:
            from jaxllm.models.shapes import get_shape
            get_shape(self.random_shape)  # ValueError naming the known shapes
            if self.model is not None:
                raise ValueError(f"random_shape {self.random_shape!r} and model {self.model!r}: give one")
        if self.kv_offload_cpu_gib < 0:
            raise ValueError(f"kv_offload_cpu_gib must be >= 0, got {self.kv_offload_cpu_gib}")
        if self.kv_offload_disk_gib is not None and self.kv_offload_disk_gib < 0:
            raise ValueError(f"kv_offload_disk_gib must be >= 0, got {self.kv_offload_disk_gib}")
        from jaxllm.kv_transfer.config import KVEventsConfig, KVTransferConfig
        if self.kv_transfer_config is not None:
            KVTransferConfig.from_dict(self.kv_transfer_config)
        if self.kv_events_config is not None:
            KVEventsConfig.from_dict(self.kv_events_config)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


LARGE_TOKEN_BUCKET = 256  # token buckets above this double (see default_token_buckets)


def default_buckets(limit: int, start: int, growth: int = 4) -> tuple[int, ...]:
    """start, start*growth, ... capped by (and always ending at) limit."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= growth
    out.append(limit)
    return tuple(out)


def default_max_num_batched_tokens(platform: str, usage_context: str, max_num_seqs: int) -> int:
    """Tokens per step when not given: small on CPU (tests, compiles), by entry point elsewhere."""
    if platform == "cpu":
        return max(512, max_num_seqs)
    return max(GPU_BATCHED_TOKENS[usage_context], max_num_seqs)


def default_token_buckets(max_tokens: int, seq_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """Padded token counts: 16, 64, 256, then doubling (512, 1,024, 2,048, ...) up to the budget,
    plus every request bucket.

    A decode-only step of n rows then pads to its row bucket (T = R, the decode kernel), never
    to the prefill budget: on an H200 the Llama-3-8B batch-1 step took 9.1 ms at T=16/R=1 and
    7.1 ms at T=8/R=8 (docs/benchmarks.md). Above 256 tokens the buckets double rather than
    quadruple: a 2,048-token prompt padded to 4,096 took 2.12x its FLOP floor to the first token
    on an H200, and the mixed workload's typical step (63 decode rows and one prompt of a few
    hundred tokens) is compute-bound, and a 300-token step padded to 1,024 computes 3.4x its tokens
    (docs/benchmarks.md, session 7); large buckets compile one request bucket each (batch.py).
    """
    out = set(default_buckets(min(max_tokens, LARGE_TOKEN_BUCKET), 16))
    b = 2 * LARGE_TOKEN_BUCKET
    while b < max_tokens:
        out.add(b)
        b *= 2
    out.add(max_tokens)
    return tuple(sorted(out | {b for b in seq_buckets if b < max_tokens}))
