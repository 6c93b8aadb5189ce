"""Subprocess of test_spec_decode: ngram speculation over a 2-device tensor-parallel mesh."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import numpy as np
from hf_tiny import make, make_llm
from jaxllm import SamplingParams
_, cfg, sd = make("llama3", seed=3)
rng = np.random.default_rng(0)
pat = rng.integers(0, 384, size=20).tolist()
prompts = [pat * 3, (pat[:7] * 10)[:50]]
NG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
G = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
a = make_llm((cfg, sd), max_num_seqs=4, token_buckets=(16, 64), seq_buckets=(16,), speculative_config=NG, tensor_parallel_size=2)
b = make_llm((cfg, sd), max_num_seqs=4, token_buckets=(16, 64), seq_buckets=(16,), skip_warmup=True)
x = [o.outputs[0].token_ids for o in a.generate(prompts, G, use_tqdm=False)]
y = [o.outputs[0].token_ids for o in b.generate(prompts, G, use_tqdm=False)]
s = a.stats()
print(json.dumps({"identical": x == y, "accepted": s["spec_decode_num_accepted_tokens"],
                  "compiles_after_warmup": s["compiles_after_warmup"]}))
