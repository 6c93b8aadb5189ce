"""`--eplb-config` (vLLM's names): window_size, step_interval, num_redundant_experts, log_balancedness."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EPLBConfig:
    window_size: int = 1000  # steps of per-expert load kept for the next placement
    step_interval: int = 3000  # steps between rebalancing
    num_redundant_experts: int = 0  # extra physical slots for replicas of hot experts
    log_balancedness: bool = False  # log the load balance every step_interval steps too

    def __post_init__(self):
        for name in ("window_size", "step_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"eplb_config.{name} must be an integer >= 1, got {v!r}")
        r = self.num_redundant_experts
        if not isinstance(r, int) or r < 0:
            raise ValueError(f"eplb_config.num_redundant_experts must be an integer >= 0, got {r!r}")

    @classmethod
    def parse(cls, value: "EPLBConfig | dict[str, Any] | None") -> "EPLBConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"eplb_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"eplb_config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)
