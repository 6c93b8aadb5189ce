"""Tensor parallelism (issue 6): parity with tp=1, shard sizes, compiles, errors, multi-host.

Anything needing several devices runs in subprocesses with forced host devices
(tests/tp_worker.py, or the `jaxllm` CLI itself for the multi-process case): the
device count is fixed when jax starts, so this interpreter stays at one device.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxllm.models.config import ModelConfig
from jaxllm.parallel import head_layout

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
TIMEOUT = 600


def _env(devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return env


def _worker(which: str) -> dict:
    res = subprocess.run([PY, os.path.join(HERE, "tp_worker.py"), which], env=_env(8), cwd=ROOT,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny() -> dict:
    return _worker("tiny")


@pytest.fixture(scope="module")
def smollm2() -> dict:
    return _worker("smollm2")


def _cfg(heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig.from_hf(dict(vocab_size=64, hidden_size=heads * 8, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads))


# -- head layout (pure, no devices) -------------------------------------------------------------

@pytest.mark.parametrize("heads,kv,tp,stored", [(8, 8, 4, 8), (8, 2, 2, 2), (8, 2, 4, 4), (8, 2, 8, 8),
                                                (9, 3, 3, 3), (9, 3, 9, 9), (12, 6, 4, 12), (32, 8, 8, 8)])
def test_head_layout(heads, kv, tp, stored):
    lay = head_layout(_cfg(heads, kv), tp)
    assert lay.stored_kv_heads == stored and stored % tp == 0 and heads % stored == 0
    # Query head h reads stored head h // (H/K'), a copy of original head h // (H/K).
    for h in range(heads):
        assert (h // (heads // stored)) // lay.kv_repeat == h // (heads // kv)
        # ...and that stored head lives on the same device as the query head.
        assert (h // (heads // stored)) // lay.kv_heads_per_device == h // (heads // tp)


@pytest.mark.parametrize("tp", [3, 5, 16])
def test_tp_must_divide_heads(tp):
    with pytest.raises(ValueError, match="must divide the model's 8 attention heads"):
        head_layout(_cfg(8, 2), tp)


def test_engine_rejects_bad_tp_before_touching_devices():
    from tp_worker import tiny_model

    from jaxllm import LLM

    cfg, weights = tiny_model("llama", 8, 2)
    with pytest.raises(ValueError, match="must divide"):
        LLM(hf_config=cfg, weights=weights, tensor_parallel_size=3, max_model_len=64)
    with pytest.raises(ValueError, match="only 1 devices are visible"):
        LLM(hf_config=cfg, weights=weights, tensor_parallel_size=2, max_model_len=64)
    with pytest.raises(ValueError, match="distributed_coordinator"):
        LLM(hf_config=cfg, weights=weights, num_processes=2)


def test_cli_flags():
    import argparse

    from jaxllm.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--tensor-parallel-size", "4", "--distributed-coordinator",
                                     "127.0.0.1:1234", "--num-processes", "2", "--process-id", "1"]))
    assert kw["tensor_parallel_size"] == 4 and kw["num_processes"] == 2 and kw["process_id"] == 1
    assert kw["distributed_coordinator"] == "127.0.0.1:1234"
    assert engine_kwargs(p.parse_args(["-tp", "2"]))["tensor_parallel_size"] == 2


# -- forced host devices -------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["llama_8q8kv", "qwen2_8q2kv"])
def test_greedy_parity_tiny(tiny, model):
    ref = tiny[f"{model}_tp1"]["tokens"]
    assert len({tuple(t) for t in ref}) > 1  # distinct prompts give distinct continuations
    for tp in (2, 4):
        assert tiny[f"{model}_tp{tp}"]["tokens"] == ref, f"tp={tp}"


def _check_split(report: dict, tp: int) -> None:
    for name, r in report.items():
        assert len(r["shards"]) == tp and r["devices"] == list(range(tp)), name
        split = [i for i, (g, s) in enumerate(zip(r["global"], r["shards"][0])) if g != s]
        assert len(split) == 1, (name, r)  # exactly one axis split...
        ax = split[0]
        assert r["shards"][0][ax] * tp == r["global"][ax], (name, r)  # ...into N equal parts
        assert all(s == r["shards"][0] for s in r["shards"]), name


@pytest.mark.parametrize("model", ["llama_8q8kv", "qwen2_8q2kv"])
def test_each_device_holds_one_nth(tiny, model):
    for tp in (2, 4):
        run = tiny[f"{model}_tp{tp}"]
        _check_split(run["shards"], tp)
        kv = run["shards"]["kv_pages"]
        assert kv["shards"][0][2] * tp == kv["global"][2]  # split on the KV-head axis
    one = tiny[f"{model}_tp1"]["device_bytes"]
    four = tiny[f"{model}_tp4"]["device_bytes"]
    if model == "llama_8q8kv":  # no replication: exactly a quarter of the cache per device
        assert four["kv_bytes"] * 4 == one["kv_bytes"]
        assert four["weight_bytes"] < one["weight_bytes"] / 3.9  # all but the norms split
    else:  # 2 KV heads over 4 devices: each KV head stored twice, one head per device
        assert tiny[f"{model}_tp4"]["shards"]["kv_pages"]["global"][2] == 4
        assert four["kv_bytes"] * 2 == one["kv_bytes"]
        assert four["weight_bytes"] < one["weight_bytes"] / 3.5


def test_unrolled_layers_tp2(tiny):
    """The accelerator layout (per-layer arrays) keeps each weight's split, minus the layer axis."""
    run, scan = tiny["qwen2_8q2kv_tp2_unrolled"], tiny["qwen2_8q2kv_tp2"]
    assert run["tokens"] == tiny["qwen2_8q2kv_tp1"]["tokens"]
    assert run["device_bytes"] == scan["device_bytes"]
    specs = run["layer_specs"]
    # q/k/v and gate/up fused per layer (llama_state.fuse_layer), split by shard on their axis 1
    assert specs["wqkv"] == "P(None, 'tp', None)" and specs["w_gu"] == "P(None, 'tp', None, None)"
    assert specs["wo"] == specs["w_down"] == "P('tp', None)"
    assert specs["bqkv"] == "P('tp', None)" and specs["ln_attn"] == "P()"


