"""Run an attention backend on each device's heads with `shard_map`.

Heads are independent in attention, and the head layout (mesh.py) puts every
query head on the device that stores its KV head, so each device can run the
unmodified single-device backend (reference jnp, Pallas or Mosaic kernels) on
its local [T, H/N, D] queries and [L, 2, K'/N, P, S, D] pages, with no
communication. Writing the new K/V into the pages is a scatter along the page
axes that XLA partitions locally (the update and the pages are split the same
way), so it needs no wrapper.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.parallel.mesh import AXIS
from jaxllm.parallel.sharding import KV_PAGES_SPEC

AttentionFn = Callable[..., jax.Array]
_HEADS = P(None, AXIS, None)  # q / out [T, H, D]: split by head


def shard_attention(fn: AttentionFn, mesh: Mesh) -> AttentionFn:
    """Wrap `fn(q, kv_pages, layer, md, *, sm_scale)` to run per shard of the mesh."""

    @functools.wraps(fn)
    def sharded(q: jax.Array, kv_pages: jax.Array, layer: jax.Array, md: AttentionMetadata, *,
                sm_scale: float) -> jax.Array:
        local = functools.partial(fn, sm_scale=sm_scale)
        # Metadata and the layer index are replicated (P() is a prefix for the whole pytree).
        # check_vma=False: Pallas/Mosaic kernels do not declare varying-axis types.
        run = jax.shard_map(local, mesh=mesh, in_specs=(_HEADS, KV_PAGES_SPEC, P(), P()),
                            out_specs=_HEADS, check_vma=False)
        return run(q, kv_pages, layer, md)

    return sharded
