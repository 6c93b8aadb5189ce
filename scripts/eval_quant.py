"""Quality of each quantization mode against the unquantized model (issue 17).

Per mode, on a fixed text (`TEXT`: scripts/data/eval_quant_text.txt, 769 SmolLM2 tokens of six
paragraphs on unrelated topics; or --text-file) and on the unquantized model's greedy
continuation of a fixed prompt:
  kl         mean per-token KL(p_ref || p_mode) of the next-token distributions over the text;
  ppl        perplexity of the text (and its ratio to the unquantized model's);
  agree      greedy agreement: the fraction of the reference's --gen-tokens greedy tokens that
             the mode's argmax reproduces, teacher-forced on the reference continuation;
  prefix     how many of those tokens the mode's own free-running greedy output shares
             with the reference before the first difference (--free-run only).
Distributions come from one forward of the engine's own model (same weights, same KV page
format, same attention backend) over the whole sequence, padded to a multiple of PAD tokens so each mode
compiles one forward per length. `SHORT_TEXT` (its first paragraph, 136 tokens) was the text
until its noise showed: on it, single linears quantized alone moved perplexity by -0.6% to
+0.9% at KL 0.001-0.005, the whole ppl budget of an 8-bit mode.

    python scripts/eval_quant.py                       # embedded SmolLM2 on CPU, every mode
    python scripts/eval_quant.py --model /path/llama3-8b --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import os

import numpy as np

TEXT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "eval_quant_text.txt")
with open(TEXT_FILE, encoding="utf-8") as _f:
    TEXT = _f.read()
SHORT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books far faster than scribes. Within fifty years, presses "
    "were operating in more than two hundred cities across Europe, and the price of books "
    "fell sharply. Scholars could compare identical copies of a text, which encouraged the "
    "standardisation of spelling and grammar. Pamphlets spread news and arguments quickly, "
    "and many historians link the press to the Reformation and to the scientific revolution "
    "that followed. Today, the word press still refers to newspapers and journalists, a "
    "reminder of how closely printing and public debate have been tied together.")
PROMPT = "Write a short story about a robot who learns to paint."
# (name, engine kwargs): KV cache formats, weight formats, and both together.
MODES = [
    ("kv_fp8", {"kv_cache_dtype": "fp8"}),
    ("kv_fp8_e5m2", {"kv_cache_dtype": "fp8_e5m2"}),
    ("kv_int8", {"kv_cache_dtype": "int8"}),
    ("kv_int4", {"kv_cache_dtype": "int4"}),
    ("w_fp8", {"quantization": "fp8"}),
    ("w_int8", {"quantization": "int8"}),
    ("w_int4", {"quantization": "int4"}),
    ("w_fp8+kv_fp8", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
]
GGUF_MODE = ("w_gguf", {"quantization": "gguf"})  # the GGUF's own blocks kept quantized


PAD = 256  # forwards are padded to a multiple of this many tokens: one compile per length


def full_logprobs(llm, ids: list[int], pad_to: int = PAD):
    """log p(. | ids[:i+1]) for every position i: float32 [len(ids), V], one forward over ids
    padded to a multiple of pad_to tokens (rounded up to whole KV blocks; the padding is masked,
    so the figures do not depend on it, only the forward's cost and the number of compiles)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.kernels.metadata import AttentionMetadata

    runner = llm.engine.runner
    n, S = len(ids), runner.block_size
    step = -(-pad_to // S) * S
    pad = -(-n // step) * step
    blocks = pad // S
    L, two, K = runner.kv_pages.shape[:3]
    kv = jnp.zeros((L, two, K, blocks, S, runner.kv_pages.shape[-1]), runner.kv_pages.dtype)
    pos = np.full(pad, -1, np.int32)
    pos[:n] = np.arange(n, dtype=np.int32)
    md = AttentionMetadata(pos, np.zeros(pad, np.int32), pos.copy(),
                           np.arange(blocks, dtype=np.int32)[None, :], np.array([n], np.int32),
                           np.array([0, n], np.int32), np.array([1], np.int32))
    tokens = np.zeros(pad, np.int32)
    tokens[:n] = ids

    def fwd(params, kv, tokens, md):
        params, layers = params if isinstance(params, tuple) else (params, None)
        model = nnx.merge(runner.graphdef, params)
        with jax.default_matmul_precision("highest" if runner.dtype == jnp.float32 else None):
            _, logits = model(kv, tokens, md, jnp.arange(tokens.shape[0], dtype=jnp.int32), layers)
        return jax.nn.log_softmax(logits, axis=-1)

    fn = llm.__dict__.setdefault("_eval_fwd", jax.jit(fwd))  # one compile per engine
    out = fn(runner.step_params, kv, jnp.asarray(tokens), jax.device_put(md))
    return np.asarray(out[:n], np.float32)


def make_llm(model, dtype, max_model_len, **kw):
    from jaxllm import LLM
    # Decode steps run at T = 1; the prompt goes in chunks of 64.
    return LLM(model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=1,
               max_num_batched_tokens=64, token_buckets=(1, 64), seq_buckets=(1,),
               skip_warmup=True, enable_prefix_caching=False, **kw)


def evaluate(model: str | None = None, modes=None, text: str = TEXT, prompt: str = PROMPT,
             gen_tokens: int = 128, dtype: str = "auto", free_run: bool = False,
             pad_to: int = PAD) -> dict:
    """{mode: figures}; mode "ref" is the unquantized model. pad_to: full_logprobs'."""
    from jaxllm import SamplingParams

    modes = MODES if modes is None else modes
    max_len = 1024
    ref = make_llm(model, dtype, max_len)
    tok = ref.get_tokenizer() if hasattr(ref, "get_tokenizer") else ref.engine.tokenizer
    text_ids = tok.encode(text)
    prompt_ids = tok.encode(prompt)
    greedy = SamplingParams(temperature=0, max_tokens=max(gen_tokens, 1), ignore_eos=True)
    cont = []
    if gen_tokens:  # 0: perplexity and KL only (the fast test)
        cont = ref.generate([{"prompt_token_ids": prompt_ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    seq = prompt_ids + list(cont)

    def figures(llm) -> tuple[dict, np.ndarray]:
        lp_text = full_logprobs(llm, text_ids, pad_to)
        nll = -lp_text[np.arange(len(text_ids) - 1), text_ids[1:]]
        out = {"ppl": float(np.exp(nll.mean()))}
        if cont:
            picks = full_logprobs(llm, seq, pad_to)[len(prompt_ids) - 1:-1].argmax(-1)
            out["agree"] = float(np.mean(picks == np.asarray(cont)))
        if free_run and cont:
            own = llm.generate([{"prompt_token_ids": prompt_ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
            same = np.asarray(own) == np.asarray(cont)
            out["prefix"] = int(np.argmin(same)) if not same.all() else len(cont)
        return out, lp_text

    t0 = time.perf_counter()
    base, ref_lp = figures(ref)
    results = {"ref": {**base, "kl": 0.0, "ppl_ratio": 1.0, "seconds": time.perf_counter() - t0}}
    del ref
    p_ref = np.exp(ref_lp[:-1])
    for name, kw in modes:
        t0 = time.perf_counter()
        try:
            llm = make_llm(model, dtype, max_len, **kw)
            fig, lp = figures(llm)
            del llm
        except Exception as e:  # one mode failing must not lose the others
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {results[name]['error']}", flush=True)
            continue
        kl = float(np.mean(np.sum(p_ref * (ref_lp[:-1] - lp[:-1]), axis=-1)))
        results[name] = {**fig, "kl": kl, "ppl_ratio": fig["ppl"] / base["ppl"],
                         "seconds": time.perf_counter() - t0}
        print(f"{name}: {results[name]}", flush=True)
    results["_meta"] = {"text_tokens": len(text_ids), "gen_tokens": len(cont), "dtype": dtype,
                        "model": model or "embedded SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gen-tokens", type=int, default=128)  # prompt + these: at most 1024
    p.add_argument("--text-file", default=None)
    p.add_argument("--modes", nargs="*", default=None, help="subset of mode names")
    p.add_argument("--free-run", action="store_true", help="also compare free-running greedy outputs")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    text = open(a.text_file, encoding="utf-8").read() if a.text_file else TEXT
    modes = list(MODES)
    if a.model is None or str(a.model).endswith(".gguf"):
        modes.append(GGUF_MODE)
    if a.modes:
        modes = [m for m in modes if m[0] in a.modes]
    res = evaluate(a.model, modes, text, gen_tokens=a.gen_tokens, dtype=a.dtype, free_run=a.free_run)
    print(f"{'mode':>14} {'KL':>9} {'ppl':>8} {'ppl/ref':>8} {'agree':>6}" + ("  prefix" if a.free_run else ""))
    for name, r in res.items():
        if name.startswith("_") or "error" in r:
            continue
        print(f"{name:>14} {r['kl']:9.5f} {r['ppl']:8.3f} {r['ppl_ratio']:8.4f} {r['agree']:6.3f}"
              + (f"  {r['prefix']:6d}" if a.free_run else ""))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