def test_no_compiles_after_warmup_tp4(tiny):
    st = tiny["qwen2_8q2kv_tp4"]["stats"]
    assert st["compiles_after_warmup"] == 0, st


def test_step_communication_is_allreduce_only(tiny):
    """Two all-reduces per layer (in the scan body), one for the embedding, one logits gather."""
    ops = tiny["qwen2_8q2kv_tp4"]["collectives"]
    assert sorted(o.split()[0] for o in ops) == ["all-gather", "all-reduce", "all-reduce", "all-reduce"], ops
    assert [o for o in ops if o.startswith("all-gather")] == ["all-gather f32[4,384]{0,1}"], ops


def test_smollm2_tp3(smollm2):
    assert smollm2["tp3"]["tokens"] == smollm2["tp1"]["tokens"]
    _check_split(smollm2["tp3"]["shards"], 3)
    assert smollm2["tp3"]["shards"]["kv_pages"]["shards"][0][2] == 1  # 3 KV heads, one per device
    assert smollm2["tp3"]["device_bytes"]["kv_bytes"] * 3 == smollm2["tp1"]["device_bytes"]["kv_bytes"]


# -- two processes x 2 devices on loopback --------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A converted tiny model (8 q / 2 KV heads, qwen2 biases) with SmolLM2's tokenizer."""
    from safetensors.numpy import save_file
    from tp_worker import tiny_model

    from jaxllm.models.loader import (_TOKENIZER_FILES, cache_path, convert, is_converted,
                                      load_model_files, resolve_model)

    cached = cache_path(resolve_model(None))
    if not is_converted(cached):
        load_model_files(None)  # writes the cache entry the tokenizer files are copied from
    root = tmp_path_factory.mktemp("tp_model")
    hf = root / "hf"
    hf.mkdir()
    cfg, weights = tiny_model("qwen2", 8, 2, seed=5, vocab=49152)
    with open(hf / "config.json", "w") as f:
        json.dump(cfg, f)
    save_file(weights, str(hf / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(cached, name)):
            shutil.copyfile(os.path.join(cached, name), hf / name)
    return convert(str(hf), str(root / "converted"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _json_out(stdout: str):
    """The `--json` document in stdout (gloo prints '[Gloo] ...' connection lines there too)."""
    lines = stdout.splitlines()
    return json.loads("\n".join(lines[lines.index("["):])) if "[" in lines else None


def _two_processes_and_one(common: list[str], stderr: list | None = None) -> tuple:
    """`jaxllm generate` args run as 2 processes x 2 CPU devices and as 1 process x 4 devices:
    (leader's --json, follower's (None: followers only run steps), the single process's).
    `stderr`, when given, receives the three processes' stderr in the same order. The
    coordinator's port is picked free here and bound by process 0 seconds later: if something
    else took it meanwhile (the other test worker), the run is tried once more on another."""
    for attempt in range(2):
        port = _free_port()
        dist = ["--distributed-coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
        procs = [subprocess.Popen([PY, *common, *dist, "--process-id", str(i)], env=_env(2), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        single = subprocess.Popen([PY, *common], env=_env(4), cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            outs = [p.communicate(timeout=TIMEOUT) for p in (*procs, single)]
        finally:
            for p in (*procs, single):
                p.kill() if p.poll() is None else None
        taken = procs[0].returncode != 0 and any(m in outs[0][1] for m in ("already in use", "Failed to add port"))
        if not (taken and attempt == 0):
            break
    for p, (out, err) in zip((*procs, single), outs):
        assert p.returncode == 0, err[-4000:]
    if stderr is not None:
        stderr.extend(e for _, e in outs)
    return tuple(_json_out(o) for o, _ in outs)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [[], ["--expert-parallel-size", "2"]], ids=["ep4", "ep2xtp2"])
def test_two_processes_expert_parallel_match_one(groups):
    """Expert parallelism across processes (issue 15): a tiny MoE (dummy weights drawn on the
    devices) with --enable-expert-parallel over 2 processes x 2 devices, experts split over all
    four (or over two groups of two, each expert split by F within its group, one group a
    process), gives the one-process 4-device ids."""
    leader, follower, ref = _two_processes_and_one(
        ["-m", "jaxllm.cli", "generate", "The capital of France is", "--random-shape", "tiny-moe",
         "--load-format", "dummy", "--json", "--max-tokens", "8", "--dtype", "float32",
         "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--tensor-parallel-size", "4", "--enable-expert-parallel", *groups, "--temperature", "0"])
    assert follower is None
    assert [r["token_ids"] for r in leader] == [r["token_ids"] for r in ref]
    assert len(ref[0]["token_ids"]) == 8 and np.unique(ref[0]["token_ids"]).size > 2


EPLB_LOG = re.compile(r"EPLB: rebalanced (\d+) MoE layers over 4 devices .*load max/mean "
                      r"([\d.]+) -> ([\d.]+)")


@pytest.mark.slow
def test_two_processes_eplb_match_one():
    """EPLB across processes (issue 15): tiny-moe with expert parallelism over 2 processes x 2
    devices and 4 redundant slots rebalances every 3 steps, moving experts between the
    processes' devices, and keeps the one-process ids; every rebalance lowers the imbalance."""
    logs: list[str] = []
    leader, follower, ref = _two_processes_and_one(
        ["-m", "jaxllm.cli", "generate", "The capital of France is", "Once upon a time",
         "--random-shape", "tiny-moe", "--load-format", "dummy", "--json", "--max-tokens", "12",
         "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "32", "--tensor-parallel-size", "4", "--enable-expert-parallel",
         "--enable-eplb", "--eplb-config",
         '{"window_size": 4, "step_interval": 3, "num_redundant_experts": 4}', "--temperature", "0"],
        stderr=logs)
    assert follower is None
    assert [r["token_ids"] for r in leader] == [r["token_ids"] for r in ref]
    assert all(len(r["token_ids"]) == 12 for r in ref)
    for err in (logs[0], logs[2]):  # the leader's and the single process's
        found = [(float(b), float(a)) for _, b, a in EPLB_LOG.findall(err)]
        assert len(found) >= 3, err[-3000:]
        assert "(0 routed rows)" not in err  # warm-up steps route nothing: no rebalance
        assert all(a <= b + 1e-9 for b, a in found) and any(a < b for b, a in found), found
    assert not EPLB_LOG.search(logs[1])  # followers rebalance alike but only the leader logs


def test_two_processes_match_one(tiny_model_dir):
    """Seeded sampling with n=2: the siblings share the prompt's partly filled last block, so
    their first decode step copies it (copy-on-write), on every process's KV heads."""
    prompts = ["The capital of France is", "Once upon a time, in a land far"]
    leader, follower, ref = _two_processes_and_one(
        ["-m", "jaxllm.cli", "generate", *prompts, "--model", tiny_model_dir, "--json",
         "--max-tokens", "8", "--dtype", "float32", "--max-model-len", "128",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--tensor-parallel-size", "4",
         "--n", "2", "--temperature", "0.8", "--sample-seed", "7"])
    assert follower is None  # followers print no results: they only run steps
    assert [r["all_token_ids"] for r in leader] == [r["all_token_ids"] for r in ref]
    assert all(len(ids) == 8 for r in ref for ids in r["all_token_ids"])
    assert all(r["all_token_ids"][0] != r["all_token_ids"][1] for r in ref)  # the siblings diverged
    assert np.unique([t for r in ref for t in r["token_ids"]]).size > 2
