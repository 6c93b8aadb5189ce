"""Tensor parallelism over a `jax.sharding` mesh, and multi-process (multi-host) execution.

See docs/parallel.md. `TensorParallel` is what the model runner uses; `follow` /
`run_follower` are the loop the non-leader processes run.
"""

from jaxllm.parallel.mesh import AXIS, HeadLayout, head_layout, make_mesh
from jaxllm.parallel.multihost import follow, init_distributed, leader_channel, run_follower
from jaxllm.parallel.tp import TensorParallel

__all__ = ["AXIS", "HeadLayout", "TensorParallel", "follow", "head_layout", "init_distributed",
           "leader_channel", "make_mesh", "run_follower"]
