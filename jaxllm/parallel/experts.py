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

Either way each device holds a partial sum of the block's output, and one
all-reduce (psum) combines it -- the same collective the dense MLP ends in, and
what vLLM's expert parallelism does when attention is not data-parallel.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxllm.models.config import ModelConfig
from jaxllm.models.moe import experts
from jaxllm.parallel.mesh import AXIS


def check_experts(model_cfg: ModelConfig, tp: int, expert_parallel: bool,
                  num_slots: int | None = None) -> None:
    """ValueError naming the field when the experts cannot be laid out over `tp` devices."""
    m = model_cfg.moe
    if m is None:
        if expert_parallel:
            raise ValueError(f"enable_expert_parallel: {model_cfg.architecture} is a dense model "
                             "(no experts to place); drop the flag")
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


def shard_experts(mesh: Mesh, expert_parallel: bool):
    """`experts_fn(x, weights, ids, w_gate, w_up, w_down, valid)` over the mesh (see module doc)."""
    if expert_parallel:
        w_specs = (P(AXIS), P(AXIS), P(AXIS))  # [E, H, F], [E, H, F], [E, F, H]: split by expert
    else:
        w_specs = (P(None, None, AXIS), P(None, None, AXIS), P(None, AXIS, None))  # by F

    def local(x, weights, ids, w_gate, w_up, w_down, valid):
        first = jax.lax.axis_index(AXIS) * w_gate.shape[0] if expert_parallel else 0
        part = experts(x, weights, ids, w_gate, w_up, w_down, valid, first_expert=first)
        return jax.lax.psum(part, AXIS)

    run = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), *w_specs, P()), out_specs=P(),
                        check_vma=False)
    return lambda x, weights, ids, w_gate, w_up, w_down, valid: run(
        x, weights, ids, w_gate, w_up, w_down, valid)
