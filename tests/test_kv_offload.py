"""Offload tiers end to end on a tiny model: host tier, disk tier, restart, corruption, full disk.

The device pool holds one long sequence, so each new 300-token prompt evicts the one
before; a prompt that comes back must be served from the host tier, or from disk once
the host tier is full, with the greedy tokens of an engine without offload.
"""

import logging
import os

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from kv_tiny import GREEDY, gib, make, rand, run1

from jaxllm.kv_transfer.disk_store import HEADER_BYTES, DiskStore
from jaxllm.runtime.kv_cache_manager import block_hash

A, B, C, D = (rand(300, s) for s in (1, 2, 3, 4))


@pytest.fixture(scope="module")
def want():
    ref = make(enable_prefix_caching=False)
    return {k: run1(ref, p).outputs[0].token_ids for k, p in dict(A=A, B=B, C=C, D=D).items()}


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kvdisk"))


@pytest.fixture(scope="module")
def tiered(disk_dir):
    # Host tier of 48 blocks: A and B fit (19 full blocks each), A, B, C and D do not.
    return make(kv_offload_cpu_gib=gib(48), kv_offload_disk_dir=disk_dir)


def conn(llm):
    return llm.engine.connector


def test_host_then_disk_tier(tiered, want):
    st = tiered.stats
    assert run1(tiered, A).outputs[0].token_ids == want["A"]
    assert run1(tiered, B).outputs[0].token_ids == want["B"]  # evicts A from the device
    s0 = st()
    out = run1(tiered, A)  # from the host tier
    s1 = st()
    assert out.outputs[0].token_ids == want["A"]
    assert out.num_cached_tokens == 288  # 18 full blocks short of the prompt's last token
    ext = lambda a, b: b["external_prefix_cache_hits"] - a["external_prefix_cache_hits"]
    dev = lambda a, b: b["prefix_cache_hits"] - a["prefix_cache_hits"]
    assert ext(s0, s1) >= 160 and ext(s0, s1) + dev(s0, s1) == 288  # B left A's head on the device
    assert s1["external_prefix_cache_queries"] - s0["external_prefix_cache_queries"] == 300
    assert s1["kv_offload_cpu_load_bytes"] > s0["kv_offload_cpu_load_bytes"]
    assert s1["kv_offload_disk_load_bytes"] == 0
    for p in (C, D):  # the host tier overflows: A leaves it, the disk keeps it
        run1(tiered, p)
    tiered.engine.flush_kv()
    keys = keys_of(A, 18)
    assert not all(k in conn(tiered).host for k in keys) and all(k in conn(tiered).disk for k in keys)
    out = run1(tiered, A)  # from disk, through the host tier
    s2 = st()
    assert out.outputs[0].token_ids == want["A"] and out.num_cached_tokens == 288
    assert s2["kv_offload_disk_load_bytes"] >= conn(tiered).ctx.block_bytes
    assert ext(s1, s2) >= 160 and ext(s1, s2) + dev(s1, s2) == 288
    assert s2["kv_offload_cpu_blocks"] <= 48 and s2["kv_offload_disk_blocks"] >= 4 * 19
    assert tiered.engine.kv.host.num_blocks == 0 and not conn(tiered).host.num_pinned
    assert tiered.engine.kv_ops.num_compiled() == tiered.kv_compiled  # no new variant since warm-up
    assert tiered.engine.kv.num_free_blocks == tiered.engine.runner.num_blocks  # nothing leaked
    tiered.engine.flush_kv()  # every save landed: the figures below are final
    check_offload_metrics(tiered.stats(), conn(tiered).ctx.block_bytes)


