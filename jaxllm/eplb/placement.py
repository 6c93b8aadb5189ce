"""Where each expert's replicas go: DeepSeek's EPLB greedy packing, in numpy (host side).

Given one layer's measured load per logical expert, `rebalance` picks how many
replicas each expert gets (S physical slots for E experts: each extra slot goes
to the expert with the highest load per replica) and then packs the S replicas
onto N devices, S/N slots each, heaviest first onto the least loaded device
that still has room (DeepSeek's `replicate_experts` + `balanced_packing`, the
policy their hierarchical algorithm reduces to with one node and one group).
A token is spread evenly over its expert's replicas, so a replica's load is
the expert's load divided by its replica count.
"""

from __future__ import annotations

import numpy as np


def replicate(load: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica count per expert [E] summing to num_slots (every expert at least one)."""
    E = load.shape[0]
    if num_slots < E:
        raise ValueError(f"{num_slots} physical slots cannot hold {E} experts")
    count = np.ones(E, np.int64)
    load = load.astype(np.float64)
    for _ in range(num_slots - E):
        count[int(np.argmax(load / count))] += 1
    return count


def pack(item_load: np.ndarray, num_bins: int) -> np.ndarray:
    """Bin of each item, len(items)/num_bins items per bin, balancing the bins' sums."""
    n = item_load.shape[0]
    per_bin = n // num_bins
    bins = np.full(n, -1, np.int64)
    totals = np.zeros(num_bins)
    sizes = np.zeros(num_bins, np.int64)
    for i in np.argsort(-item_load, kind="stable"):
        open_bins = np.flatnonzero(sizes < per_bin)
        b = open_bins[np.argmin(totals[open_bins])]
        bins[i], totals[b], sizes[b] = b, totals[b] + item_load[i], sizes[b] + 1
    return bins


def rebalance(load: np.ndarray, num_slots: int, num_devices: int) -> np.ndarray:
    """One layer: physical slot -> logical expert [S]; slots d*S/N.. live on device d."""
    if num_slots % num_devices:
        raise ValueError(f"{num_slots} physical slots do not split over {num_devices} devices")
    count = replicate(load, num_slots)
    experts = np.repeat(np.arange(load.shape[0]), count)  # one entry per replica
    replica_load = load[experts] / count[experts]
    bins = pack(replica_load, num_devices)
    order = np.lexsort((experts, bins))  # device-major; within a device by expert id
    return experts[order]


def maps(phys_to_log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """[..., S] slot -> expert  ==>  (log_to_phys [..., E, R+1] (padded with a valid slot), count [..., E])."""
    lead, S = phys_to_log.shape[:-1], phys_to_log.shape[-1]
    width = S - num_experts + 1
    flat = phys_to_log.reshape(-1, S)
    l2p = np.zeros((flat.shape[0], num_experts, width), np.int32)
    cnt = np.zeros((flat.shape[0], num_experts), np.int32)
    for row, p2l in enumerate(flat):
        for s, e in enumerate(p2l):
            l2p[row, e, cnt[row, e]] = s
            cnt[row, e] += 1
        if (cnt[row] == 0).any():
            raise ValueError(f"placement leaves experts {np.flatnonzero(cnt[row] == 0).tolist()} without a slot")
        for e in range(num_experts):  # pad with the first replica: any index < count is used
            l2p[row, e, cnt[row, e]:] = l2p[row, e, 0]
    return l2p.reshape(*lead, num_experts, width), cnt.reshape(*lead, num_experts)


def device_loads(load: np.ndarray, phys_to_log: np.ndarray, num_devices: int) -> np.ndarray:
    """Per-device load [N] of one layer: each slot carries its expert's load / replica count."""
    count = np.bincount(phys_to_log, minlength=load.shape[0])
    slot = load[phys_to_log] / count[phys_to_log]
    return slot.reshape(num_devices, -1).sum(-1)


def imbalance(load: np.ndarray, phys_to_log: np.ndarray, num_devices: int) -> float:
    """max / mean of the per-device loads, averaged over layers (load [Lm, E], p2l [Lm, S]); 1 is perfect."""
    ratios = []
    for lo, p2l in zip(load, phys_to_log):
        d = device_loads(lo, p2l, num_devices)
        ratios.append(d.max() / d.mean() if d.mean() > 0 else 1.0)
    return float(np.mean(ratios))


def initial(num_experts: int, num_slots: int, num_devices: int, num_layers: int) -> np.ndarray:
    """[Lm, S]: the placement for a uniform load (the start-up one)."""
    row = rebalance(np.ones(num_experts), num_slots, num_devices)
    return np.tile(row, (num_layers, 1))
