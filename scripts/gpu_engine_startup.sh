#!/usr/bin/env bash
# One short device call: the engine's start-up on one H200 with DEFAULT settings (Llama-3-8B shape,
# dummy weights, max_num_batched_tokens by platform), with INFO logging on so the pool sizing, the
# prefill-kernel probe and the warm-up can be followed; then TTFT at 2,048 / 32,768 tokens and
# prefill 64 x 2,048 (scripts/bench_engine.py) if the warm-up finishes within T (default 290 s).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
JAXLLM_PREFILL_KERNEL=${PREFILL_KERNEL:-auto} timeout ${T:-290} python3 -c "
import logging, runpy, sys
logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s: %(message)s')
sys.argv = ['bench_engine.py', '--ttft-lens', '2048', '32768', '--reps', '2', '--prefill-batch', '64',
            '--prefill-len', '2048', '--num-prompts', '2', '--random-input-len', '32', '--random-output-len', '4',
            '--output-json', '$OUT/ttft_jax.json']
runpy.run_path('scripts/bench_engine.py', run_name='__main__')
" > "$OUT/ttft_jax.log" 2>&1; echo "rc=$?"
cut -c1-260 "$OUT/ttft_jax.log" | tail -40
