"""The embedded SmolLM2-135M-Instruct: greedy ids equal HF transformers (GGUF loaded by HF)."""

import os
import sys

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.models.loader import embedded_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List three uses of JAX:",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=8, token_buckets=(16, 64),
               seq_buckets=(8,))


def test_greedy_matches_hf(llm):
    import torch
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    # Both stop at EOS (HF's generation config names the same id) or after 32 tokens.
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for p, o in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
    assert sum(len(o.outputs[0].token_ids) for o in outs) >= 5 * 32  # at least 5 x 32 compared
    assert llm.stats()["compiles_after_warmup"] == 0


def test_text_chat_and_no_torch_in_serving_path(llm):
    import subprocess

    code = ("import sys; from jaxllm import LLM, SamplingParams; "
            "llm = LLM(max_model_len=128, max_num_seqs=8, token_buckets=(16, 64), seq_buckets=(8,)); "
            "o = llm.chat([{'role': 'user', 'content': 'What is the capital of France?'}], "
            "SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]; "
            "print(repr(o.outputs[0].text)); print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    text, torch_loaded = res.stdout.strip().splitlines()[-2:]
    assert "Paris" in text
    assert torch_loaded == "False"


def test_stop_strings_logprobs_and_cli(llm):
    tok = llm.get_tokenizer()
    base = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0]
    word = base.text.split()[1]  # a word from the middle of the greedy continuation
    cut = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, stop=[word]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == base.text[:base.text.index(word)]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    keep = llm.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=20, stop=[word], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert keep.text == base.text[:base.text.index(word) + len(word)]
    # Incremental detokenization equals a one-shot decode of the ids.
    assert base.text == tok.decode(base.token_ids)
    lp = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, logprobs=5),
                      use_tqdm=False)[0].outputs[0]
    for tid, entry in zip(lp.token_ids, lp.logprobs):
        assert entry[tid].rank == 1 and len(entry) == 5
        assert max(e.logprob for e in entry.values()) == entry[tid].logprob <= 0


def test_cli_generate_json():
    import json
    import subprocess

    res = subprocess.run([sys.executable, "-m", "jaxllm.cli", "generate", "The capital of France is",
                          "--max-tokens", "8", "--json", "--max-model-len", "64", "--max-num-seqs", "8"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out[0]["prompt"] == "The capital of France is" and len(out[0]["token_ids"]) == 8
