"""The KV connector API, split as vLLM V1's `KVConnectorBase_V1` is.

Scheduler side (host, no JAX; called by `jaxllm.runtime.scheduler`):

* `get_num_new_matched_tokens(req, num_computed_tokens) -> (n, load_async)`: tokens past
  the device prefix-cache hits this connector can supply. `n` is None when it cannot tell
  yet (e.g. blocks are being read from disk in the background): the request steps aside
  (it does not block the batch) until `get_finished()` names it ready. `load_async` (with
  n > 0): the request gets its blocks now and waits in WAITING_FOR_REMOTE_KVS, off the
  batch, while the worker loads them; `get_finished()` names it once they are in.
* `update_state_after_alloc(req, block_ids, num_external_tokens)`: the request's device
  blocks are allocated; remember which ones the external tokens load into.
* `build_connector_meta() -> meta`: this step's loads and saves, carried to the worker by
  `SchedulerOutput.kv_connector_metadata`.
* `request_finished(req, block_ids) -> (delay_free, kv_transfer_params)`: the request is
  done; its blocks may be saved, or held (delay_free) until `get_finished()` names it sent.
* `get_finished() -> (sent, received)`: request ids whose delayed blocks may be freed, and
  ids whose background fetches or asynchronous loads finished (schedulable again).
* `wait_for_progress(timeout)` (not in vLLM's API): the engine has nothing to run but
  requests waiting for this connector; block until something may have finished
  (`notify_progress()`, from the connector's threads) or `timeout` seconds passed.

Worker side (device; called on the dispatch thread in step order by `engine/dispatch.py`,
with `mover` the engine's `KVOps`): `finish_load_kv` (not in vLLM's API) writes the
asynchronous loads this step's `get_finished` reported into the pages, before any other
page move; `save_kv_layer` runs before the step's other page writes
(it reads blocks that finished earlier, as they were before this step); `start_load_kv`
writes loaded blocks after the step's swap-ins and before the forward pass;
`wait_for_save` marks the end of a step's saves. The step is one jitted program over all
layers, so layers are not separate units here: `wait_for_layer_load` has nothing to wait
for and the layer name is None.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from jaxllm.kv_transfer.config import KVTransferConfig


@dataclasses.dataclass
class ConnectorContext:
    """What the engine tells a connector about the KV cache it serves."""

    block_size: int
    block_bytes: int  # bytes of one block over all layers (K and V)
    block_shape: tuple[int, ...]  # [L, 2, K, S, D] as KVOps moves it
    dtype: str
    fingerprint: str  # model and KV layout: blocks of another model never match
    block_hashes: Any = None  # (req, num_blocks) -> the request's full-block hashes
    mover: Any = None  # engine KVOps (worker side); set by the engine
    offload_cpu_gib: float = 0.0
    offload_disk_dir: str | None = None
    offload_disk_gib: float | None = None


class KVConnectorBase:
    """A connector that does nothing; subclasses override what they need."""

    def __init__(self, cfg: KVTransferConfig, ctx: ConnectorContext):
        self.cfg, self.ctx = cfg, ctx
        self._progress = threading.Event()  # set when a load or fetch may have finished

    def notify_progress(self) -> None:
        self._progress.set()

    def wait_for_progress(self, timeout: float) -> None:
        """Return when `notify_progress()` was called since the last `get_finished()`, or
        after `timeout` seconds (a connector that never notifies: a plain sleep)."""
        self._progress.wait(timeout)

    # -- scheduler side -----------------------------------------------------
    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, req, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self) -> Any:
        return None

    def request_finished(self, req, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    def request_preempted(self, req, block_ids: list[int]) -> None:
        """Recompute preemption is about to free the request's blocks (not in vLLM's API)."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(Subclasses clear `_progress` before they look, so a notify after it is not lost.)"""
        self._progress.clear()
        return set(), set()

    # -- worker side --------------------------------------------------------
    def finish_load_kv(self, pages, meta):
        return pages

    def start_load_kv(self, pages, meta):
        return pages

    def wait_for_layer_load(self, layer_name: str | None = None) -> None:
        pass

    def save_kv_layer(self, layer_name: str | None, pages, meta) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # -- both ---------------------------------------------------------------
    def stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass
