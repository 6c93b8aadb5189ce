"""KV pool sizing from a compiled step's memory analysis, the way vLLM profiles a dummy forward.

The pool is whatever device memory is left once the weights are placed and the step's own
buffers are accounted for. The step's needs come from XLA itself: the largest (tokens, rows)
step is compiled (not run) against a pool of P1 and of P2 blocks, and `compiled.memory_analysis()`
gives its temporaries and its outputs that do not alias an input (logits, ids). Their growth
between P1 and P2 is what XLA adds per block beyond the block itself (a copy of the pages, say),
so the fit `extra(P) = e1 + slope * (P - P1)` holds however the kernels treat the pages.

    blocks * bytes_per_block + extra(blocks) <= bytes_limit * utilization - bytes_in_use

`bytes_in_use` already holds the weights (placed before sizing) and anything else in the
process, so a second engine in one process sees only what the first left.

XLA's own accounting is the other half. Its GPU scheduler and rematerialization pass assume a
limit of `(base - io) * slop_factor / 100` for a program's temporaries, with `base` 80% of the
device's memory (or the allocator's size) and `io` the program's inputs plus outputs. For a
step whose inputs are the weights and the whole KV pool, that limit is far below what the step
really has (the pool is donated and updated in place, and it is the memory the pool was sized
to fill), and XLA logs "Can't reduce memory use below ...". `xla_limit_options` sets the slop
factor so that XLA's limit is the real one; `plan_pool(io_cap_bytes=base)` keeps `io` under `base`, where no
factor can help.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

GiB = float(1 << 30)
XLA_BASE_FRACTION = 0.8  # XLA's GPU scheduler limit starts from 80% of the device's memory
DEFAULT_CLIENT_MEM_FRACTION = 0.75  # JAX's preallocated share when XLA_PYTHON_CLIENT_MEM_FRACTION is unset


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What one compiled step needs besides its arguments (from `compiled.memory_analysis()`)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @classmethod
    def of(cls, analysis: Any) -> "StepMemory":
        return cls(int(analysis.argument_size_in_bytes), int(analysis.output_size_in_bytes),
                   int(analysis.alias_size_in_bytes), int(analysis.temp_size_in_bytes))

    @property
    def extra_bytes(self) -> int:
        """Bytes the step allocates while it runs: temporaries and non-aliased outputs."""
        return self.temp_bytes + max(self.output_bytes - self.alias_bytes, 0)

    @property
    def io_bytes(self) -> int:
        """Inputs plus outputs, aliased ones once: what XLA subtracts from its memory limit."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    pool_bytes: int
    step_extra_bytes: int  # the step's own buffers at num_blocks
    free_bytes: int  # bytes_limit * utilization - bytes_in_use - headroom
    io_cap_bytes: int | None  # XLA's base limit the step's io stays under, if known


def base_limit(bytes_limit: int, client_fraction: float | None = None) -> int:
    """XLA's starting point for a program's memory limit on this device (the smaller estimate)."""
    if client_fraction is None:
        client_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_CLIENT_MEM_FRACTION))
    device_bytes = bytes_limit / max(client_fraction, 1e-3)
    return int(min(bytes_limit, XLA_BASE_FRACTION * device_bytes))


