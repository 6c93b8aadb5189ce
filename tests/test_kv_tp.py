"""KV connectors with tensor parallelism (tp=2 over forced host devices, in a subprocess:
tests/kv_tp_worker.py): host and disk tiers and P/D transfer give tp=1's output, each device
saving and loading its own KV heads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(HERE, "kv_tp_worker.py"),
                          str(tmp_path_factory.mktemp("kvtp"))], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_offload_tiers_at_tp2_match_tp1(res):
    one, two = res["tp1"], res["tp2"]
    assert two["kv_pages_shards"] == [[2, 2, 1, 24, 16, 16]] * 2  # one KV head per device
    assert two["put_shards"] == [[2, 2, 1, 16, 16]] * 2  # a loaded block goes straight to its heads
    for run in (one, two):
        assert run["again"] == run["first"] and run["cached"] == 288
        assert run["external_hits"] > 0 and run["cpu_load_bytes"] > 0
        assert run["device_is_host"] and run["free"] and run["pins"] == 0
    assert two["first"] == one["first"]
    # Each device saved its heads; the host tier holds whole blocks, equal to tp=1's
    # (up to the all-reduce's float32 summation order in layer 2).
    assert res["block_shape"] == [2, 2, 2, 16, 16] and res["host_blocks_max_diff"] < 1e-4


def test_tp2_restarts_on_tp1_disk_and_pd_at_tp2(res):
    r = res["restart_tp2_from_tp1"]
    assert r["tokens"] == res["tp1"]["first"] and r["cached"] == 288
    assert r["disk_load_bytes"] > 0 and r["device_is_host"] and r["free"]
    pd = res["pd_tp2"]
    assert "error" not in pd, pd.get("error")
    assert pd["tokens"] == res["tp1"]["first"] and pd["cached"] == 288
    assert pd["pulls"] == 1 and pd["free"]
