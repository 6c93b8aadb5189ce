"""Quantized weights with tensor parallelism, run as a subprocess by test_quant_tp.py
(forced host devices, as tests/tp_worker.py; JSON on the last line of stdout).

    python tests/quant_tp_worker.py    online fp8 / int4 and an HF FP8 block checkpoint,
                                       tp=1 vs tp=2 (scan layout; int4 also unrolled)
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GREEDY_TOKENS = 8


def parts(runner, name: str) -> dict:
    """Per-part global and first-device shard shapes of one quantized linear."""
    from jaxllm.models.params import value

    q = value(runner.params["layers"][name]) if runner.layer_params is None else runner.layer_params[0][name]
    return {k: {"kind": q.kind, "shape": list(getattr(q, k).shape),
                "shard": list(getattr(q, k).addressable_shards[0].data.shape)}
            for k in ("values", "scale", "offset") if getattr(q, k) is not None}


def run() -> dict:
    from jaxllm import LLM, SamplingParams
    from jaxllm.engine.runner import ModelRunner
    from jaxllm.quantization import checkpoints
    from test_quant_weights import _fp8_block_checkpoint
    from tp_worker import tiny_model

    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 384, size=n).tolist() for n in (3, 29, 70)]
    kw = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(32,), seq_buckets=(4,), skip_warmup=True)
    # inter 256: down_proj's K splits into whole int4 groups of 128; o_proj (K = 128, one
    # group) is the replicated case.
    cfg, weights = tiny_model("qwen2", 8, 2, inter=256)
    result: dict = {}

    def go(key: str, tp: int, unroll: bool = False, **extra) -> None:
        init = ModelRunner.__init__
        if unroll:  # the accelerator layout (one array per layer), forced on CPU
            ModelRunner.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": True})
        try:
            llm = LLM(tensor_parallel_size=tp, **kw, **extra)
        finally:
            ModelRunner.__init__ = init
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        r = llm.engine.runner
        result[key] = {"tokens": [o.outputs[0].token_ids for o in outs],
                       "wq": parts(r, "wq"), "wo": parts(r, "wo"), "w_down": parts(r, "w_down"),
                       "weight_bytes": r.device_bytes["weight_bytes"]}

    for method in ("fp8", "int4"):  # int8's rules are int4's without the packing (CI time)
        for tp in (1, 2):
            go(f"{method}_tp{tp}", tp, hf_config=cfg, weights=dict(weights), quantization=method)
    go("int4_tp2_unrolled", 2, unroll=True, hf_config=cfg, weights=dict(weights), quantization="int4")
    # An HF FP8 checkpoint (128 x 128 block scales) kept as stored.
    fcfg, fsd = tiny_model("llama", 4, 2, hidden=256, inter=512, head_dim=64, layers=2, seed=4)
    qcfg, qsd = _fp8_block_checkpoint(fcfg, fsd)
    for tp in (1, 2):
        go(f"hf_fp8_tp{tp}", tp, hf_config=qcfg, weights=checkpoints.hf_fp8_weights(dict(qsd)))
    return result


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    print(json.dumps(run()))
