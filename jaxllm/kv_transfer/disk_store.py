"""Disk (or object-store) tier through fsspec: one file per block, checksummed, atomic.

A file `<key hex>.kv` under `<url>/<fingerprint>/` is a 65-byte header (magic, block key,
parent key, payload length, BLAKE2b-128 over header and payload) and the block's raw
bytes. Writes go to a temporary name and are renamed into place, so a crash leaves
either the old state or the whole block; they run on a background thread (write-through
from the host tier). At start-up the index is rebuilt from the headers; files that are
short, zero length or of another layout are removed. A read whose checksum fails drops
the block and its descendants (their prefix is no longer reachable) and reports a miss,
so the prompt is recomputed. The first write error (disk full, unwritable directory)
stops offloading to this tier with one log line; serving goes on without it.
The tier is bounded in bytes, least recently used files removed first.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict

import fsspec
import numpy as np

log = logging.getLogger("jaxllm")

MAGIC = b"JXKVBLK1"
_HEAD = struct.Struct("<8s16sB16sQ")  # magic, key, has parent, parent, payload length
HEADER_BYTES = _HEAD.size + 16


def _k(x: int | None) -> bytes:
    return (x or 0).to_bytes(16, "little")


def encode(key: int, parent: int | None, payload: bytes) -> bytes:
    head = _HEAD.pack(MAGIC, _k(key), parent is not None, _k(parent), len(payload))
    return head + hashlib.blake2b(head + payload, digest_size=16).digest() + payload


def decode_header(data: bytes) -> tuple[int, int | None, int] | None:
    """(key, parent, payload length) of a well-formed header, else None."""
    if len(data) < HEADER_BYTES:
        return None
    magic, key, has_parent, parent, n = _HEAD.unpack_from(data)
    if magic != MAGIC:
        return None
    return (int.from_bytes(key, "little"), int.from_bytes(parent, "little") if has_parent else None, n)


class DiskStore:
    def __init__(self, url: str, capacity_bytes: int | None, fingerprint: str, block_bytes: int,
                 block_shape: tuple[int, ...], dtype):
        self.url = url
        self.capacity = capacity_bytes
        self.block_bytes = block_bytes
        self.block_shape, self.dtype = tuple(block_shape), np.dtype(dtype)
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/") + "/" + fingerprint
        self._index: OrderedDict[int, tuple[int | None, int]] = OrderedDict()  # key -> (parent, bytes)
        self._children: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self.failed: str | None = None
        self.nbytes = 0
        self.num_corrupt = 0
        self.num_dropped_at_start = 0
        self.bytes_written = self.bytes_read = 0
        self.seconds_written = self.seconds_read = 0.0
        self.removed: list[int] = []  # keys dropped since the last take_removed()
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self._rebuild()
        except OSError as e:
            self._fail(e)
        self._thread = threading.Thread(target=self._writer, name="jaxllm-kv-disk", daemon=True)
        self._thread.start()

    # -- index ----------------------------------------------------------------
    def _path(self, key: int) -> str:
        return f"{self.root}/{key:032x}.kv"

    def _rebuild(self) -> None:
        entries = []
        for info in self.fs.ls(self.root, detail=True):
            path, size = info["name"], info.get("size", 0)
            name = path.rsplit("/", 1)[-1]
            if not name.endswith(".kv"):  # a temporary file a crash left behind
                self._remove_file(path)
                continue
            head = None
            if size == HEADER_BYTES + self.block_bytes:
                with self.fs.open(path, "rb") as f:
                    head = decode_header(f.read(HEADER_BYTES))
            if head is None or f"{head[0]:032x}.kv" != name or head[2] != self.block_bytes:
                self._remove_file(path)
                self.num_dropped_at_start += 1
                continue
            mtime = info.get("mtime") or info.get("created") or 0
            entries.append((float(mtime.timestamp() if hasattr(mtime, "timestamp") else mtime), head))
        for _, (key, parent, _n) in sorted(entries, key=lambda e: e[0]):
            self._add(key, parent)
        if self._index or self.num_dropped_at_start:
            log.info("KV disk tier %s: %d blocks found, %d unreadable files removed", self.url,
                     len(self._index), self.num_dropped_at_start)

    def _add(self, key: int, parent: int | None) -> None:
        size = HEADER_BYTES + self.block_bytes
        self._index[key] = (parent, size)
        self.nbytes += size
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)

    def _forget(self, key: int) -> None:
        parent, size = self._index.pop(key)
        self.nbytes -= size
        if parent is not None and parent in self._children:
            self._children[parent].discard(key)
        self.removed.append(key)

    def _remove_file(self, path: str) -> None:
        try:
            self.fs.rm(path)
        except (OSError, FileNotFoundError):
            pass

    def __contains__(self, key: int) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def take_removed(self) -> list[int]:
        with self._lock:
            out, self.removed = self.removed, []
        return out

    # -- writes ---------------------------------------------------------------
    def write_async(self, key: int, parent: int | None, block: np.ndarray) -> None:
        if self.failed is None and key not in self._index:
            self._q.put((key, parent, block))

    def flush(self) -> None:
        """Wait for the queued writes (tests, shutdown)."""
        self._q.join()

    def _fail(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("KV disk tier %s stopped (%s); serving continues without it", self.url, self.failed)

    def _writer(self) -> None:
        while True:
            key, parent, block = self._q.get()
            try:
                if self.failed is None and key not in self._index:
                    self._write(key, parent, block)
            except Exception as e:  # disk full, permission, network store: stop this tier
                self._fail(e)
            finally:
                self._q.task_done()

    def _write(self, key: int, parent: int | None, block: np.ndarray) -> None:
        t0 = time.perf_counter()
        size = HEADER_BYTES + self.block_bytes
        if self.capacity is not None and size > self.capacity:
            raise OSError(28, f"a block of {size} bytes exceeds kv_offload_disk_gib")
        with self._lock:
            victims = []
            while self.capacity is not None and self.nbytes + size > self.capacity and self._index:
                victim = next(iter(self._index))
                self._forget(victim)
                victims.append(victim)
        for v in victims:
            self._remove_file(self._path(v))
        data = encode(key, parent, np.ascontiguousarray(block).tobytes())
        final = self._path(key)
        tmp = f"{self.root}/.tmp-{key:032x}-{threading.get_ident()}"
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, final)
        except BaseException:
            self._remove_file(tmp)
            raise
        with self._lock:
            self._add(key, parent)
            self.bytes_written += len(data)
            self.seconds_written += time.perf_counter() - t0

    # -- reads ----------------------------------------------------------------
    def read(self, key: int) -> np.ndarray | None:
        """The block, checksum verified; None (and the block and its descendants
        dropped) if the file is missing, short or corrupt."""
        t0 = time.perf_counter()
        try:
            with self.fs.open(self._path(key), "rb") as f:
                data = f.read()
        except (OSError, FileNotFoundError) as e:
            log.warning("KV disk tier: block %032x unreadable (%s); recomputing", key, e)
            self.drop_tree(key)
            return None
        head = decode_header(data)
        ok = (head is not None and head[0] == key and head[2] == self.block_bytes
              and len(data) == HEADER_BYTES + self.block_bytes
              and hashlib.blake2b(data[:_HEAD.size] + data[HEADER_BYTES:], digest_size=16).digest()
              == data[_HEAD.size:HEADER_BYTES])
        if not ok:
            self.num_corrupt += 1
            log.warning("KV disk tier: block %032x failed its checksum; dropped with its descendants, "
                        "recomputing", key)
            self.drop_tree(key)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.bytes_read += len(data)
            self.seconds_read += time.perf_counter() - t0
        return np.frombuffer(data, self.dtype, offset=HEADER_BYTES).reshape(self.block_shape)

    def drop_tree(self, key: int) -> None:
        """Remove a block and every block whose prefix runs through it."""
        todo, gone = [key], []
        with self._lock:
            while todo:
                k = todo.pop()
                todo.extend(self._children.pop(k, ()))
                if k in self._index:
                    self._forget(k)
                gone.append(k)
        for k in gone:
            self._remove_file(self._path(k))
