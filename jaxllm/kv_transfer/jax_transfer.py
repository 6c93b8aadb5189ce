"""JaxTransferConnector: prefill/decode disaggregation over `jax.experimental.transfer`.

Each engine runs a transfer server. A producer (prefill engine) that finishes a request
sent with `kv_transfer_params = {"do_remote_decode": true}` copies the request's full
prompt blocks out of its pool (on the device, before the pool can reuse them), offers the
copies to its transfer server for one pull under a fresh uuid, and answers with
`{"do_remote_prefill": true, "remote_address", "remote_uuid", "remote_num_blocks", ...}`;
its own blocks are freed as usual, and the server drops copies nobody pulled once the
lease (`lease_s`) runs out. A consumer (decode engine) given those parameters pulls the
copies into its own device memory on a background thread while the request steps aside,
then loads them into the request's blocks before its first step; the request computes
only the rest of its prompt. A pull not done within `timeout_s` (producer dead, lease gone)
counts as no match: the prompt is recomputed. Same API on CPU and GPU (device to device).
Extra config: host (127.0.0.1), port (0: any), lease_s (60), timeout_s (10); the transport:
num_connections (socket connections used in parallel for one pull), transfer_size_mib (the
bounce buffers' slab size), parallel_copies (device<->host copies in flight), pinned_buffers
(page-locked receive buffers); both sides of a pair should use the same.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from jaxllm.kv_transfer.base import ConnectorContext, KVConnectorBase
from jaxllm.kv_transfer.config import KVTransferConfig

log = logging.getLogger("jaxllm")
CHUNK = 16  # blocks per transferred array (KVOps' gather size)


@dataclasses.dataclass
class TransferMeta:
    exports: list[tuple[int, list[int]]]  # (uuid, device blocks) to offer for a pull
    loads: list[tuple[list, int, list[int]]]  # (pulled chunks, first block index, device blocks)


# key: (type, lowest, highest, default); on an H200 8 connections pulled 12.4 GB/s, 1 only 3.3
TRANSPORT = {"num_connections": (int, 1, 64, 8), "transfer_size_mib": (int, 1, 4096, 256),
             "parallel_copies": (int, 1, 64, 8), "pinned_buffers": (bool, None, None, False)}


def transport_options(extra: dict) -> dict:
    """`start_transfer_server` keyword arguments from the extra config; bad values name the key."""
    out = {}
    for k, (typ, lo, hi, default) in TRANSPORT.items():
        v = extra.get(k, default)
        if typ is bool:
            if not isinstance(v, bool):
                raise ValueError(f"kv_connector_extra_config.{k} must be true or false, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"kv_connector_extra_config.{k} must be an integer in [{lo}, {hi}], got {v!r}")
        out[k] = v
    return {"num_connections": out["num_connections"], "transfer_size": out["transfer_size_mib"] << 20,
            "max_num_parallel_copies": out["parallel_copies"], "supports_pinned_allocator": out["pinned_buffers"]}


class JaxTransferConnector(KVConnectorBase):
    def __init__(self, cfg: KVTransferConfig, ctx: ConnectorContext):
        super().__init__(cfg, ctx)
        import jax
        from jax.experimental import transfer
        extra = cfg.kv_connector_extra_config
        host = extra.get("host", "127.0.0.1")
        self.lease_s = float(extra.get("lease_s", 60))
        self.timeout_s = float(extra.get("timeout_s", 10))
        self._device = jax.devices()[0]
        t = transport_options(extra)
        self.server = transfer.start_transfer_server(
            self._device.client, f"{host}:{int(extra.get('port', 0))}", [f"{host}:0"] * t.pop("num_connections"), **t)
        self.address = self.server.address()
        self._lock = threading.Lock()
        self._exports: list[tuple[int, list[int]]] = []
        self._loads: list[tuple[list, int, list[int]]] = []
        self._conns: dict[str, object] = {}  # producer address -> TransferConnection
        self._fetching: set[str] = set()
        self._fetched: dict[str, tuple[list, int]] = {}  # request -> (pulled chunks, blocks)
        self._tried: set[str] = set()
        self._ready: set[str] = set()
        self._gone: set[str] = set()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="jaxllm-kv-pull")
        self.n = {"kv_transfer_exports": 0, "kv_transfer_pulls": 0, "kv_transfer_failures": 0,
                  "kv_transfer_pull_bytes": 0, "kv_transfer_pull_seconds": 0.0}
        self.queries = self.hits = 0
        log.info("KV transfer server (%s) at %s", cfg.kv_role, self.address)

    # -- scheduler side -----------------------------------------------------
    def _remote(self, req) -> dict | None:
        p = req.kv_transfer_params
        return p if self.cfg.is_consumer and p and p.get("do_remote_prefill") else None

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int):
        params, rid, S = self._remote(req), req.request_id, self.ctx.block_size
        if params is None:
            return 0, False
        with self._lock:
            if rid in self._fetching:
                return None, False
            if rid not in self._tried:
                self._fetching.add(rid)
                self._pool.submit(self._pull, rid, params)
                return None, False
            got = self._fetched.get(rid)
        if got is None:
            return 0, False
        n = min(got[1], (req.num_tokens - 1) // S)
        return max(0, n - num_computed_tokens // S) * S, False

    def _connection(self, addr: str):
        """One connection per producer, kept: connecting sets up every socket of the transport."""
        with self._lock:
            conn = self._conns.get(addr)
        if conn is None:
            conn = self.server.connect(addr)
            with self._lock:
                conn = self._conns.setdefault(addr, conn)
        return conn

    def _pull(self, rid: str, params: dict) -> None:
        """Background: pull the producer's copies; give up after timeout_s."""
        import jax
        t0 = time.perf_counter()
        out = None
        try:
            n = int(params["remote_num_blocks"])
            if params.get("remote_fingerprint") not in (None, self.ctx.fingerprint):
                raise ValueError("the producer serves another model or KV layout")
            if n > 0:
                sharding = (getattr(self.ctx.mover, "chunk_sharding", None)  # over a mesh: by KV head
                            or jax.sharding.SingleDeviceSharding(self._device))
                spec = jax.ShapeDtypeStruct((CHUNK, *self.ctx.block_shape), self.ctx.dtype, sharding=sharding)
                addr = params["remote_address"]
                try:
                    chunks = self._connection(addr).pull(int(params["remote_uuid"]), [spec] * -(-n // CHUNK))
                    deadline = time.monotonic() + self.timeout_s
                    while not all(c.is_ready() for c in chunks):
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"no KV from {addr} within {self.timeout_s}s")
                        time.sleep(0.002)
                    jax.block_until_ready(chunks)  # a pull cut short is ready with an error: raises here
                except Exception:
                    with self._lock:  # a dead or restarted producer: connect afresh next time
                        self._conns.pop(addr, None)
                    raise
                out = (chunks, n)
                self.n["kv_transfer_pulls"] += 1
                self.n["kv_transfer_pull_bytes"] += n * self.ctx.block_bytes
                self.n["kv_transfer_pull_seconds"] += time.perf_counter() - t0
        except Exception as e:
            self.n["kv_transfer_failures"] += 1
            log.warning("KV transfer for request %s failed (%s: %s); recomputing its prompt", rid,
                        type(e).__name__, e)
        with self._lock:
            self._fetching.discard(rid)
            if rid in self._gone:
                self._gone.discard(rid)
                return
            self._tried.add(rid)
            if out is not None:
                self._fetched[rid] = out
            self._ready.add(rid)
        self.notify_progress()

    def update_state_after_alloc(self, req, block_ids, num_external_tokens):
        if self._remote(req) is None:
            return
        rid, S = req.request_id, self.ctx.block_size
        with self._lock:
            got = self._fetched.pop(rid, None)
        if num_external_tokens > 0 and got is not None:
            start = req.num_computed_tokens // S
            n = num_external_tokens // S
            self._loads.append((got[0], start, block_ids[start:start + n]))
        if req.num_preemptions == 0:
            self.queries += req.num_tokens
            self.hits += num_external_tokens

    def build_connector_meta(self):
        if not self._exports and not self._loads:
            return None
        meta = TransferMeta(self._exports, self._loads)
        self._exports, self._loads = [], []
        return meta

    def request_finished(self, req, block_ids):
        rid = req.request_id
        with self._lock:
            self._fetched.pop(rid, None)
            self._tried.discard(rid)
            self._ready.discard(rid)
            if rid in self._fetching:
                self._gone.add(rid)
        p = req.kv_transfer_params or {}
        if not (self.cfg.is_producer and p.get("do_remote_decode")):
            return False, None
        S = self.ctx.block_size
        n = min(min(req.num_computed_tokens, req.num_prompt_tokens) // S, len(block_ids))
        uuid = secrets.randbits(62)
        if n:
            self._exports.append((uuid, list(block_ids[:n])))
            self.n["kv_transfer_exports"] += 1
        return False, {"do_remote_prefill": True, "do_remote_decode": False, "remote_address": self.address,
                       "remote_uuid": uuid, "remote_num_blocks": n, "remote_block_size": S,
                       "remote_fingerprint": self.ctx.fingerprint}

    def get_finished(self):
        self._progress.clear()
        with self._lock:
            ready, self._ready = self._ready, set()
        return set(), ready

    # -- worker side --------------------------------------------------------
    def save_kv_layer(self, layer_name, pages, meta):
        """Copy exported blocks (device to device) and offer them for one pull."""
        if not meta or not meta.exports:
            return
        mover = self.ctx.mover
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.lease_s)
        for uuid, ids in meta.exports:
            chunks = [mover.gather_chunk(pages, ids[i:i + CHUNK]) for i in range(0, len(ids), CHUNK)]
            self.server.await_pull(uuid, chunks, timeout=deadline)

    def start_load_kv(self, pages, meta):
        if not meta or not meta.loads:
            return pages
        mover = self.ctx.mover
        for chunks, start, ids in meta.loads:
            for c, chunk in enumerate(chunks):
                lo = c * CHUNK  # chunk c holds blocks [lo, lo + CHUNK) of the prompt
                dst = [ids[j - start] if start <= j < start + len(ids) else None
                       for j in range(lo, lo + CHUNK)]
                if any(d is not None for d in dst):
                    pages = mover.scatter_chunk(pages, chunk, dst)
        return pages

    # -- both ---------------------------------------------------------------
    def stats(self) -> dict:
        return {"external_prefix_cache_queries": self.queries, "external_prefix_cache_hits": self.hits,
                **self.n}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