def check_offload_metrics(st: dict, block_bytes: int) -> None:
    """/metrics' offload series, read back from the exposition text: present, equal to the
    engine's stats, and sensible after a run that saved to both tiers and loaded from both."""
    from prometheus_client.parser import text_string_to_metric_families

    from jaxllm.server.metrics import ServerMetrics
    text = ServerMetrics("m").render(st).decode()
    got = {(smp.name, tuple(sorted((k, v) for k, v in smp.labels.items() if k != "model_name"))): smp.value
           for fam in text_string_to_metric_families(text) for smp in fam.samples
           if smp.labels.get("model_name") == "m"}
    queries = got[("jaxllm:external_prefix_cache_queries", ())]
    hits = got[("jaxllm:external_prefix_cache_hits", ())]
    assert (queries, hits) == (st["external_prefix_cache_queries"], st["external_prefix_cache_hits"])
    assert queries >= hits > 0
    for tier in ("cpu", "disk"):
        for d in ("load", "save"):
            labels = (("direction", d), ("tier", tier))
            nbytes, secs = got[("jaxllm:kv_offload_bytes", labels)], got[("jaxllm:kv_offload_seconds", labels)]
            assert nbytes == st[f"kv_offload_{tier}_{d}_bytes"] and secs == st[f"kv_offload_{tier}_{d}_seconds"]
            assert nbytes >= block_bytes and secs > 0, (tier, d, nbytes, secs)
        used = got[("jaxllm:kv_offload_store_bytes", (("tier", tier),))]
        blocks = got[("jaxllm:kv_offload_store_blocks", (("tier", tier),))]
        assert (used, blocks) == (st[f"kv_offload_{tier}_bytes"], st[f"kv_offload_{tier}_blocks"])
        assert blocks > 0 and used >= blocks * block_bytes
        assert used <= got[("jaxllm:kv_offload_bytes", (("direction", "save"), ("tier", tier)))]  # saved first
    assert got[("jaxllm:kv_offload_store_bytes", (("tier", "cpu"),))] <= st["kv_offload_cpu_capacity_bytes"]
    # The disk tier is unbounded here: every block written is still held, header and all.
    assert got[("jaxllm:kv_offload_store_bytes", (("tier", "disk"),))] == (
        got[("jaxllm:kv_offload_store_blocks", (("tier", "disk"),))] * (HEADER_BYTES + block_bytes))


@pytest.mark.parametrize("pin", [True, False])
def test_host_tier_blocks_in_pinned_memory(want, pin):
    """Where the device has JAX's pinned_host memory (the CPU backend has it too), the host
    tier keeps each saved block there, so a load is a DMA from page-locked memory; with
    `pin_host_memory: false` blocks stay numpy. Both serve the same greedy tokens, compile
    nothing after warm-up and leak no block."""
    import jax
    llm = make(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"cpu_gib": gib(48), "pin_host_memory": pin}})
    c = conn(llm)
    assert c.pinned() is pin and c.ctx.mover.pinned_sharding is not None
    for name, p in (("A", A), ("B", B)):
        assert run1(llm, p).outputs[0].token_ids == want[name]
    llm.engine.flush_kv()
    blocks = [c.host.get(k) for k in keys_of(A, 18)]
    assert all(b is not None for b in blocks)
    if pin:  # rows of pinned 16-block chunks (a save's chunks are full but for its last one)
        from jaxllm.engine.kv_ops import ChunkRow
        arrays = [b.chunk if isinstance(b, ChunkRow) else b for b in blocks]
        assert all(isinstance(a, jax.Array) and a.sharding.memory_kind == "pinned_host" for a in arrays)
        assert isinstance(blocks[0], ChunkRow) and blocks[0].chunk is blocks[15].chunk
        assert np.array_equal(blocks[3].numpy(), np.asarray(blocks[3].chunk)[3])
        assert blocks[0].rows_used == 16 and blocks[0].nbytes == c.ctx.block_bytes
        # A's last save is 3 blocks: less than half a chunk, so one pinned array each
        assert isinstance(blocks[16], jax.Array) and blocks[16].sharding.memory_kind == "pinned_host"
        ops = llm.engine.kv_ops  # a chunk at least half full stays whole; its rows share its bytes
        rows = ops.pin_chunk(ops.gather_chunk(llm.engine.runner.kv_pages, list(range(10))), 10)
        assert [r.row for r in rows] == list(range(10)) and all(r.rows_used == 10 for r in rows)
        assert 0 <= rows[0].chunk.nbytes - 10 * rows[0].nbytes < 10  # (bytes per row rounded down)
    else:
        assert all(isinstance(b, np.ndarray) for b in blocks)
    s0 = llm.stats()
    out = run1(llm, A)  # its tail from the host tier
    assert out.outputs[0].token_ids == want["A"] and out.num_cached_tokens == 288
    assert llm.stats()["external_prefix_cache_hits"] - s0["external_prefix_cache_hits"] >= 160
    assert llm.engine.kv_ops.num_compiled() == llm.kv_compiled  # no new variant since warm-up
    llm.engine.flush_kv()
    assert llm.engine.kv.num_free_blocks == llm.engine.runner.num_blocks and not c.host.num_pinned


