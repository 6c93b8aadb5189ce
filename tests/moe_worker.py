"""MoE checks that need forced host devices, run as a subprocess by test_moe_parallel.py.

    python tests/moe_worker.py ep     tp / ep layouts on 4 devices vs one device
    python tests/moe_worker.py eplb   a biased router, rebalanced: load and outputs
    python tests/moe_worker.py dummy  random_shape="tiny-moe" dummy weights, one device vs tp 4 + EP

JSON on the last line of stdout.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TOKENS = 8


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, size=n).tolist() for n in (3, 11, 29, 40)]


def _llm(cfg, sd, **kw):
    from jaxllm import LLM

    args = dict(hf_config=cfg, weights=sd, dtype="float32", max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=32, token_buckets=(32,), seq_buckets=(4,), skip_warmup=True)
    return LLM(**(args | kw))


def _expert_shards(runner) -> dict:
    from flax import nnx

    pure = nnx.to_pure_dict(runner.params)["experts"]
    return {k: {"global": list(v.shape), "shard": list(v.addressable_shards[0].data.shape)}
            for k, v in pure.items()}


def run_ep() -> dict:
    from hf_tiny import make

    from jaxllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    out = {}
    # (tp, ep): ep False (experts split by F), True (whole experts), or an expert_parallel_size
    # (2: two groups of two devices, each expert split over its group's two)
    for arch, layouts in (("qwen2_moe", [(1, False), (4, False), (4, True), (2, True), (4, 2)]),
                          ("qwen3_moe_mixed", [(1, False), (4, True), (4, 2)])):
        _, cfg, sd = make(arch)
        prompts = _prompts(cfg["vocab_size"])
        for tp, ep in layouts:
            warm = arch == "qwen2_moe" and tp == 4 and ep is True
            kw = {"expert_parallel_size": ep} if ep not in (True, False) else {}
            llm = _llm(cfg, sd, tensor_parallel_size=tp, enable_expert_parallel=bool(ep),
                       skip_warmup=not warm, **kw)
            toks = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            run = {"tokens": toks, "device_bytes": llm.engine.runner.device_bytes}
            if tp > 1:
                run["experts"] = _expert_shards(llm.engine.runner)
            if warm:
                run["stats"] = llm.stats()
            if tp == 4 and arch == "qwen2_moe" and ep in (True, False):
                from tp_worker import collectives
                run["collectives"] = collectives(llm.engine.runner, 32, 4)
            name = f"{arch}_tp{tp}{'_ep' if ep is True else f'_ep{ep}' if ep else ''}"
            out[name] = run
    # The accelerator layout (one array per layer, unrolled) with experts split both ways.
    from jaxllm.engine.runner import ModelRunner
    init = ModelRunner.__init__
    ModelRunner.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": True})
    try:
        _, cfg, sd = make("qwen2_moe")
        llm = _llm(cfg, sd, tensor_parallel_size=4, enable_expert_parallel=True, expert_parallel_size=2)
        assert llm.engine.runner.layer_params is not None
        out["qwen2_moe_tp4_ep2_unrolled"] = {"tokens": [o.outputs[0].token_ids for o in llm.generate(
            _prompts(cfg["vocab_size"]), greedy, use_tqdm=False)]}
    finally:
        ModelRunner.__init__ = init
    return out


def biased(hot=(0, 2)) -> tuple[dict, dict]:
    """Tiny Qwen3-MoE whose router sends nearly every token to experts `hot`.

    Hidden dimension 0 of the embeddings gets a constant (2.5x the embeddings' std), and the
    router rows of the hot experts read it strongly, so their logits lead for (almost)
    every token while the model's outputs stay varied.
    """
    from hf_tiny import make

    _, cfg, sd = make("qwen3_moe")
    sd["model.embed_tokens.weight"][:, 0] += 0.05
    for i in range(cfg["num_hidden_layers"]):
        gate = sd[f"model.layers.{i}.mlp.gate.weight"]
        gate[list(hot), 0] += 30.0
    return cfg, sd


def run_eplb() -> dict:
    from jaxllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    cfg, sd = biased()
    prompts = _prompts(cfg["vocab_size"])
    ref = _llm(cfg, sd)
    out = {"ref": [o.outputs[0].token_ids for o in ref.generate(prompts, greedy, use_tqdm=False)]}
    eplb = {"window_size": 6, "step_interval": 4, "num_redundant_experts": 4}
    llm = _llm(cfg, sd, tensor_parallel_size=4, enable_expert_parallel=True, enable_eplb=True,
               eplb_config=eplb, skip_warmup=False)
    bal = llm.engine.runner.eplb
    compiles = bal.num_compiles()
    initial = bal.phys_to_log.tolist()
    toks = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # The accelerator layout (one array per layer, unrolled), forced on CPU: weights move per layer.
    from jaxllm.engine.runner import ModelRunner

    init = ModelRunner.__init__
    ModelRunner.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": True})
    try:
        un = _llm(cfg, sd, tensor_parallel_size=4, enable_expert_parallel=True, enable_eplb=True,
                  eplb_config=eplb)
    finally:
        ModelRunner.__init__ = init
    out["unrolled_tokens"] = [o.outputs[0].token_ids for o in un.generate(prompts, greedy, use_tqdm=False)]
    out["unrolled_history"] = un.engine.runner.eplb.history
    out |= {"tokens": toks, "history": bal.history, "initial": initial,
            "final": bal.phys_to_log.tolist(), "stats": llm.stats(),
            "balancer_compiles": [compiles, bal.num_compiles()],
            "per_fn": [f._cache_size() for f in (bal._record, bal._take_stacked, bal._take_layer)], "steps": bal.steps,
            "slots": bal.num_slots}
    return out


def run_dummy() -> dict:
    """LLM(random_shape="tiny-moe", load_format="dummy"): weights drawn on the device(s) from the
    seed, so one device and tensor parallel 4 with whole experts per device (EP) hold the same
    model; greedy ids, the EP layout and the per-device roofline cost (benchmarks/roofline.py)."""
    import jax.numpy as jnp

    from jaxllm import LLM, SamplingParams
    from jaxllm.benchmarks.roofline import ModelCost

    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompts = _prompts(512)
    kw = dict(random_shape="tiny-moe", load_format="dummy", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=(32,), seq_buckets=(4,), skip_warmup=True)
    out = {}
    for name, extra in (("tp1", {}), ("tp4_ep", dict(tensor_parallel_size=4, enable_expert_parallel=True)),
                        ("tp4_ep2", dict(tensor_parallel_size=4, enable_expert_parallel=True,
                                         expert_parallel_size=2))):
        llm = LLM(**kw, **extra)
        runner = llm.engine.runner
        c = ModelCost.of_runner(runner)
        out[name] = {"tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)],
                     "devices": len(runner.tp.mesh.devices.flat) if runner.tp else 1,
                     "cost": {k: getattr(c, k) for k in ("weight_bytes", "matmul_params", "moe_layers",
                                                         "local_experts", "expert_bytes", "all_expert_bytes")},
                     "device_weight_bytes": runner.device_bytes["weight_bytes"],
                     "itemsize": jnp.dtype(runner.dtype).itemsize}
        if runner.tp:
            out[name]["experts"] = _expert_shards(runner)
    return out


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    res = {"ep": run_ep, "eplb": run_eplb, "dummy": run_dummy}[sys.argv[1]]()
    print(json.dumps(res))
