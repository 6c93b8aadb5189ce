"""KV connectors (vLLM V1's KV transfer API): offload tiers, P/D disaggregation, KV events.

The scheduler side of every connector is host code and never imports JAX; the worker
side moves pages through the engine's `KVOps`, which it is handed.
"""

from jaxllm.kv_transfer.base import ConnectorContext, KVConnectorBase
from jaxllm.kv_transfer.config import KVEventsConfig, KVTransferConfig
from jaxllm.kv_transfer.factory import make_connector, transfer_config

__all__ = ["ConnectorContext", "KVConnectorBase", "KVEventsConfig", "KVTransferConfig",
           "make_connector", "transfer_config"]
