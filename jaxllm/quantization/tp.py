"""Quantized weights under tensor parallelism: every part of a `QArray` split with its weight.

`parallel/sharding.py` names, per weight, the float axis the mesh splits ([..., K, N]: N for
the column-parallel q/k/v/gate/up, K for the row-parallel o/down). `qarray_spec` maps that
onto each part's own layout (qarray.py):

    fp8   values [..., N, K]: the two axes swapped; scale [..., N/bn, K/bk] split on the same
          axis when it has more than one block there and the shards hold whole blocks.
    int8  values [..., K, N] as the float weight; scale [..., K/g, N] likewise.
    int4  values [..., K/2, N], scale / offset [..., K/g, N]: a K split keeps whole groups
          (and so whole packed bytes) per device when (K/g) % tp == 0.

A scale with one entry along the split axis (per output channel under a K split) is
replicated. Where a split would cut a scale block or an int4 group, the whole QArray is
replicated (with a warning), as `param_spec` does for an axis the mesh does not divide.
The quantization itself is unchanged: `quantize_state` quantizes the float weights
already placed on the mesh (per-channel maxima over a split K are all-reduced by XLA), so
every device holds exactly the slices of the tp=1 run's QArray.
"""

from __future__ import annotations

import dataclasses
import logging

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.quantization.qarray import QArray

log = logging.getLogger("jaxllm")


def _split_axis(spec: P, ndim: int) -> int | None:
    """The float weight's split axis as -2 (K) or -1 (N), or None (replicated)."""
    parts = list(spec) + [None] * (ndim - len(spec))
    axes = [i - ndim for i, p in enumerate(parts) if p is not None]
    if not axes:
        return None
    if len(axes) > 1 or axes[0] not in (-2, -1):
        raise ValueError(f"quantized weights split on a leading axis ({spec}) are not supported")
    return axes[0]


def _spec(ndim: int, axis: int | None, name: str) -> P:
    parts: list = [None] * ndim
    if axis is not None:
        parts[ndim + axis] = name
    return P(*parts)


def qarray_spec(q: QArray, float_spec: P, tp: int, name: str = "") -> QArray:
    """A QArray of PartitionSpecs, one per part, for a weight whose float spec is `float_spec`."""
    nd = q.ndim
    axis = _split_axis(float_spec, nd)
    mesh_axis = next((p for p in float_spec if p is not None), None)
    none = jax_tree_specs(q, {})
    if axis is None:
        return none
    v_axis = -1 - (axis + 2) if q.kind == "fp8" else axis  # fp8 stores [N, K]: swapped
    specs = {"values": v_axis}
    if q.kind == "int4" and v_axis == -2 and (q.shape[-2] // (q.pack or q.group)) % tp:
        # A packed byte holds rows j and j + g/2 of its group: a K split must keep whole groups.
        log.warning("%s: int4 %s groups along K do not split over %d devices; replicating it",
                    name, q.shape[-2] // (q.pack or q.group), tp)
        return none
    for part in ("scale", "offset"):
        a = getattr(q, part)
        if a is None:
            continue
        n = a.shape[v_axis]
        if n == 1:
            continue  # one scale along the split axis: replicated
        full = q.values.shape[v_axis] * (2 if q.kind == "int4" and v_axis == -2 else 1)
        if n % tp or (full // tp) % (-(-full // n)):  # a shard must hold whole blocks / groups
            log.warning("%s: %s %s blocks do not split over %d devices; replicating it",
                        name, q.kind, tuple(a.shape), tp)
            return none
        specs[part] = v_axis
    if q.values.shape[v_axis] % tp:
        log.warning("%s: %s values %s do not split over %d devices; replicating it",
                    name, q.kind, tuple(q.values.shape), tp)
        return none
    return jax_tree_specs(q, {k: _spec(getattr(q, k).ndim, ax, mesh_axis) for k, ax in specs.items()})


def jax_tree_specs(q: QArray, given: dict) -> QArray:
    """The QArray with each array part replaced by its spec (`given`, else replicated)."""
    parts = {k: (given.get(k, P()) if getattr(q, k) is not None else None)
             for k in ("values", "scale", "offset")}
    return dataclasses.replace(q, **parts)


def qarray_shardings(q: QArray, float_spec: P, mesh: Mesh, name: str = "") -> QArray:
    """`qarray_spec` as NamedShardings (a QArray whose parts are shardings: a pytree of them)."""
    from jaxllm.parallel.mesh import AXIS

    specs = qarray_spec(q, float_spec, mesh.shape[AXIS], name)
    return dataclasses.replace(q, **{k: (NamedSharding(mesh, getattr(specs, k))
                                         if getattr(q, k) is not None else None)
                                     for k in ("values", "scale", "offset")})


def place_qarray(q: QArray, float_spec: P, mesh: Mesh, name: str = "") -> QArray:
    """A host (numpy) QArray put straight into per-device shards (checkpoint placement)."""
    import jax
    import numpy as np

    shardings = qarray_shardings(q, float_spec, mesh, name)
    parts = {}
    for k in ("values", "scale", "offset"):
        a = getattr(q, k)
        if a is not None:
            a = np.asarray(a)
            a = jax.make_array_from_callback(a.shape, getattr(shardings, k), lambda i, a=a: a[i])
        parts[k] = a
    return dataclasses.replace(q, **parts)
