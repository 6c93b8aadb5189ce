"""Vocabulary-parallel embedding lookup with `shard_map`.

The embedding table is split by vocabulary row. Left to XLA's partitioner, a
lookup of a few tokens (a decode step) all-gathered the whole table every step
(measured on two H200s: a 1.9 ms all-gather in a 14 ms batch-1 step). Here each
device looks up the tokens that fall in its rows, zeros the rest, and one
all-reduce of the [T, E] result combines them: Megatron's embedding.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxllm.parallel.mesh import AXIS

EmbedFn = Callable[[jax.Array, jax.Array], jax.Array]


def shard_embedding(mesh: Mesh) -> EmbedFn:
    """`embed(table [V, E] split by V, tokens [T]) -> [T, E]`, replicated."""

    def local(table: jax.Array, tokens: jax.Array) -> jax.Array:
        rows = table.shape[0]
        idx = tokens - jax.lax.axis_index(AXIS) * rows
        mine = (idx >= 0) & (idx < rows)
        x = jnp.where(mine[:, None], table[jnp.clip(idx, 0, rows - 1)], 0)
        return jax.lax.psum(x, AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS, None), P()), out_specs=P())