def plan_pool(bytes_limit: int, bytes_in_use: int, utilization: float, bytes_per_block: int,
              probes: list[tuple[int, StepMemory]], min_blocks: int = 0,
              io_cap_bytes: int | None = None, largest_free_bytes: int | None = None,
              headroom_bytes: int = 0) -> PoolPlan:
    """The largest pool that fits beside the step, from the step compiled at two pool sizes.

    `probes`: [(P1, memory at P1), (P2, memory at P2)] with P1 < P2 (one probe: no growth).
    `io_cap_bytes`: also keep the step's inputs + outputs below this (XLA's base limit).
    `largest_free_bytes`: the allocator's largest free block. The pool is one array, so it must
    fit in one block: on an H100 the holes left by building the weights (8B shape, dummy weights)
    made the 36 GiB pool fail to allocate although 44 GiB were free in all.
    `headroom_bytes`: kept free besides (counted in `bytes_in_use` and off the largest block).
    Raises ValueError if fewer than `min_blocks` fit.
    """
    (p1, m1), (p2, m2) = probes[0], probes[-1]
    slope = max((m2.extra_bytes - m1.extra_bytes) / (p2 - p1), 0.0) if p2 != p1 else 0.0
    free = int(bytes_limit * utilization) - bytes_in_use - headroom_bytes
    room = free if largest_free_bytes is None else min(free, largest_free_bytes - headroom_bytes)
    # blocks * per_block + e1 + slope * (blocks - p1) <= room (the pool in one block with the
    # step's buffers: counted against the largest block too, conservatively)
    blocks = math.floor((room - m1.extra_bytes + slope * p1) / (bytes_per_block + slope))
    if io_cap_bytes is not None:
        io_slope = (m2.io_bytes - m1.io_bytes) / (p2 - p1) if p2 != p1 else float(bytes_per_block)
        blocks = min(blocks, math.floor(p1 + (0.95 * io_cap_bytes - m1.io_bytes) / max(io_slope, 1.0)))
    blocks = max(blocks, 0)
    extra = int(m1.extra_bytes + slope * (blocks - p1))
    if blocks < min_blocks:
        raise ValueError(
            f"KV cache: {free / GiB:.2f} GiB free for the pool (gpu_memory_utilization={utilization} of "
            f"{bytes_limit / GiB:.2f} GiB, {bytes_in_use / GiB:.2f} GiB in use"
            f"{'' if largest_free_bytes is None else f', largest free block {largest_free_bytes / GiB:.2f} GiB'}"
            f") less the step's own "
            f"{extra / GiB:.2f} GiB holds {blocks} blocks, fewer than one sequence of max_model_len "
            f"needs ({min_blocks}); raise gpu_memory_utilization, lower max_model_len or "
            f"max_num_batched_tokens, or set kv_cache_memory_bytes")
    return PoolPlan(blocks, blocks * bytes_per_block, extra, free, io_cap_bytes)


def probe_step(compile_at: Callable[[int], Any], p1: int, p2: int) -> list[tuple[int, StepMemory]]:
    """Compile (never run) the step at pools of p1 and p2 blocks; their memory analyses."""
    return [(p, StepMemory.of(compile_at(p).memory_analysis())) for p in (p1, p2)]


def xla_limit_options(platform: str, bytes_limit: int, io_bytes: int, output_bytes: int) -> dict:
    """Compiler options giving XLA's scheduler/remat limit the device's real memory (GPU only).

    XLA: limit = (base - io) * slop / 100, less the outputs in the rematerialization pass. The
    slop factor is chosen so that this limit is three times the allocator's size (the pass counts
    the donated pool as an input and again as an output): the pool was already sized from the
    step's own buffer assignment, so XLA has no reason to trade speed for memory.
    """
    if platform != "gpu":
        return {}
    room = base_limit(bytes_limit) - io_bytes
    if room <= 0:
        return {}
    slop = math.ceil(100 * (3 * bytes_limit + output_bytes) / room)
    return {"xla_gpu_memory_limit_slop_factor": max(slop, 95)}


def describe(num_blocks: int, block_size: int, pool_bytes: int, max_model_len: int,
             num_devices: int = 1) -> str:
    """The start-up line: pool size, blocks and the maximum concurrency at max_model_len."""
    tokens = num_blocks * block_size
    per_seq = -(-max_model_len // block_size) * block_size
    where = f" per device over {num_devices} devices" if num_devices > 1 else ""
    return (f"KV cache: {pool_bytes / GiB:.2f} GiB{where}, {num_blocks} blocks of {block_size} tokens "
            f"({tokens} tokens); maximum concurrency at max_model_len {max_model_len}: "
            f"{tokens / per_seq:.2f}x")
