"""Greedy ids and logits equal HF transformers for each supported architecture."""

import numpy as np
import pytest

from hf_tiny import hf_greedy, hf_last_logits, make, random_prompts

from jaxllm import LLM, SamplingParams
from jaxllm.engine.batch import build_batch
from jaxllm.runtime.request import Request, StopRule
from jaxllm.runtime.scheduler import ScheduledRequest, SchedulerOutput


def last_logits(llm: LLM, prompt: list[int]) -> np.ndarray:
    """Run one whole-prompt step through the paged runner; return its last-token logits."""
    eng = llm.engine
    req = Request("probe", prompt, StopRule(max_tokens=1))
    assert eng.kv.allocate_slots(req, len(prompt)) is not None
    out = SchedulerOutput([ScheduledRequest("probe", prompt, 0, eng.kv.block_ids("probe"), True)],
                          num_batched_tokens=len(prompt))
    hb = build_batch(out, eng.token_buckets, eng.seq_buckets, eng.cfg.block_size, eng.runner.max_blocks)
    logits = np.asarray(eng.runner.execute(hb)[0])[0]
    eng.kv.free(req)
    return logits


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3"])
def test_parity_with_hf(arch):
    model, cfg, sd = make(arch)
    llm = LLM(hf_config=cfg, weights=sd, dtype="float32", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, token_buckets=(16, 64), seq_buckets=(8,))
    prompts = random_prompts(4, cfg["vocab_size"], 3, 90, seed=1)
    # Greedy ids over 20 tokens, all prompts in one continuously batched run (prompts > 64
    # tokens are chunked across steps).
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, 20)
    # Last-position logits, relative error.
    for p in prompts[:2]:
        ours, ref = last_logits(llm, p[:60]), hf_last_logits(model, p[:60])
        assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4
    assert llm.stats()["compiles_after_warmup"] == 0
