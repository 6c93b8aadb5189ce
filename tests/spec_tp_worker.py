"""Subprocess of test_spec_tp: speculation over a 2-device tensor-parallel mesh (CPU devices).

`spec_tp_worker.py CASE...` prints one JSON line per case. Each case's engine runs with
tensor_parallel_size=2 and is compared with the same engine with proposals turned off, and
with a tp=1 engine without speculation. Cases: ngram; draft (the target drafting for itself,
then a random draft's weights swapped in; target and draft in the accelerators' unrolled
layout); eagle3 (over an unrolled target) and eagle (over the scan): random heads in the
published format (test_spec_eagle's builder), drafts checked against its dense float64
reference."""
import contextlib
import functools
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import numpy as np
from hf_tiny import make, make_llm
from jaxllm import SamplingParams

K = 3
KW = dict(max_num_seqs=4, token_buckets=(16, 64), seq_buckets=(16,))
G = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
model, cfg, sd = make("llama3", seed=3)
rng = np.random.default_rng(0)
pat = rng.integers(0, 384, size=20).tolist()
prompts = [pat * 3, (pat[:7] * 10)[:50], rng.integers(0, 384, size=9).tolist()]
tmp = tempfile.mkdtemp()


def ids(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, G, use_tqdm=False)]


def run(llm, seen=None):
    """Greedy with speculation (`seen` collects (tokens, drafts) of every proposal), the metrics
    it added, and the same engine's output without proposals."""
    eng, st0 = llm.engine, dict(llm.stats())
    propose = getattr(eng.spec.proposer, "propose")
    if seen is not None:
        def spy(*a):
            res = propose(*a)
            seen.extend((list(r.all_token_ids), d) for r, d in zip(a[0], res) if d)
            return res
        eng.spec.proposer.propose = spy
    got = ids(llm)
    eng.spec.proposer.__dict__.pop("propose", None)
    st = llm.stats()
    d = {k: st[k] - st0[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                     "spec_decode_num_accepted_tokens")}
    per_pos = [a - b for a, b in zip(st["spec_decode_num_accepted_tokens_per_pos"],
                                     st0["spec_decode_num_accepted_tokens_per_pos"])]
    adds_up = (sum(per_pos) == d["spec_decode_num_accepted_tokens"] <= d["spec_decode_num_draft_tokens"]
               <= K * d["spec_decode_num_drafts"] and per_pos == sorted(per_pos, reverse=True)
               and st["spec_decode_mean_acceptance_length"] == 1 + st["spec_decode_num_accepted_tokens"]
               / st["spec_decode_num_drafts"])
    eng.spec.propose = lambda *a: None
    want = ids(llm)
    del eng.spec.propose
    return {"identical": got == want, "plain_tp1": got == PLAIN, "drafts": d["spec_decode_num_draft_tokens"],
            "accepted": d["spec_decode_num_accepted_tokens"], "adds_up": adds_up,
            "compiles_after_warmup": st["compiles_after_warmup"],
            "overlapped": st["spec_decode_overlapped_steps"] - st0["spec_decode_overlapped_steps"],
            "leaked": st["num_total_blocks"] - st["num_free_blocks"]}


def split(pages):
    """(KV heads in one device's shard, KV heads in all) of a draft's pages."""
    return [pages.addressable_shards[0].data.shape[2], pages.shape[2]]


def spec_llm(spec, **kw):
    return make_llm((cfg, sd), **KW, tensor_parallel_size=2, speculative_config=spec, **kw)


def case_ngram():
    return run(spec_llm({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                         "prompt_lookup_min": 1}))


@contextlib.contextmanager
def unrolled():
    """Target and draft in the accelerators' layout (one array per layer, q/k/v and gate/up
    fused per shard), forced on CPU as tp_worker does."""
    from jaxllm.engine.runner import ModelRunner
    from jaxllm.spec import draft_model
    init, place = ModelRunner.__init__, draft_model.place_weights
    ModelRunner.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "unroll_layers": True})
    draft_model.place_weights = functools.partial(place, unroll=True)
    try:
        yield
    finally:
        ModelRunner.__init__, draft_model.place_weights = init, place


@unrolled()
def case_draft():
    from jaxllm.spec.build import build_decoder
    model.save_pretrained(os.path.join(tmp, "self"))
    make("llama3", seed=11)[0].save_pretrained(os.path.join(tmp, "random"))
    llm = spec_llm({"method": "draft_model", "model": os.path.join(tmp, "self"), "num_speculative_tokens": K})
    own = llm.engine.spec.proposer
    res = {"self": run(llm), "split": split(own.pages)}
    spec = llm.engine.cfg.speculative_config.__class__.from_dict(
        {"method": "draft_model", "model": os.path.join(tmp, "random"), "num_speculative_tokens": K})
    own.flat = build_decoder(llm.engine, spec, None, 0).proposer.flat  # same shapes and shardings
    res["random"] = run(llm)
    res["unrolled"] = llm.engine.runner.layer_params is not None and isinstance(own._def.unflatten(own.flat), tuple)
    return res


def case_eagle(method, warm):
    from test_spec_eagle import reference_drafts, write_head
    path, w = write_head(__import__("pathlib").Path(tmp) / method, method)
    llm = spec_llm({"method": method, "model": path, "num_speculative_tokens": K}, skip_warmup=not warm)
    seen = []
    res = run(llm, seen)
    p = llm.engine.spec.proposer
    pick = np.random.default_rng(0).choice(len(seen), min(len(seen), 10), replace=False)
    res["reference"] = sum(reference_drafts(method, w, model, *seen[i][:1], len(seen[i][1])) == seen[i][1]
                           for i in pick)
    res["checked"] = len(pick)
    res["split"] = split(p.pages) + [p.weights["wq"].addressable_shards[0].data.shape[1], p.weights["wq"].shape[1]]
    res["hidden_replicated"] = p.runner.last_hidden.sharding.is_fully_replicated
    res["unrolled"] = p.runner.layer_params is not None
    return res


PLAIN = ids(make_llm((cfg, sd), **KW, skip_warmup=True))
CASES = {"ngram": case_ngram, "draft": case_draft, "eagle3": unrolled()(lambda: case_eagle("eagle3", True)),
         "eagle": lambda: case_eagle("eagle", False)}
for name in sys.argv[1:]:
    print(json.dumps({"case": name, **CASES[name]()}), flush=True)
