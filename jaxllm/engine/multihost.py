"""Several processes, one model: process 0 schedules, every process runs the step (the driver loop).

JAX is multi-controller: a jitted computation over a mesh that spans processes
runs only when every process calls it, with the same shapes, in the same order.
So process 0 (the leader) keeps the whole host side (scheduler, block manager,
sampler, server) and, before each step, broadcasts the step's padded batch; the
other processes (followers) sit in `follow`, receiving batches and running the
same jitted step on their devices. Their copy of the logits is dropped; the
leader samples from its local replica.

Wire format, per step, two `broadcast_one_to_all` calls: a fixed [4] int32
header (command, T, R, real rows), then the batch's int32 fields concatenated
(their shapes follow from T, R and the block-table width B, which every process
derives from the same config). Each (T, R) bucket compiles its broadcast once,
during warm-up, as the step does. Copy-on-write page copies (n > 1, beam search)
travel the same way before the step that needs them (header, then a fixed
[2, max_copies] payload): every process holds some KV heads of every page.
Swap preemption is refused with several processes (its host pool is per process).
EPLB's warm-up (its collectives and compiles, `eplb/balancer.py`) is announced by a header
of its own, so every process runs it at the same point.

`jax.distributed` start-up itself is collective plumbing and lives in
`jaxllm.parallel.multihost.init_distributed`.
"""

from __future__ import annotations

import atexit
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxllm.engine.batch import HostBatch

log = logging.getLogger("jaxllm")

_STOP, _STEP, _COPY, _EPLB_WARMUP = 0, 1, 2, 3


def _field_shapes(T: int, R: int, B: int) -> dict[str, tuple[int, ...]]:
    return dict(tokens=(T,), positions=(T,), token_req=(T,), slot_mapping=(T,),
                block_tables=(R, B), seq_lens=(R,), query_start_loc=(R + 1,), num_seqs=(1,),
                logits_indices=(R,))


class StepChannel:
    """Leader -> followers broadcast of each step's `HostBatch` (or a stop command)."""

    def __init__(self, max_blocks: int, max_copies: int):
        self.max_blocks = max_blocks
        self.max_copies = max_copies
        self.is_leader = jax.process_index() == 0
        self.closed = False

    def _header(self, values: tuple[int, int, int, int] = (0, 0, 0, 0)) -> np.ndarray:
        return multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))

    def send(self, hb: HostBatch) -> None:
        if not self.is_leader:
            raise RuntimeError(f"process {jax.process_index()} is a follower: only process 0 "
                               "schedules; run jaxllm.engine.multihost.follow / run_follower here")
        T, R = hb.tokens.shape[0], hb.block_tables.shape[0]
        self._header((_STEP, T, R, hb.num_rows))
        names = _field_shapes(T, R, self.max_blocks)
        payload = np.concatenate([np.asarray(getattr(hb, n), np.int32).ravel() for n in names])
        multihost_utils.broadcast_one_to_all(payload)

    def send_copies(self, pairs: list[tuple[int, int]]) -> None:
        """Leader: the step's (source, destination) block copies; [] during warm-up."""
        self._header((_COPY, len(pairs), 0, 0))
        payload = np.full((2, self.max_copies), -1, np.int32)
        if pairs:
            payload[:, :len(pairs)] = np.asarray(pairs, np.int32).T
        multihost_utils.broadcast_one_to_all(payload)

    def send_eplb_warmup(self) -> None:
        """Leader: every process warms up its expert balancer now (`follow` runs it)."""
        self._header((_EPLB_WARMUP, 0, 0, 0))

    def receive(self) -> HostBatch | list[tuple[int, int]] | str | None:
        """Block until the leader's next batch (or block copies, or "eplb_warmup"); None once it
        sends stop."""
        cmd, T, R, rows = (int(v) for v in self._header())
        if cmd == _STOP:
            self.closed = True
            return None
        if cmd == _EPLB_WARMUP:
            return "eplb_warmup"
        if cmd == _COPY:
            payload = np.asarray(multihost_utils.broadcast_one_to_all(
                np.zeros((2, self.max_copies), np.int32)))
            return [(int(a), int(b)) for a, b in payload[:, :T].T]
        shapes = _field_shapes(T, R, self.max_blocks)
        size = sum(int(np.prod(s)) for s in shapes.values())
        flat = multihost_utils.broadcast_one_to_all(np.zeros(size, np.int32))
        fields, at = {}, 0
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            fields[name] = np.asarray(flat[at:at + n]).reshape(shape)
            at += n
        return HostBatch(**fields, num_rows=rows)

    def close(self) -> None:
        """Leader: release the followers (idempotent; also registered with atexit)."""
        if self.is_leader and not self.closed:
            self.closed = True
            self._header((_STOP, 0, 0, 0))
            log.info("multi-host: sent stop to %d follower process(es)", jax.process_count() - 1)


def leader_channel(max_blocks: int, max_copies: int) -> StepChannel:
    ch = StepChannel(max_blocks, max_copies)
    if ch.is_leader:
        atexit.register(ch.close)  # runs before jax.distributed's own atexit shutdown
    return ch


def follow(runner, kv_ops) -> int:
    """Follower loop: run the leader's steps and page copies until it stops; returns the step count."""
    if runner.channel is None or runner.channel.is_leader:
        raise RuntimeError("follow() runs on processes other than 0 of a multi-process engine")
    steps = 0
    while (msg := runner.channel.receive()) is not None:
        if isinstance(msg, list):
            runner.kv_pages = kv_ops.copy(runner.kv_pages, msg)
            continue
        if msg == "eplb_warmup":
            runner.eplb.warmup(runner)
            continue
        runner.run_step(msg)
        steps += 1
    log.info("multi-host follower %d: leader stopped after %d steps", jax.process_index(), steps)
    return steps


def run_follower(model: str | None = None, **engine_kwargs) -> int:
    """Build the engine exactly as the leader does (same arguments), then follow its steps."""
    from jaxllm.config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    extra = {k: engine_kwargs.pop(k) for k in ("hf_config", "weights") if k in engine_kwargs}
    cfg = EngineConfig(model=model, **engine_kwargs)
    if cfg.num_processes <= 1 or cfg.process_id == 0:
        raise ValueError("run_follower is for process ids 1..num_processes-1")
    engine = LLMEngine(cfg, **extra)
    return follow(engine.runner, engine.kv_ops)


__all__ = ["StepChannel", "follow", "leader_channel", "run_follower"]
