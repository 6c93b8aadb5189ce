"""`jax.distributed` start-up: one model over several processes (multi-host).

The leader/follower driver loop that runs the engine's steps on every process is
the engine's (`jaxllm.engine.multihost`); this module only joins the processes.
"""

from __future__ import annotations

import logging

import jax

log = logging.getLogger("jaxllm")


def init_distributed(coordinator: str | None, num_processes: int, process_id: int) -> bool:
    """`jax.distributed.initialize` when more than one process is asked for; True if multi-process.

    Must run before anything touches a JAX backend. CPU collectives use gloo, so
    local processes on 127.0.0.1 work without accelerators.
    """
    if num_processes <= 1:
        return False
    if not jax.distributed.is_initialized():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
        log.info("jax.distributed: process %d of %d, coordinator %s, %d local / %d global devices",
                 jax.process_index(), jax.process_count(), coordinator, jax.local_device_count(),
                 jax.device_count())
    return True


__all__ = ["init_distributed"]
