"""KV connectors under tensor parallelism, run as a subprocess by test_kv_tp.py (forced host
devices must be set before jax starts). Prints JSON on its last stdout line.

    python tests/kv_tp_worker.py DISK_ROOT

The same tiny Qwen2 (8 query heads, 2 KV heads: one per device at tp=2) at tp=1 and tp=2,
each with a host + disk tier: prompt A, then B (evicts A from the device), then A again
(from the host tier, asynchronously). A tp=2 engine restarted on tp=1's disk directory
serves A from disk (each device loads its KV heads of the whole stored block), and a tp=2
producer hands A to a tp=2 consumer over jax.experimental.transfer.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def main(root: str) -> dict:
    sys.path.insert(0, HERE)
    from kv_tiny import gen
    from tp_worker import tiny_model

    from jaxllm import LLM, SamplingParams
    from jaxllm.engine.kv_ops import to_numpy
    from jaxllm.runtime.kv_cache_manager import block_hash

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cfg, weights = tiny_model("qwen2", 8, 2)
    rng = np.random.default_rng(3)
    A, B = (rng.integers(3, 384, size=300).tolist() for _ in range(2))
    keys = []
    for i in range(18):
        keys.append(block_hash(keys[-1] if keys else None, A[i * 16:(i + 1) * 16], None))
    gib = 64 * 2 * 2 * 2 * 16 * 16 * 4 / (1 << 30)  # 64 blocks

    def make(tp: int, **kw) -> LLM:
        return LLM(hf_config=cfg, weights=weights, dtype="float32", max_model_len=384, max_num_seqs=4,
                   max_num_batched_tokens=64, token_buckets=(64,), seq_buckets=(4,),
                   num_gpu_blocks_override=24, skip_warmup=True, seed=7, tensor_parallel_size=tp, **kw)

    def device_is_host(llm: LLM) -> bool:
        """A's blocks in the device prefix cache hold the bytes of their host-tier copies."""
        e = llm.engine
        pages = np.asarray(e.runner.kv_pages)
        for k in keys:
            b, h = e.kv.pool.lookup(k), e.connector.host.get(k)
            if b is None or h is None or not np.array_equal(pages[:, :, :, b.block_id], to_numpy(h)):
                return False
        return True

    def free(llm: LLM) -> bool:
        e = llm.engine
        return e.kv.num_free_blocks == e.runner.num_blocks and not e.scheduler.loading

    res: dict = {}
    host_blocks = {}
    for tp in (1, 2):
        llm = make(tp, kv_offload_cpu_gib=gib, kv_offload_disk_dir=os.path.join(root, f"tp{tp}"))
        first = llm.generate([A], greedy, use_tqdm=False)[0]
        llm.generate([B], greedy, use_tqdm=False)
        again = llm.generate([A], greedy, use_tqdm=False)[0]
        llm.engine.flush_kv()
        conn, ops = llm.engine.connector, llm.engine.kv_ops
        host_blocks[tp] = np.stack([to_numpy(conn.host.get(k)) for k in keys])
        st = llm.stats()
        res[f"tp{tp}"] = {
            "first": first.outputs[0].token_ids, "again": again.outputs[0].token_ids,
            "cached": again.num_cached_tokens, "external_hits": st["external_prefix_cache_hits"],
            "cpu_load_bytes": st["kv_offload_cpu_load_bytes"], "free": free(llm),
            "device_is_host": device_is_host(llm),
            "pins": conn.host.num_pinned, "kv_pages_shards": [list(s.data.shape) for s in llm.engine.runner.kv_pages.addressable_shards],
            "put_shards": [list(s.data.shape) for s in ops.put_blocks([host_blocks[tp][0]])[0].addressable_shards]}
        llm.engine.connector.shutdown()
    res["host_blocks_max_diff"] = float(np.abs(host_blocks[1] - host_blocks[2]).max())
    res["block_shape"] = list(host_blocks[2].shape[1:])

    # Restart at tp=2 on tp=1's files: each device reads its heads of the stored blocks.
    fresh = make(2, kv_offload_cpu_gib=gib, kv_offload_disk_dir=os.path.join(root, "tp1"))
    out = fresh.generate([A], greedy, use_tqdm=False)[0]
    fresh.engine.flush_kv()
    st = fresh.stats()
    res["restart_tp2_from_tp1"] = {"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
                                   "disk_load_bytes": st["kv_offload_disk_load_bytes"], "free": free(fresh),
                                   "device_is_host": device_is_host(fresh)}
    fresh.engine.connector.shutdown()

    # P/D at tp=2 on both sides.
    conf = lambda role: {"kv_connector": "JaxTransferConnector", "kv_role": role,
                         "kv_connector_extra_config": {"timeout_s": 30}}
    try:
        prod, cons = make(2, kv_transfer_config=conf("kv_producer")), make(2, kv_transfer_config=conf("kv_consumer"))
        pre = gen(prod, A, 1, {"do_remote_decode": True}, rid="p")
        out = gen(cons, A, 8, pre.kv_transfer_params, rid="d")
        res["pd_tp2"] = {"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
                         "pulls": cons.stats()["kv_transfer_pulls"], "free": free(prod) and free(cons)}
    except Exception as e:  # reported, the test decides
        res["pd_tp2"] = {"error": f"{type(e).__name__}: {e}"}
    return res


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    print(json.dumps(main(sys.argv[1])))
