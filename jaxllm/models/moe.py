"""The mixture-of-experts layer: route, sort rows by expert, grouped matmul, unsort, combine.

Shapes are fixed by the token bucket: T tokens route to exactly T * top_k rows,
whatever the routing, so no routing ever compiles a new shape. Nothing is
dropped (no capacity factor): every row is computed by its expert.

    logits [T, E] (float32) -> top-k weights/ids [T, k] -> rows sorted by expert [T*k]
    -> grouped matmul over the sorted rows (`gmm`, per expert group) -> unsorted,
    weighted by the router and summed over k -> [T, H]

`jax.lax.ragged_dot` is the reference grouped matmul and the CPU path; other
implementations plug in as `gmm` (models/gmm.py). A `gmm` whose `direct_mlp(rows)` returns a
function `mlp(x [T, H], w_gate, w_up, w_down, groups [T * k]) -> [T * k, H]` takes the rows
unsorted instead (row r = token r // k's (r % k)-th expert, of group groups[r]; a group
outside [0, E_local): none): small decode batches skip the sort and unsort. One whose
`sorted_mlp(rows)` returns `mlp(xs [M, H] sorted, w_gate, w_up, w_down, sizes, inverse [M]) ->
[M, H]` (rows in token order) runs the whole MLP of the sorted rows and the unsort. Padding tokens
(`valid` False) go to a group past the last expert, which no group size covers: they cost
nothing in a kernel that honours group sizes and contribute zeros.

Expert parallelism calls `experts` with a slice of the experts (`first_expert`
.. + E_local): rows routed elsewhere go to the uncovered group too, and the
caller sums the devices' partial outputs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.kernels import moe_router

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def route(logits: jax.Array, top_k: int, routing: str, norm_topk_prob: bool
          ) -> tuple[jax.Array, jax.Array]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32).

    "softmax": softmax over all experts, then top-k, renormalised to sum 1 when
    `norm_topk_prob` (Qwen2/3-MoE). "softmax_topk": softmax over the top-k
    logits (Mixtral). Ties pick the lower expert id first (`lax.top_k`).
    """
    return moe_router.route_logits(logits, top_k, routing, norm_topk_prob)


def sort_rows(groups: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """groups [M] in [0, num_groups] (num_groups: skipped) -> (order, inverse, sizes [num_groups]).

    `x[order]` lists the rows grouped by id (stable: ties keep row order);
    `y_sorted[inverse]` puts results back in row order.
    """
    order = jnp.argsort(groups, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.zeros(num_groups + 1, jnp.int32).at[groups].add(1)[:num_groups]
    return order, inverse, sizes


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] rows sorted by group, w [G, K, N] -> [M, N] (rows past sum(group_sizes): 0)."""
    return jax.lax.ragged_dot(x, w, group_sizes)


def swiglu(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array,
           gmm: GroupedMatmul = ragged_dot) -> jax.Array:
    """silu(xs @ w_gate) * (xs @ w_up) per group: [M, H] -> [M, F].

    A `gmm` with `swiglu(x, w1, w2, sizes)` computes it whole (one kernel); else one with
    `pair(x, w1, w2, sizes) -> (y1, y2)` computes gate and up together; else two calls.
    """
    fused = getattr(gmm, "swiglu", None)
    if fused is not None:
        return fused(xs, w_gate, w_up, group_sizes)
    pair = getattr(gmm, "pair", None)
    if pair is not None:
        g, u = pair(xs, w_gate, w_up, group_sizes)
    else:
        g, u = gmm(xs, w_gate, group_sizes), gmm(xs, w_up, group_sizes)
    return jax.nn.silu(g) * u


def expert_mlp(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               group_sizes: jax.Array, gmm: GroupedMatmul = ragged_dot) -> jax.Array:
    """SwiGLU of each sorted row by its group's expert: [M, H] -> [M, H]."""
    return gmm(swiglu(xs, w_gate, w_up, group_sizes, gmm), w_down, group_sizes)


def experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, valid: jax.Array | None = None, first_expert: jax.Array | int = 0,
            gmm: GroupedMatmul = ragged_dot) -> jax.Array:
    """Weighted sum over each token's experts among w_*[0:E_local] (= experts first_expert..).

    x [T, H]; weights / ids [T, k]; w_gate / w_up [E_local, H, F]; w_down [E_local, F, H].
    """
    T, k = ids.shape
    E = w_gate.shape[0]
    local = ids - first_expert
    mine = (local >= 0) & (local < E)
    if valid is not None:
        mine = mine & valid[:, None]
    groups = jnp.where(mine, local, E).reshape(T * k)
    direct = getattr(gmm, "direct_mlp", None)
    mlp = direct(T * k) if direct is not None else None
    if mlp is not None:  # rows left in token order, one kernel slot each: nothing sorted
        # A direct kernel skips ids outside [0, E) itself: without `valid` (a router that gave
        # padding tokens id E, `route_tokens`) the ids go to it as they are, no XLA kernel between.
        ys = mlp(x, w_gate, w_up, w_down, groups if valid is not None else local.reshape(T * k))
        ys = ys.reshape(T, k, -1)
    else:
        order, inverse, sizes = sort_rows(groups, E)
        xs = x[order // k]  # row r = token r // k, its (r % k)-th expert
        whole = getattr(gmm, "sorted_mlp", None)
        mlp = whole(T * k) if whole is not None else None
        if mlp is not None:  # the whole MLP in one implementation, the unsort in its last gather
            ys = mlp(xs, w_gate, w_up, w_down, sizes, inverse)
        else:
            ys = expert_mlp(xs, w_gate, w_up, w_down, sizes, gmm)[inverse]
        ys = ys.reshape(T, k, -1)
    wk = jnp.where(mine, weights, 0.0).astype(ys.dtype)
    ys = jnp.where(mine[..., None], ys, 0)  # a kernel may leave uncovered rows undefined
    return jnp.einsum("tkh,tk->th", ys, wk)


def split_experts(w, name: str, groups: int, splits: int, xp=jnp):
    """Expert weights in the expert x tensor parallel layout: [..., E, H, F] (e_gate / e_up) or
    [..., E, F, H] (e_down) -> [..., E * splits, H, F / splits] / [..., E * splits, F / splits, H],
    slot (g * splits + t) * El + j holding expert g * El + j's t-th slice of F (El = E / groups).
    Cut evenly along its slot axis over groups * splits devices, device g * splits + t holds
    the t-th F slice of expert group g (parallel/experts.py)."""
    *lead, E, a, b = w.shape
    El = E // groups
    if name == "e_down":  # F is the middle axis
        x = w.reshape(*lead, groups, El, splits, a // splits, b)
        return xp.moveaxis(x, -3, -4).reshape(*lead, E * splits, a // splits, b)
    x = w.reshape(*lead, groups, El, a, splits, b // splits)
    return xp.moveaxis(x, -2, -4).reshape(*lead, E * splits, a, b // splits)


def expert_loads(ids: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
    """Rows routed to each expert: ids [T, k] -> [num_experts] int32 (padding not counted)."""
    ones = jnp.ones(ids.shape, jnp.int32) if valid is None else \
        jnp.broadcast_to(valid[:, None], ids.shape).astype(jnp.int32)
    return jnp.zeros(num_experts, jnp.int32).at[ids.reshape(-1)].add(ones.reshape(-1))
