"""The device side of EPLB: load counters, the logical -> physical map, moving expert weights.

The model holds S = E + R physical expert slots per MoE layer (`e_gate/e_up/e_down`
[Lm, S, ...], split by slot over the expert-parallel devices) and two small int32
arrays that are ordinary inputs of the jitted step: `log2phys` [Lm, E, R+1] (the
slots holding each expert) and `log_count` [Lm, E] (how many). Routing maps a
token's k-th expert e to slot log2phys[e, row % log_count[e]], spreading it over
the replicas. Each step also returns the rows routed to each logical expert
([Lm, E], padding not counted); `record` writes them into a device-resident ring
of the last `window_size` steps.

Every `step_interval` steps `rebalance` reads the window, computes a placement
(placement.py), and rebuilds the expert arrays by one jitted gather along the
slot axis (XLA moves the slots between devices) and the map arrays; the new
arrays have the old shapes and shardings, so the step is never recompiled. The
gather and the ring update are compiled during warm-up. The new arrays replace
entries of the runner's `flat_params` (what the step takes); `runner.params`
keeps the start-up placement's arrays.

Several processes: every process runs every step (`engine/multihost.py`), so each
one's balancer counts the same steps and rebalances at the same one. The window
is read with an all-gather (a collective every process joins there), the
placement is computed alike from the same loads, and host arrays are placed with
`device_put` onto the global shardings, which takes the same value on every
process; only process 0 logs.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.tree_util import DictKey, SequenceKey

from jaxllm.eplb import placement
from jaxllm.eplb.config import EPLBConfig
from jaxllm.models.moe_config import MoEConfig

log = logging.getLogger("jaxllm")
EXPERT_ARRAYS = ("e_gate", "e_up", "e_down")
MAP_ARRAYS = ("log2phys", "log_count")


def map_to_slots(ids: jax.Array, w: dict[str, jax.Array], md) -> jax.Array:
    """Logical expert ids [T, k] -> physical slots, rows spread round-robin over replicas."""
    T, k = ids.shape
    count = w["log_count"][ids]
    replica = jnp.arange(T * k, dtype=jnp.int32).reshape(T, k) % count
    return w["log2phys"][ids, replica]


class ExpertBalancer:
    def __init__(self, moe: MoEConfig, cfg: EPLBConfig, num_devices: int):
        self.cfg = cfg
        self.moe = moe
        self.num_experts = moe.num_experts
        self.num_slots = moe.num_experts + cfg.num_redundant_experts
        self.num_devices = num_devices
        self.num_layers = len(moe.moe_layers)
        self.phys_to_log = placement.initial(self.num_experts, self.num_slots, num_devices,
                                             self.num_layers)
        W = cfg.window_size
        self.window = jnp.zeros((W, self.num_layers, self.num_experts), jnp.int32)
        self.cursor = jnp.zeros((), jnp.int32)
        self._record = jax.jit(lambda win, i, loads: (win.at[i].set(loads), (i + 1) % W),
                               donate_argnums=(0,))
        self._take_stacked = jax.jit(lambda w, p: w[jnp.arange(w.shape[0])[:, None], p])
        self._take_layer = jax.jit(lambda w, p: w[p])
        self.steps = 0
        self._loads_sharding = None  # the step's loads output, known at the first step
        self.history: list[dict] = []  # one entry per rebalance (tests, logs)

    # -- start-up -------------------------------------------------------------------------------
    def model_hooks(self) -> dict:
        return {"num_slots": self.num_slots, "expert_map": map_to_slots, "count_loads": True,
                "placement": self.phys_to_log}

    def expand_state(self, state: dict) -> dict:
        """Host state with E experts -> S slots (the initial placement) plus the map arrays."""
        ex = state["experts"]
        rows = np.arange(self.num_layers)[:, None]
        for name in EXPERT_ARRAYS:
            ex[name] = ex[name][rows, self.phys_to_log]
        ex["log2phys"], ex["log_count"] = placement.maps(self.phys_to_log, self.num_experts)
        return state

    # -- per step -------------------------------------------------------------------------------
    def record(self, loads: jax.Array) -> None:
        if self._loads_sharding is None:  # the first step: the ring moves to the loads' devices
            self._loads_sharding = loads.sharding
            rep = _replicated(loads)
            self.window = jax.device_put(np.zeros(self.window.shape, np.int32), rep)
            self.cursor = jax.device_put(np.zeros((), np.int32), rep)
        self.window, self.cursor = self._record(self.window, self.cursor, loads)

    def after_step(self, runner) -> None:
        self.steps += 1
        if self.steps % self.cfg.step_interval == 0:
            self.rebalance(runner)

    def reset(self) -> None:
        """Forget the warm-up's steps (their padding rows count nothing, but the clock would)."""
        # Zeros where the ring already lives (a fresh uncommitted array would recompile `record`).
        self.window = jax.device_put(np.zeros(self.window.shape, np.int32), self.window.sharding)
        self.cursor = jax.device_put(np.zeros((), np.int32), self.cursor.sharding)
        self.steps = 0

    def loads(self) -> np.ndarray:
        """Rows per logical expert over the window, [Lm, E] (a collective with several processes)."""
        if self.window.is_fully_addressable:
            return np.asarray(jax.device_get(self.window)).sum(0)
        return np.asarray(multihost_utils.process_allgather(self.window, tiled=True)).sum(0)

    def num_compiles(self) -> int:
        return sum(f._cache_size() for f in (self._record, self._take_stacked, self._take_layer))

    # -- rebalancing ----------------------------------------------------------------------------
    def rebalance(self, runner, new: np.ndarray | None = None) -> dict:
        """Place by the window's load (or `new` [Lm, S]) and move the weights; returns the log entry."""
        t0 = time.perf_counter()
        load = self.loads()
        if new is None and not load.any():  # warm-up's padding-only steps: nothing measured
            return {"step": self.steps, "skipped": "no routed rows in the window"}
        if new is None:
            new = np.stack([placement.rebalance(lo, self.num_slots, self.num_devices) for lo in load])
        before = placement.imbalance(load, self.phys_to_log, self.num_devices)
        after = placement.imbalance(load, new, self.num_devices)
        self._apply(runner, new)
        entry = {"step": self.steps, "before": before, "after": after, "tokens": int(load.sum()),
                 "seconds": time.perf_counter() - t0}
        self.history.append(entry)
        if jax.process_index() == 0:
            log.info("EPLB: rebalanced %d MoE layers over %d devices (%d slots for %d experts): per-device "
                 "load max/mean %.3f -> %.3f over the last %d steps (%d routed rows), %.2fs",
                     self.num_layers, self.num_devices, self.num_slots, self.num_experts, before, after,
                     min(self.steps, self.cfg.window_size), entry["tokens"], entry["seconds"])
        return entry

    def _source_slots(self, new: np.ndarray) -> np.ndarray:
        """[Lm, S]: for each new slot, an old slot holding the same expert (spread over replicas)."""
        src = np.zeros_like(new)
        for j in range(self.num_layers):
            holders = {e: list(np.flatnonzero(self.phys_to_log[j] == e)) for e in range(self.num_experts)}
            used = {e: 0 for e in holders}
            for s, e in enumerate(new[j]):
                src[j, s] = holders[e][used[e] % len(holders[e])]
                used[e] += 1
        return src

    def _apply(self, runner, new: np.ndarray) -> None:
        src = self._source_slots(new)
        l2p, cnt = placement.maps(new, self.num_experts)
        moe_layers = list(self.moe.moe_layers)
        # Paths from the params tree; arrays from the step's flat list (the current placement's).
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(runner.step_params)[0]]
        for idx, path in enumerate(paths):
            leaf = runner.flat_params[idx]
            names = [k.key for k in path if isinstance(k, DictKey)]
            if not names or names[-1] not in EXPERT_ARRAYS + MAP_ARRAYS or leaf.size == 0:
                continue
            name = names[-1]
            if "experts" in names:  # stacked [Lm, S, ...] (the scan layout)
                per, take, value = src, self._take_stacked, {"log2phys": l2p, "log_count": cnt}
            else:  # unrolled: one array per decoder layer (path: (1, layer, name))
                layer = [k.idx for k in path if isinstance(k, SequenceKey)][-1]
                j = moe_layers.index(layer)
                per, take, value = src[j], self._take_layer, {"log2phys": l2p[j], "log_count": cnt[j]}
            if name in EXPERT_ARRAYS:
                new_leaf = take(leaf, jax.device_put(per, _replicated(leaf)))
            else:
                new_leaf = np.asarray(value[name], np.int32)
            runner.flat_params[idx] = jax.device_put(new_leaf, leaf.sharding)
        self.phys_to_log = new

    def warmup(self, runner) -> None:
        """Compile the ring update and the weight gather (rebalances onto the same placement).

        Twice each: the first calls take arrays as start-up placed them, later ones the
        outputs of earlier calls, and jit keys its cache on both kinds.
        """
        for _ in range(2):
            self._apply(runner, self.phys_to_log.copy())
            self.reset()
            self.record(jax.device_put(np.zeros(self.window.shape[1:], np.int32), self._loads_sharding))
        self.reset()


def _replicated(x: jax.Array):
    sh = x.sharding
    mesh = getattr(sh, "mesh", None)
    if mesh is None:
        return sh
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
