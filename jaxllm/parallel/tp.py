"""`TensorParallel`: everything the model runner needs to run one model over a mesh.

The runner stays a single-device program in shape: it asks this object for the
model config to build (K' stored KV heads), the attention function (wrapped in
shard_map), the placed parameters, the KV page array, and the jit shardings.
Everything else (scheduler, block manager, sampler) is host-side and unchanged:
the block manager's page ids index the page axis, which is not split, so one
block table serves every device.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.models.config import ModelConfig
from jaxllm.models.params import set_value, value
from jaxllm.parallel.attention import shard_attention
from jaxllm.parallel.embedding import shard_embedding
from jaxllm.parallel.experts import check_experts, shard_experts
from jaxllm.parallel.mesh import AXIS, HeadLayout, head_layout, make_mesh, sharded_model_config
from jaxllm.parallel.sharding import (KV_PAGES_SPEC, bytes_on_device, init_random_state,
                                      param_spec, place_state)

log = logging.getLogger("jaxllm")
_MiB = float(1 << 20)


class TensorParallel:
    """One model's mesh, head layout and shardings (tp >= 1, one or several processes)."""

    def __init__(self, model_cfg: ModelConfig, tp: int, devices: list | None = None,
                 split_axes: dict[str, int] | None = None, expert_parallel: bool = False,
                 num_expert_slots: int | None = None, expert_parallel_size: int | None = None):
        self.layout: HeadLayout = head_layout(model_cfg, tp)
        self.expert_parallel = expert_parallel
        check_experts(model_cfg, tp, expert_parallel, num_expert_slots, expert_parallel_size)
        # (groups, splits) when experts are both expert- and tensor-parallel, else None
        ep = expert_parallel_size or tp
        self.expert_split = (ep, tp // ep) if expert_parallel and ep != tp else None
        self.split_axes = split_axes or {}
        self.mesh = make_mesh(tp, devices)
        self.tp = tp
        self.checkpoint_cfg = model_cfg
        self.model_cfg = sharded_model_config(model_cfg, self.layout)
        self.replicated = NamedSharding(self.mesh, P())
        self.vocab_sharded = NamedSharding(self.mesh, P(None, AXIS))  # [R, V] logits, split by V
        self.kv_sharding = NamedSharding(self.mesh, KV_PAGES_SPEC)
        me = jax.process_index()
        self.local_devices = [d for d in self.mesh.devices.flat if d.process_index == me]
        if self.layout.kv_repeat > 1:
            log.info("tensor parallel %d > %d KV heads: each KV head is stored %d times (%d heads, "
                     "%d per device)", tp, model_cfg.num_kv_heads, self.layout.kv_repeat,
                     self.layout.stored_kv_heads, self.layout.kv_heads_per_device)

    @property
    def multi_process(self) -> bool:
        return jax.process_count() > 1

    def attention(self, fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        return shard_attention(fn, self.mesh)

    def model_hooks(self) -> dict[str, Any]:
        """Extra constructor arguments of the model class (MoE: the sharded experts)."""
        if self.checkpoint_cfg.moe is None:
            return {}
        if self.expert_split is None:
            return {"experts_fn": shard_experts(self.mesh, self.expert_parallel)}
        return {"experts_fn": shard_experts(self.mesh, True, splits=self.expert_split[1]),
                "expert_split": self.expert_split}

    def embedding(self) -> Callable[[jax.Array, jax.Array], jax.Array] | None:
        """The vocabulary-parallel lookup, or None where the table is replicated (V % N)."""
        if self.checkpoint_cfg.vocab_size % self.tp:
            return None
        return shard_embedding(self.mesh)

    def build_params(self, make_sharded: Callable[[], nnx.Module],
                     make_unsharded: Callable[[], nnx.Module], state: dict | None
                     ) -> tuple[nnx.GraphDef, nnx.State]:
        """(graphdef, params) with every parameter already split across the mesh.

        `make_sharded` builds the model with K' KV heads (its shapes only are used);
        `make_unsharded` the checkpoint-shaped one, for random init.
        """
        graphdef, abstract = nnx.split(nnx.eval_shape(make_sharded))
        D = self.model_cfg.head_dim
        if state is None:
            params = init_random_state(make_unsharded, abstract, self.mesh, self.layout, D,
                                       self.split_axes)
        else:
            if self.expert_split is not None and "experts" in state:
                from jaxllm.models.moe import split_experts
                ex = state["experts"]
                for name in ("e_gate", "e_up", "e_down"):
                    ex[name] = np.ascontiguousarray(split_experts(ex[name], name, *self.expert_split, xp=np))
            params = place_state(abstract, state, self.mesh, self.layout, D, self.split_axes)
        return graphdef, params

    def place_layers(self, params: nnx.State, layers: list[dict[str, jax.Array]]
                     ) -> list[dict[str, jax.Array]]:
        """After `llama_state.split_layers` (the unrolled accelerator layout): pin every per-layer
        array to its weight's split without the layer axis, and put the emptied stacked
        placeholders on the mesh, so that all the step's inputs share one mesh.
        """
        stacks = [v for k in ("layers", "experts") if k in params for v in params[k].values()]
        for var in stacks:
            set_value(var, jax.device_put(np.zeros((0,), value(var).dtype), self.replicated))
        num_layers = len(layers)

        def put(name: str, a: Any) -> Any:
            spec = P(*param_spec(name, (num_layers, *a.shape), self.tp, self.split_axes)[1:])
            if not isinstance(a, jax.Array):  # a quantized linear (quantization.QArray)
                from jaxllm.quantization.tp import qarray_shardings
                return jax.device_put(a, qarray_shardings(a, spec, self.mesh, name))
            return jax.device_put(a, NamedSharding(self.mesh, spec))

        return [{name: put(name, a) for name, a in w.items()} for w in layers]

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """The KV page array, allocated shard by shard (never whole on one device)."""
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.kv_sharding)()

    def jit_step(self, fn: Callable, params: Any, compiler_options: dict | None = None,
                 num_aux: int = 0) -> Callable:
        """jit `fn(params, kv_pages, batch, prev_ids) -> (kv_pages, logits, greedy_ids)`, fixed shardings.

        Fixed in/out shardings keep the donated pages in place and make a
        mis-placed input an error instead of a silent recompile.
        """
        param_shardings = jax.tree.map(lambda x: x.sharding, params)
        return jax.jit(fn, donate_argnums=(1,),
                       in_shardings=(param_shardings, self.kv_sharding, self.replicated, self.replicated),
                       out_shardings=(self.kv_sharding, self.replicated, self.replicated,
                                      *[self.replicated] * num_aux),
                       compiler_options=compiler_options)

    def put_batch(self, batch: Any) -> Any:
        """Host batch -> replicated on every mesh device (each process fills its own)."""
        return jax.device_put(batch, self.replicated)

    @staticmethod
    def local_logits(logits: jax.Array) -> jax.Array:
        """A replicated output's copy on this process's first mesh device (no transfer)."""
        return logits.addressable_data(0)

    def agree(self, value: int) -> int:
        """The minimum of `value` over processes: every process must size the same KV array."""
        if not self.multi_process:
            return value
        from jax.experimental import multihost_utils
        return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))

    def report(self, params: nnx.State, kv_pages: jax.Array, num_blocks: int) -> dict:
        """Per-device bytes of weights and KV pages, logged once at start-up."""
        dev = self.local_devices[0]
        w = bytes_on_device(params, dev)
        kv = bytes_on_device(kv_pages, dev)
        log.info("tensor parallel %d over %s devices: per device %.1f MiB weights + %.1f MiB KV "
                 "(%d blocks, %d of %d KV heads), total weights %.1f MiB",
                 self.tp, dev.platform, w / _MiB, kv / _MiB, num_blocks,
                 self.layout.kv_heads_per_device, self.layout.stored_kv_heads,
                 sum(x.nbytes for x in jax.tree.leaves(params)) / _MiB)
        return {"weight_bytes": w, "kv_bytes": kv}