def keys_of(prompt, n):
    """The block keys of a prompt's first n full blocks (the prefix-cache hashes)."""
    out = []
    for i in range(n):
        out.append(block_hash(out[-1] if out else None, prompt[i * 16:(i + 1) * 16], None))
    return out


def _block_files(d):
    (sub,) = [os.path.join(d, x) for x in os.listdir(d)]
    return sub, sorted(os.path.join(sub, f) for f in os.listdir(sub))


# A restarted server: a new process builds the same engine over the disk directory, reports C
# (from disk alone), waits for the test to corrupt files, then reports B, D and A.
RESTART = r"""
import json, sys
from kv_tiny import gib, make, rand, run1
A, B, C, D = (rand(300, s) for s in (1, 2, 3, 4))
llm = make(kv_offload_cpu_gib=gib(48), kv_offload_disk_dir=sys.argv[1])
def run(name, p):
    s0 = llm.stats()
    out = run1(llm, p)
    s1 = llm.stats()
    d = lambda k: s1[k] - s0[k]
    return {"name": name, "tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
            "external": d("external_prefix_cache_hits"), "disk_load_bytes": d("kv_offload_disk_load_bytes")}
print("RESULT " + json.dumps({"pid": __import__("os").getpid(), "blocks_at_start": len(llm.engine.connector.disk),
                              **run("C", C)}), flush=True)
sys.stdin.readline()  # the test corrupts files meanwhile
runs = [run(name, p) for name, p in (("B", B), ("D", D), ("A", A))]
llm.engine.flush_kv()
print("RESULT " + json.dumps({"runs": runs, "corrupt": llm.stats()["kv_offload_disk_corrupt_blocks"]}), flush=True)
"""


