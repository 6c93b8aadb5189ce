"""MoE experts over the tensor-parallel mesh, with `shard_map`.

Tokens reach the expert block replicated (attention is tensor-parallel and ends
in an all-reduce), and the router runs on every device alike, so each device
knows every token's experts without communication. Two layouts:

- expert parallel (`enable_expert_parallel`): device d holds whole experts
  d*E/N .. (d+1)*E/N - 1 (physical slots under EPLB). It sorts and computes only
  the rows routed to its experts; the rest go to the uncovered group (no work in
  a grouped matmul that honours group sizes).
- tensor parallel (default, vLLM's too): every expert is split along its
  intermediate dimension (gate/up by columns, down by rows); every device
  computes every row on its slice.
- both (`expert_parallel_size` = P < N, SGLang's --ep-size): P groups of N / P
  devices; group g holds whole experts g*E/P .. (g+1)*E/P - 1, each split along its
  intermediate dimension over the group's devices (`models.moe.split_experts` lays
  the slots out so that one cut of the slot axis over the N devices gives this).
  A device computes the rows routed to its group's experts on its slice.

Expert parallel dispatches with all-to-all (`dispatch_all_to_all`): each device
sends its share of the tokens' rows to the devices of their experts and gets the
outputs back, then an all-gather rebuilds the replicated output. Otherwise
(tensor-parallel experts, or a token bucket the mesh does not divide) each device
holds a partial sum of the block's output over the whole batch, and one psum
combines it -- the collective the dense MLP ends in, and what vLLM's expert
parallelism does when attention is not data-parallel. Both layouts at once combine
by that psum (it sums the groups and the intermediate slices alike).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxllm.models.config import ModelConfig
from jaxllm.models.moe import experts
from jaxllm.parallel.mesh import AXIS


def check_experts(model_cfg: ModelConfig, tp: int, expert_parallel: bool,
                  num_slots: int | None = None, ep: int | None = None) -> None:
    """ValueError naming the field when the experts cannot be laid out over `tp` devices
    (`ep`: expert-parallel groups, default tp)."""
    m = model_cfg.moe
    if m is None:
        if expert_parallel:
            raise ValueError(f"enable_expert_parallel: {model_cfg.architecture} is a dense model "
                             "(no experts to place); drop the flag")
        return
    if expert_parallel and ep not in (None, tp):
        if m.num_experts % ep:
            raise ValueError(f"expert_parallel_size={ep} must divide num_experts={m.num_experts}")
        if m.moe_intermediate_size % (tp // ep):
            raise ValueError(f"moe_intermediate_size={m.moe_intermediate_size} is not divisible by "
                             f"tensor_parallel_size / expert_parallel_size = {tp // ep}")
        return
    if expert_parallel:
        slots = num_slots or m.num_experts
        if slots % tp:
            what = (f"num_experts={m.num_experts}" if slots == m.num_experts else
                    f"num_experts={m.num_experts} + num_redundant_experts={slots - m.num_experts}")
            raise ValueError(f"enable_expert_parallel: {what} is not divisible by the expert-parallel "
                             f"size (tensor_parallel_size={tp})")
    elif m.moe_intermediate_size % tp:
        raise ValueError(f"moe_intermediate_size={m.moe_intermediate_size} is not divisible by "
                         f"tensor_parallel_size={tp}; try enable_expert_parallel")


def dispatch_all_to_all(x, weights, ids, w_gate, w_up, w_down, valid, n: int):
    """One device's part of expert-parallel MoE with all-to-all dispatch and combine.

    Device d takes tokens d*T/n .. (d+1)*T/n of the (replicated) batch. Each of its
    T/n * k rows goes to the device owning its expert: a fixed [n, C, H] send buffer
    (C = T/n * k, so even every row to one device fits: dropless), row r at
    [owner, rank of r among the rows to that owner]. One all-to-all delivers the
    rows, the owner runs the grouped matmul over the rows it received (n * C, the
    empty places in the uncovered group), a second all-to-all returns the outputs
    to the same places, the source weights and sums each token's k rows, and an
    all-gather rebuilds the replicated [T, H] output.
    """
    d = jax.lax.axis_index(AXIS)
    T, k = ids.shape
    H, El = x.shape[1], w_gate.shape[0]
    Tl = T // n
    C = Tl * k
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, d * Tl, Tl, 0)
    xl, wl, il = take(x), take(weights), take(ids)
    live = jnp.repeat(take(valid), k)
    slot = il.reshape(C)
    owner = jnp.where(live, slot // El, n)  # n: not sent (padding)
    ranks = jnp.cumsum(owner[:, None] == jnp.arange(n)[None, :], axis=0) - 1  # [C, n]
    place = jnp.take_along_axis(ranks, jnp.minimum(owner, n - 1)[:, None], 1)[:, 0]
    rows = jnp.arange(C) // k
    send_x = jnp.zeros((n, C, H), x.dtype).at[owner, place].set(xl[rows], mode="drop")
    send_e = jnp.full((n, C), El, jnp.int32).at[owner, place].set(slot % El, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, AXIS, 0, 0)  # [n, C, H]: recv[j] = device j's rows
    recv_e = jax.lax.all_to_all(send_e, AXIS, 0, 0)
    ones = jnp.ones((n * C, 1), jnp.float32)
    out = experts(recv_x.reshape(n * C, H), ones, recv_e.reshape(n * C, 1), w_gate, w_up, w_down)
    back = jax.lax.all_to_all(out.reshape(n, C, H), AXIS, 0, 0)  # back[j]: my rows' outputs from j
    mine = back[jnp.minimum(owner, n - 1), place]
    mine = jnp.where((owner < n)[:, None], mine, 0).reshape(Tl, k, H)
    y = jnp.einsum("tkh,tk->th", mine, wl.astype(mine.dtype))
    return jax.lax.all_gather(y, AXIS, axis=0, tiled=True)


def shard_experts(mesh: Mesh, expert_parallel: bool, all_to_all: bool = True, splits: int = 1):
    """`experts_fn(x, weights, ids, w_gate, w_up, w_down, valid)` over the mesh (see module doc).

    Expert parallel with `all_to_all` (and a token count the mesh divides) dispatches
    rows with all-to-all (`dispatch_all_to_all`); otherwise every device computes its
    experts' rows of the whole batch and one psum combines. `splits` > 1: each expert is
    also split over `splits` devices (weights in `models.moe.split_experts`' layout).
    """
    n = mesh.shape[AXIS]
    if expert_parallel:
        w_specs = (P(AXIS), P(AXIS), P(AXIS))  # [E, H, F], [E, H, F], [E, F, H]: split by expert
    else:
        w_specs = (P(None, None, AXIS), P(None, None, AXIS), P(None, AXIS, None))  # by F

    def local(x, weights, ids, w_gate, w_up, w_down, valid):
        if expert_parallel and all_to_all and splits == 1 and x.shape[0] % n == 0:
            return dispatch_all_to_all(x, weights, ids, w_gate, w_up, w_down, valid, n)
        group = jax.lax.axis_index(AXIS) // splits
        first = group * w_gate.shape[0] if expert_parallel else 0
        part = experts(x, weights, ids, w_gate, w_up, w_down, valid, first_expert=first)
        return jax.lax.psum(part, AXIS)

    run = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), *w_specs, P()), out_specs=P(),
                        check_vma=False)
    return lambda x, weights, ids, w_gate, w_up, w_down, valid: run(
        x, weights, ids, w_gate, w_up, w_down, valid)
