"""Tensor parallelism over a `jax.sharding` mesh, and multi-process (multi-host) execution.

See docs/parallel.md. `TensorParallel` is what the model runner uses; `init_distributed`
joins the processes. The loop the non-leader processes run (`follow` / `run_follower`) is
the engine's: `jaxllm.engine.multihost`.
"""

from jaxllm.parallel.mesh import AXIS, HeadLayout, head_layout, make_mesh
from jaxllm.parallel.multihost import init_distributed
from jaxllm.parallel.tp import TensorParallel

__all__ = ["AXIS", "HeadLayout", "TensorParallel", "head_layout", "init_distributed", "make_mesh"]
