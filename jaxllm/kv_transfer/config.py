"""`--kv-transfer-config` and `--kv-events-config` as frozen dataclasses (vLLM's field names).

Both arrive as JSON objects (`jaxllm.engine.arg_utils.json_arg`) and are parsed here, so a
bad key or value fails at start-up with a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_transfer_config.kv_connector must be a connector name, got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferConfig":
        if not isinstance(d, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - known - {"kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size",
                                  "kv_ip", "kv_port", "engine_id"}  # vLLM keys accepted, unused here
        if extra:
            raise ValueError(f"kv_transfer_config: unknown key(s) {sorted(extra)}")
        if "kv_connector" not in d:
            raise ValueError("kv_transfer_config.kv_connector is required")
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" | "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    buffer_steps: int = 10_000  # batches queued for the publisher thread before dropping

    def __post_init__(self):
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZMQ endpoint, got {self.endpoint!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "KVEventsConfig":
        if not isinstance(d, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - known - {"replay_endpoint", "hwm", "max_queue_size"}
        if extra:
            raise ValueError(f"kv_events_config: unknown key(s) {sorted(extra)}")
        return cls(**{k: v for k, v in d.items() if k in known})
