"""Megatron-style sharding rules for the stacked Llama weights and the KV pages.

Column-parallel (split on the output axis): wq, wk, wv, w_gate, w_up and the
q/k/v biases, so each device computes whole heads / a slice of the MLP
hidden units with no communication. Row-parallel (split on the input axis): wo
and w_down; their matmuls produce partial sums that XLA all-reduces, two
all-reduces per layer in all. Embedding and LM head are vocabulary-parallel:
the embedding gather becomes a masked local lookup plus an all-reduce, and the
logits come out split by vocabulary. Norms and the o-bias are small and
replicated. A dimension the mesh does not divide falls back to replication
(with a warning) rather than failing.

Placement goes through `jax.make_array_from_callback`, which asks for each
device's slice only: the full model is never built on one device (host numpy
arrays are sliced; on several processes each one fills only its own devices).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.parallel.mesh import AXIS, HeadLayout
from jaxllm.quantization.qarray import QArray

log = logging.getLogger("jaxllm")

# Parameter name -> axis split across the mesh (on the stacked [L, ...] layout of llama.py).
_SPLIT_AXIS = {
    "wq": 2, "wk": 2, "wv": 2, "w_gate": 2, "w_up": 2,  # column-parallel: [L, E, out]
    "wqkv": 2, "w_gu": 2, "bqkv": 1,  # fused per layer (llama_state.fuse_layer): [L, E, S, ...] by shard
    "bq": 1, "bk": 1, "bv": 1,  # [L, out]
    "wo": 1, "w_down": 1,  # row-parallel: [L, in, E]
    "embed": 0,  # [V, E] vocabulary-parallel
    "lm_head": 1,  # [E, V] vocabulary-parallel
}
KV_WEIGHTS = ("wk", "wv", "bk", "bv")  # last axis is K * D: repeated under head replication
KV_PAGES_SPEC = P(None, None, AXIS)  # [L, 2, K', P, S, D]: split by KV head


def param_spec(name: str, shape: tuple[int, ...], tp: int, axes: dict[str, int] | None = None) -> P:
    """The PartitionSpec for one stacked parameter (by its attribute name).

    `axes` adds a model's own rules (the registry entry's `split_axes`, e.g. expert weights).
    """
    axis = (axes or {}).get(name, _SPLIT_AXIS.get(name))
    if axis is None or tp == 1:
        return P()
    if shape[axis] % tp:
        log.warning("%s %s: axis %d (size %d) is not divisible by tensor_parallel_size=%d; "
                    "replicating it", name, shape, axis, shape[axis], tp)
        return P()
    spec: list[str | None] = [None] * len(shape)
    spec[axis] = AXIS
    return P(*spec)


def repeat_kv_heads(x: Any, layout: HeadLayout, head_dim: int, xp: Any = np) -> Any:
    """[..., K*D] -> [..., K*r*D], each KV head's D columns repeated r times in place.

    Works on numpy (checkpoint placement) and jnp (random init) arrays alike.
    """
    r = layout.kv_repeat
    if r == 1:
        return x
    lead = x.shape[:-1]
    heads = x.reshape(*lead, layout.num_kv_heads, head_dim)
    return xp.repeat(heads, r, axis=-2).reshape(*lead, layout.num_kv_heads * r * head_dim)


def state_shardings(abstract_state: nnx.State, mesh: Mesh, axes: dict[str, int] | None = None) -> dict:
    """NamedSharding for every parameter, as a pure dict shaped like `nnx.to_pure_dict(state)`."""
    tp = mesh.shape[AXIS]
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(str(path[-1].key), x.shape, tp, axes)),
        nnx.to_pure_dict(abstract_state))


def place_state(abstract_state: nnx.State, state: dict, mesh: Mesh, layout: HeadLayout,
                head_dim: int, axes: dict[str, int] | None = None) -> nnx.State:
    """Put a nested dict of host arrays (from `hf_to_state`) straight into per-device shards."""
    shardings = state_shardings(abstract_state, mesh, axes)
    expected = nnx.to_pure_dict(abstract_state)
    if "kv_scale" in expected and "kv_scale" not in state:  # a hand-built state: fp8 KV scales 1.0
        state = {**state, "kv_scale": np.ones(expected["kv_scale"].shape, np.float32)}

    def place(tree: dict, shard_tree: dict, want: dict, prefix: str = "") -> dict:
        out = {}
        for name, val in tree.items():
            if isinstance(val, dict):
                out[name] = place(val, shard_tree[name], want[name], f"{prefix}{name}.")
                continue
            if isinstance(val, QArray):
                out[name] = _place_quantized(val, name, shard_tree[name], want[name], layout,
                                             f"{prefix}{name}")
                continue
            arr = np.asarray(val)
            if name in KV_WEIGHTS:
                arr = repeat_kv_heads(arr, layout, head_dim)
            if arr.shape != want[name].shape:
                raise ValueError(f"{prefix}{name}: expected {want[name].shape}, got {arr.shape}")
            arr = arr.astype(want[name].dtype, copy=False)
            out[name] = jax.make_array_from_callback(
                arr.shape, shard_tree[name], lambda index, a=arr: a[index])
        return out

    pure = place(state, shardings, expected)
    placed = jax.tree.map(lambda x: x, abstract_state)  # a copy to fill in
    nnx.replace_by_pure_dict(placed, pure)
    return placed


def _place_quantized(q: Any, name: str, sharding: NamedSharding, want: Any, layout: HeadLayout,
                     where: str) -> Any:
    """A pre-quantized linear (quantization.QArray) split like its float weight."""
    from jaxllm.quantization.tp import place_qarray

    if name in KV_WEIGHTS and layout.kv_repeat > 1:
        raise ValueError(f"{where}: quantized KV projections cannot be repeated for "
                         f"tensor_parallel_size > num_key_value_heads ({layout.num_kv_heads})")
    if tuple(q.shape) != tuple(want.shape):
        raise ValueError(f"{where}: expected {want.shape}, got {q.shape}")
    return place_qarray(q, sharding.spec, sharding.mesh, where)


def init_random_state(make_unsharded: Callable[[], nnx.Module], abstract_state: nnx.State,
                      mesh: Mesh, layout: HeadLayout, head_dim: int,
                      axes: dict[str, int] | None = None) -> nnx.State:
    """Random weights (tests, benchmarks) created already sharded.

    The model is initialised inside one jit with the checkpoint's K heads (so the
    values equal the unsharded model's for the same seed), KV heads repeated, and
    the outputs given their shardings: XLA computes each device's part there.
    """
    shardings = state_shardings(abstract_state, mesh, axes)

    def init() -> dict:
        pure = nnx.to_pure_dict(nnx.state(make_unsharded()))
        for name in KV_WEIGHTS:
            if name in pure["layers"]:
                pure["layers"][name] = repeat_kv_heads(pure["layers"][name], layout, head_dim, jnp)
        return pure

    pure = jax.jit(init, out_shardings=shardings)()
    placed = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(placed, pure)
    return placed


def bytes_on_device(tree: Any, device: jax.Device) -> int:
    """Bytes of `tree`'s arrays that live on `device` (its shards only)."""
    total = 0
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            if s.device == device:
                total += s.data.nbytes
    return total
