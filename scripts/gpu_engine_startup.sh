#!/usr/bin/env bash
# One short device call: the engine's start-up on one H200 with DEFAULT settings (Llama-3-8B shape,
# dummy weights, max_num_batched_tokens by platform), with INFO logging on so the pool sizing, the
# prefill-kernel probe and the warm-up can be followed; then TTFT at 2,048 / 32,768 tokens and
# prefill 64 x 2,048 (scripts/bench_engine.py) if the warm-up finishes within T (default 290 s);
# then (HF=1) the same through HF transformers in this call, with the ratios.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
JAXLLM_PREFILL_KERNEL=${PREFILL_KERNEL:-auto} timeout -k 10 ${T:-290} python3 -c "
import logging, runpy, sys
logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s: %(message)s')
sys.argv = ['bench_engine.py', '--ttft-lens', '2048', '32768', '--reps', '2', '--prefill-batch', '64',
            '--prefill-len', '2048', '--num-prompts', '2', '--random-input-len', '32', '--random-output-len', '4',
            '--output-json', '$OUT/ttft_jax.json']
runpy.run_path('scripts/bench_engine.py', run_name='__main__')
" > "$OUT/ttft_jax.log" 2>&1; echo "rc=$?"
cut -c1-260 "$OUT/ttft_jax.log" | tail -40
# HF=1 (the default): the same TTFT and prefill calls through HF transformers (sdpa) in this call,
# so the "x faster than HF" figures of issue 14 come from one run (T_HF seconds, default 150).
if [ "${HF:-1}" = 1 ]; then
  timeout -k 10 ${T_HF:-150} python3 scripts/bench_engine.py --peer hf --ttft-lens 2048 32768 --reps 2 \
    --prefill-batch 64 --prefill-len 2048 --output-json "$OUT/ttft_hf.json" > "$OUT/ttft_hf.log" 2>&1
  echo "hf rc=$?"
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name + ".json")))
    except Exception as e:  # noqa: BLE001 - a part that did not finish
        return {"error": repr(e)}
j, h = load("ttft_jax"), load("ttft_hf")
for n in (2048, 32768):
    a, b = j.get(f"ttft_{n}", {}), h.get(f"ttft_{n}", {})
    if "ttft_s" in a and "ttft_s" in b:
        print(f"TTFT {n}: jaxllm {a['ttft_s'] * 1e3:.1f} ms ({a['x_floor']:.2f}x floor), HF {b['ttft_s'] * 1e3:.1f} ms: "
              f"jaxllm {b['ttft_s'] / a['ttft_s']:.2f}x faster")
a, b = j.get("prefill", {}), h.get("prefill", {})
if "tokens_per_s" in a and "tokens_per_s" in b:
    print(f"prefill 64x2048: jaxllm {a['tokens_per_s']:.0f} tok/s (MFU {a['mfu_measured']:.2f}), HF {b['tokens_per_s']:.0f}: "
          f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x")
PY
fi