def test_restart_serves_from_disk_and_corruption_recomputes(tmp_path, want):
    """A server fills its own disk directory; a new process over it serves C from disk alone
    (the greedy tokens of an engine without offload), and after three files are corrupted
    recomputes from the bad block on, writing the blocks again, whole."""
    import json
    import queue
    import subprocess
    import sys
    import threading

    d = str(tmp_path / "kv")
    first = make(kv_offload_cpu_gib=gib(48), kv_offload_disk_dir=d)
    for name, p in (("A", A), ("B", B), ("C", C), ("D", D)):  # each evicts the one before
        assert run1(first, p).outputs[0].token_ids == want[name]
    first.engine.flush_kv()
    disk = conn(first).disk
    assert all(k in disk for p in (A, B, C, D) for k in keys_of(p, 18))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-c", RESTART, d], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()

    def result() -> dict:
        while True:
            try:
                line = lines.get(timeout=300)
            except queue.Empty:
                line = None
            if line is None:
                err.seek(0)
                raise AssertionError(f"the restarted process gave no result (rc {proc.poll()}):\n{err.read()[-3000:]}")
            if line.startswith("RESULT "):
                return json.loads(line[7:])

    try:
        c = result()
        assert c["pid"] != os.getpid() and c["blocks_at_start"] == len(disk)  # its index, from the files
        assert c["tokens"] == want["C"] and c["cached"] == 288  # a new process: only the files can hold C
        assert c["external"] == 288 and c["disk_load_bytes"] >= 18 * conn(first).ctx.block_bytes
        # Corrupt B's first block (flipped bytes), D's first (truncated) and A's third (empty).
        kb, kd, ka = keys_of(B, 1)[0], keys_of(D, 1)[0], keys_of(A, 3)[2]
        with open(disk._path(kb), "r+b") as f:
            f.seek(HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with open(disk._path(kd), "r+b") as f:
            f.truncate(HEADER_BYTES + 10)
        open(disk._path(ka), "wb").close()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        r = result()
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err.close()
    assert [x["name"] for x in r["runs"]] == ["B", "D", "A"]
    for x, hit in zip(r["runs"], (0, 0, 32)):
        assert x["tokens"] == want[x["name"]], x["name"]
        assert x["cached"] == x["external"] == hit, x  # the prefix before the bad block still loads
    assert r["corrupt"] == 3
    # Each bad block went with its descendants; the recompute wrote them again, whole (a fresh
    # index over the files, every checksum verified).
    again = DiskStore(d, None, conn(first).ctx.fingerprint, disk.block_bytes, disk.block_shape, disk.dtype)
    assert again.num_dropped_at_start == 0
    assert all(again.read(k) is not None for k in [kb, kd, ka] + keys_of(B, 18) + keys_of(D, 18) + keys_of(A, 18))
    assert again.num_corrupt == 0


def test_index_rebuilt_at_start_drops_bad_files(tmp_path):
    shape, dtype = (2, 2, 2, 16, 16), "float32"
    nbytes = 2 * 2 * 2 * 16 * 16 * 4
    import numpy as np
    s = DiskStore(str(tmp_path), None, "fp", nbytes, shape, dtype)
    blocks = {k: np.full(shape, k, np.float32) for k in (1, 2, 3, 4)}
    for k, b in blocks.items():
        s.write_async(k, k - 1 if k > 1 else None, b)
    s.flush()
    with open(s._path(2), "r+b") as f:
        f.truncate(50)
    open(s._path(3), "wb").close()
    open(f"{s.root}/.tmp-dead", "wb").write(b"partial")
    s2 = DiskStore(str(tmp_path), None, "fp", nbytes, shape, dtype)
    assert 1 in s2 and 4 in s2 and 2 not in s2 and 3 not in s2
    assert s2.num_dropped_at_start == 2 and not os.path.exists(f"{s.root}/.tmp-dead")
    assert (s2.read(4) == 4).all()
    other = DiskStore(str(tmp_path), None, "another-model", nbytes, shape, dtype)
    assert len(other) == 0  # blocks of another model or layout are never seen
    for k, parent in ((10, None), (11, 10), (12, 11), (13, 10), (14, None)):
        s2.write_async(k, parent, blocks[1])
    s2.flush()
    s2.drop_tree(10)  # its descendants (11, 12, 13) go too
    assert [k for k in (1, 4, 10, 11, 12, 13, 14) if k in s2] == [1, 4, 14]
    assert not os.path.exists(s2._path(12))


class FullFS(MemoryFileSystem):
    """A memory filesystem that runs out of space after a few files."""

    protocol = "fullfs"
    budget = 5

    def _open(self, path, mode="rb", **kw):
        if "w" in mode:
            if FullFS.budget <= 0:
                raise OSError(28, "No space left on device")
            FullFS.budget -= 1
        return super()._open(path, mode, **kw)


def test_full_disk_and_unwritable_dir_keep_serving(tmp_path, want, caplog):
    fsspec.register_implementation("fullfs", FullFS, clobber=True)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        # A host tier that holds A and B (38 blocks): the third A is a host hit whatever the disk does.
        full = make(kv_offload_cpu_gib=gib(48), kv_offload_disk_dir="fullfs://kv")
        bad = make(kv_offload_cpu_gib=gib(48), kv_offload_disk_dir=str(blocker / "kv"))
        for llm in (full, bad):
            for name, p in (("A", A), ("B", B), ("A", A)):
                assert run1(llm, p).outputs[0].token_ids == want[name]
                llm.engine.flush_kv()  # each run's saves done before the next looks: no race with them
            st = llm.stats()
            assert st["kv_offload_disk_failed"] and st["external_prefix_cache_hits"] > 0  # host tier
    stops = [r for r in caplog.records if "stopped" in r.getMessage()]
    assert len(stops) == 2  # one line per tier that stopped
    assert len(conn(full).disk) == 5


def test_multi_connector_two_tiers_and_producer(want):
    """A host tier that loads and saves, plus a save-only (producer) disk tier on fsspec's
    memory filesystem; a second engine reads that disk tier back as a consumer."""
    fs = fsspec.filesystem("memory")
    fs.rm("/kvmulti", recursive=True) if fs.exists("/kvmulti") else None
    tier = lambda role, extra: {"kv_connector": "OffloadingConnector", "kv_role": role,
                                "kv_connector_extra_config": extra}
    cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [tier("kv_both", {"cpu_gib": gib(48)}),
                       tier("kv_producer", {"disk_dir": "memory://kvmulti"})]}}
    multi = make(kv_transfer_config=cfg)
    for name, p in (("A", A), ("B", B), ("A", A), ("C", C), ("D", D)):
        assert run1(multi, p).outputs[0].token_ids == want[name]
        multi.engine.flush_kv()  # (its saves done: the host tier holds A and B when A is back)
    st = multi.stats()
    assert st["external_prefix_cache_hits"] > 0  # A, from the host tier
    multi.engine.flush_kv()
    assert st["kv_offload_disk_load_bytes"] == 0  # the producer tier never loads
    consumer = make(kv_transfer_config=tier("kv_consumer", {"disk_dir": "memory://kvmulti"}))
    out = run1(consumer, B)
    assert out.outputs[0].token_ids == want["B"] and out.num_cached_tokens == 288
    assert len(consumer.engine.connector.disk) >= 4 * 19  # consumers store nothing themselves


