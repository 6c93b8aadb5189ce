"""Connector names -> classes, and the connector an `EngineConfig` asks for."""

from __future__ import annotations

import importlib

from jaxllm.kv_transfer.base import ConnectorContext, KVConnectorBase
from jaxllm.kv_transfer.config import KVTransferConfig

CONNECTORS = {
    "OffloadingConnector": "jaxllm.kv_transfer.offload:OffloadingConnector",
    "MultiConnector": "jaxllm.kv_transfer.multi:MultiConnector",
    "JaxTransferConnector": "jaxllm.kv_transfer.jax_transfer:JaxTransferConnector",
}


def make_connector(cfg: KVTransferConfig, ctx: ConnectorContext) -> KVConnectorBase:
    """Build the named connector; "module.path:Class" names one outside jaxllm."""
    target = CONNECTORS.get(cfg.kv_connector, cfg.kv_connector)
    if ":" not in target:
        raise ValueError(f"kv_transfer_config.kv_connector: unknown connector {cfg.kv_connector!r} "
                         f"(known: {sorted(CONNECTORS)}, or 'module.path:Class')")
    module, name = target.split(":", 1)
    cls = getattr(importlib.import_module(module), name)
    return cls(cfg, ctx)


def transfer_config(engine_cfg) -> KVTransferConfig | None:
    """The engine's connector config: `kv_transfer_config`, or the offload flags alone
    (`--kv-offload-cpu-gib` / `--kv-offload-disk-dir` imply an OffloadingConnector)."""
    d = engine_cfg.kv_transfer_config
    if d is None and (engine_cfg.kv_offload_cpu_gib or engine_cfg.kv_offload_disk_dir):
        d = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    return None if d is None else KVTransferConfig.from_dict(dict(d))


def fingerprint(engine_cfg, model_cfg, block_shape, dtype, random_weights: bool) -> str:
    """Names the model and KV layout, so stored blocks of another model never match.
    int8 / int4 pages add their byte layout's version (kv_quant.LAYOUT_VERSION): blocks written
    in the earlier row layout (values and scale in each row) are not read as split pages."""
    import hashlib
    from jaxllm.kernels import kv_quant
    ident = (repr(model_cfg), str(dtype), tuple(block_shape), engine_cfg.block_size,
             engine_cfg.model or "embedded-smollm2", ("random", engine_cfg.seed) if random_weights else None)
    fmt = kv_quant.page_format(dtype, block_shape[-1], model_cfg.head_dim)
    if fmt in kv_quant.LAYOUT_VERSION:
        ident += (kv_quant.LAYOUT_VERSION[fmt],)
    return hashlib.sha256(repr(ident).encode()).hexdigest()[:16]


def build_for_engine(engine_cfg, model_cfg, kv, kv_ops, dtype, random_weights: bool):
    """The engine's connector (scheduler and worker side in one object), or None."""
    tc = transfer_config(engine_cfg)
    if tc is None:
        return None
    if engine_cfg.num_processes > 1:  # (tensor parallelism in one process is fine: KVOps
        # moves each block to and from the devices holding its KV heads)
        raise ValueError("kv_transfer_config / kv_offload_*: KV connectors need one process "
                         "(num_processes=1); each process would hold only its own KV heads")
    import numpy as np
    shape = kv_ops.block_shape
    ctx = ConnectorContext(
        block_size=engine_cfg.block_size, block_bytes=int(np.prod(shape)) * np.dtype(dtype).itemsize,
        block_shape=shape, dtype=np.dtype(dtype),
        fingerprint=fingerprint(engine_cfg, model_cfg, shape, np.dtype(dtype), random_weights),
        block_hashes=kv.block_hashes, mover=kv_ops, offload_cpu_gib=engine_cfg.kv_offload_cpu_gib,
        offload_disk_dir=engine_cfg.kv_offload_disk_dir, offload_disk_gib=engine_cfg.kv_offload_disk_gib)
    return make_connector(tc, ctx)
