"""The tensor-parallel mesh and the head layout that goes with it.

One mesh axis, "tp", over the first N devices of `jax.devices()` (global devices:
with several processes it spans all of them). Query heads are split evenly, so N
must divide the query-head count. KV heads are split too; when N does not divide
their count each KV head is repeated `kv_repeat` times, giving
`K' = lcm(K, N)` heads: N divides K' (each device holds K'/N of them) and K'
divides H, and query head h still reads stored head h // (H / K'), which holds a
copy of original head h // (H / K). Each device thus keeps exactly the heads its
own query heads need, and attention never crosses devices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh

from jaxllm.models.config import ModelConfig

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How heads land on devices for one model at one tensor-parallel size."""

    tp: int
    num_heads: int  # H: query heads (split N ways)
    num_kv_heads: int  # K: the checkpoint's KV heads
    kv_repeat: int  # r: copies of each KV head so that N divides K * r

    @property
    def stored_kv_heads(self) -> int:
        """K' = K * r: KV heads in the weights and in the page array."""
        return self.num_kv_heads * self.kv_repeat

    @property
    def kv_heads_per_device(self) -> int:
        return self.stored_kv_heads // self.tp


def head_layout(model_cfg: ModelConfig, tp: int) -> HeadLayout:
    """Validate `tp` against the model's heads and pick the KV-head repetition."""
    H, K = model_cfg.num_heads, model_cfg.num_kv_heads
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if H % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's {H} attention heads "
            f"(valid sizes: {[n for n in range(1, H + 1) if H % n == 0]})")
    # lcm(K, tp) divides H because both K and tp do; r is the smallest repetition that works.
    repeat = math.lcm(K, tp) // K
    return HeadLayout(tp, H, K, repeat)


def sharded_model_config(model_cfg: ModelConfig, layout: HeadLayout) -> ModelConfig:
    """The config the sharded model is built from: K' stored KV heads instead of K."""
    return dataclasses.replace(model_cfg, num_kv_heads=layout.stored_kv_heads)


def make_mesh(tp: int, devices: list | None = None) -> Mesh:
    """A 1-D ("tp",) mesh over the first `tp` devices (all processes' devices, in id order).

    With several processes every process must own at least one of them: each one
    runs the same jitted step, and a process without a device in the mesh could not.
    """
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} but only {len(devices)} devices are visible "
                         f"({devices[0].platform}); on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={tp} before importing jax")
    chosen = devices[:tp]
    owners = {d.process_index for d in chosen}
    if len(owners) != jax.process_count():
        raise ValueError(f"the first {tp} devices belong to processes {sorted(owners)} of "
                         f"{jax.process_count()}: with several processes tensor_parallel_size must "
                         f"cover every process's devices (the global device count is {len(devices)})")
    return Mesh(np.array(chosen), (AXIS,))