def test_config_errors():
    from jaxllm.config import EngineConfig
    with pytest.raises(ValueError, match="kv_role"):
        EngineConfig(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "x"})
    with pytest.raises(ValueError, match="kv_offload_cpu_gib"):
        EngineConfig(kv_offload_cpu_gib=-1)
    with pytest.raises(ValueError, match="kv_events_config"):
        EngineConfig(kv_events_config={"publisher": "kafka"})
    with pytest.raises(ValueError, match="kv_connector"):
        make(kv_transfer_config={"kv_connector": "NoSuchConnector"})


def test_kv_flags_parse_and_reach_the_engine(tmp_path, monkeypatch, capsys):
    """`jaxllm serve --kv-transfer-config JSON --kv-offload-cpu-gib G --kv-offload-disk-dir D
    --kv-offload-disk-gib G --kv-events-config JSON`, through the real `jaxllm` parser: the
    engine kwargs carry them, the engine built from them has that connector, those tiers and
    that publisher; a malformed value is an argparse error naming its flag."""
    import json
    import socket

    from jaxllm import cli
    from jaxllm.engine.arg_utils import engine_kwargs
    from jaxllm.kv_transfer.events import ZmqEventPublisher
    from jaxllm.server import args as serve_args

    seen = []
    monkeypatch.setattr(serve_args, "run_serve", lambda a: seen.append(a) or 0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        events_port = sock.getsockname()[1]
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"pin_host_memory": False, "load_async": False}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
              "topic": "kv"}
    disk_dir = str(tmp_path / "kv")
    assert cli.main(["serve", "--kv-transfer-config", json.dumps(transfer), "--kv-offload-cpu-gib", str(gib(48)),
                     "--kv-offload-disk-dir", disk_dir, "--kv-offload-disk-gib", "0.25",
                     "--kv-events-config", json.dumps(events)]) == 0
    kw = engine_kwargs(seen[0])
    flags = ("kv_transfer_config", "kv_offload_cpu_gib", "kv_offload_disk_dir", "kv_offload_disk_gib",
             "kv_events_config")
    assert {k: kw[k] for k in flags} == {"kv_transfer_config": transfer, "kv_offload_cpu_gib": gib(48),
                                         "kv_offload_disk_dir": disk_dir, "kv_offload_disk_gib": 0.25,
                                         "kv_events_config": events}
    # Left out, none of them reaches the engine (its config keeps its defaults: no connector).
    seen.clear()
    assert cli.main(["serve"]) == 0 and not set(flags) & set(engine_kwargs(seen[0]))
    llm = make(**{k: kw[k] for k in flags})
    try:
        cfg = llm.engine.cfg
        assert (cfg.kv_transfer_config, cfg.kv_offload_cpu_gib, cfg.kv_offload_disk_dir, cfg.kv_offload_disk_gib,
                cfg.kv_events_config) == tuple(kw[k] for k in flags)
        c = conn(llm)
        assert type(c).__name__ == "OffloadingConnector" and c.cfg.kv_role == "kv_both"
        assert c.pin_host_memory is False and c.load_async is False  # the extra config reached it
        assert c.host.capacity == int(gib(48) * (1 << 30))
        assert c.disk.url == disk_dir and c.disk.capacity == (1 << 30) // 4
        assert isinstance(llm.engine.kv_events, ZmqEventPublisher) and llm.engine.kv_events._topic == b"kv"
        p = rand(40, 11)
        assert len(run1(llm, p).outputs[0].token_ids) == GREEDY.max_tokens
        llm.engine.flush_kv()
        assert len(c.disk) == 2 and len(os.listdir(c.disk.root)) == 2  # its two full blocks, in that directory
    finally:
        llm.engine.kv_events.shutdown()
    for argv, flag, why in ((["--kv-transfer-config", '{"kv_connector": "OffloadingConnector",'],
                             "--kv-transfer-config", "not valid JSON"),
                            (["--kv-events-config", "{enable_kv_cache_events: true}"], "--kv-events-config",
                             "not valid JSON"),
                            (["--kv-transfer-config", '["OffloadingConnector"]'], "--kv-transfer-config",
                             "expected a JSON object"),
                            (["--kv-events-config", "true"], "--kv-events-config", "expected a JSON object"),
                            (["--kv-offload-cpu-gib", "lots"], "--kv-offload-cpu-gib", "invalid float value"),
                            (["--kv-offload-disk-gib", "1GiB"], "--kv-offload-disk-gib", "invalid float value")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", *argv])
        msg = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: {why}" in msg, (argv, msg)
    # Valid JSON with a bad field passes the parser; the engine config refuses it by name.
    seen.clear()
    cli.main(["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'])
    with pytest.raises(ValueError, match="kv_events_config.publisher"):
        make(kv_events_config=engine_kwargs(seen[0])["kv_events_config"])


def test_disk_tier_lru_bound(tmp_path):
    import numpy as np
    shape = (2, 2, 2, 16, 16)
    nbytes = int(np.prod(shape)) * 4
    cap = 3 * (HEADER_BYTES + nbytes)
    s = DiskStore(str(tmp_path), cap, "fp", nbytes, shape, "float32")
    for k in (1, 2, 3):
        s.write_async(k, None, np.full(shape, k, np.float32))
    s.flush()
    assert s.read(1) is not None  # 1 becomes the most recently used
    for k in (4, 5):
        s.write_async(k, None, np.full(shape, k, np.float32))
    s.flush()
    assert sorted(k for k in range(1, 6) if k in s) == [1, 4, 5] and s.nbytes <= cap
    assert sorted(os.listdir(s.root)) == sorted(f"{k:032x}.kv" for k in (1, 4, 5))
    assert s.failed is None  # evicting to stay under the bound is not a failure


def test_saves_start_few_copies_ahead():
    """Only `save_copies_ahead` chunks' device-to-host copies are started ahead of the saver
    (a load's copies must not queue behind a whole prompt's saves); every block still lands."""
    import threading

    import numpy as np

    from jaxllm.kv_transfer.base import ConnectorContext
    from jaxllm.kv_transfer.config import KVTransferConfig
    from jaxllm.kv_transfer.offload import OffloadingConnector, OffloadMeta

    shape, log = (1, 2, 1, 2, 2), []

    class Chunk:  # a gathered device chunk: its copy to the host, then its read
        def __init__(self, ids):
            self.ids = ids

        def copy_to_host_async(self):
            log.append(("copy", self.ids[0]))

        def __array__(self, dtype=None, copy=None):
            log.append(("read", self.ids[0]))
            return np.stack([np.full(shape, i, np.float32) for i in self.ids])

    class Mover:
        chunk = 2

        def gather_chunk(self, pages, ids):
            return Chunk(ids)

    cfg = KVTransferConfig.from_dict({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"cpu_gib": 0.001}})
    ctx = ConnectorContext(block_size=2, block_bytes=32, block_shape=shape, dtype="float32",
                           fingerprint="fp", mover=Mover())
    conn = OffloadingConnector(cfg, ctx)
    assert conn.save_copies_ahead == 2
    hold = threading.Event()
    conn._saver.submit(hold.wait)  # the saver is busy: nothing is read yet
    conn.save_kv_layer(None, None, OffloadMeta([], [(k, None, k) for k in range(1, 11)]))
    assert log == [("copy", 1), ("copy", 3)]
    hold.set()
    conn.flush()
    assert [i for op, i in log if op == "read"] == [1, 3, 5, 7, 9]
    for n in range(len(log)):  # at most the chunk being read and two more copying
        ops = [op for op, _ in log[:n + 1]]
        assert ops.count("copy") <= ops.count("read") + 3
    assert all(conn.host.get(k)[0, 0, 0, 0, 0] == k for k in range(1, 11))
    conn.shutdown()


def test_pinned_host_tier_starts_all_save_copies_at_once():
    """With a pinned host tier the default ("auto") starts every chunk's copy at once: bounded,
    an H200's dispatch thread waited in a device_put into pinned memory for the saver's other
    copies (restore 8.75x recomputing). Bad values are refused by name."""
    import threading

    import numpy as np
    import pytest

    from jaxllm.kv_transfer.base import ConnectorContext
    from jaxllm.kv_transfer.config import KVTransferConfig
    from jaxllm.kv_transfer.offload import OffloadingConnector, OffloadMeta

    shape, log = (1, 2, 1, 2, 2), []

    class Pinned:  # one pinned block of a chunk
        def __init__(self, i):
            self.value = np.full(shape, i, np.float32)
            self.nbytes = self.value.nbytes

        def block_until_ready(self):
            return self

    class Mover:
        chunk = 2
        pinned_sharding = object()  # the device has pinned host memory

        def gather_chunk(self, pages, ids):
            return ids

        def pin_chunk(self, ids, n):
            log.append(ids[0])
            return [Pinned(i) for i in ids[:n]]

    def make(extra):
        cfg = KVTransferConfig.from_dict({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                          "kv_connector_extra_config": {"cpu_gib": 0.001, **extra}})
        ctx = ConnectorContext(block_size=2, block_bytes=32, block_shape=shape, dtype="float32",
                               fingerprint="fp", mover=Mover())
        return OffloadingConnector(cfg, ctx)

    conn = make({})
    assert conn.save_copies_ahead is None
    hold = threading.Event()
    conn._saver.submit(hold.wait)  # the saver is busy: every copy was started by the dispatch call
    conn.save_kv_layer(None, None, OffloadMeta([], [(k, None, k) for k in range(1, 11)]))
    assert log == [1, 3, 5, 7, 9]
    hold.set()
    conn.flush()
    assert all(conn.host.get(k).value[0, 0, 0, 0, 0] == k for k in range(1, 11))
    conn.shutdown()
    assert make({"pin_host_memory": False}).save_copies_ahead == 2  # numpy tier: bounded
    assert make({"save_copies_ahead": 3}).save_copies_ahead == 3
    for bad in (-1, "two", 1.5, True):
        with pytest.raises(ValueError, match="kv_connector_extra_config.save_copies_ahead"):
            make({"save_copies_ahead": bad})
