#!/usr/bin/env bash
# TTFT of one prompt (2,048 / 8,192 / 32,768 tokens) and prefill throughput (64 x 2,048) on one
# H200, Llama-3-8B shape, dummy weights, default engine settings, against the FLOP floor measured
# in the same run (< 5 minutes); then TTFT at 2,048 again in its own process with buckets from
# MIN2 tokens measured for the Mosaic prefill kernel (JAXLLM_MOSAIC_MIN_TOKENS; default 1,024:
# prefill_choice.measured_choice keeps Mosaic where >= 1.15x faster). The log's "prefill/mixed
# attention" lines give each bucket's measured times and choice.
# Figures: $OUT/ttft_default.json, $OUT/ttft_min$MIN2.json.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== defaults"
timeout -k 10 ${T1:-200} python3 scripts/bench_engine.py --random-shape llama3-8b --parts ttft prefill \
  --ttft-lens 2048 8192 32768 --output-json "$OUT/ttft_default.json" > "$OUT/ttft_default.log" 2>&1
echo "rc $?"; grep -E "^== |prefill/mixed kernel|prefill/mixed attention|warm" "$OUT/ttft_default.log" | cut -c1-300
MIN2=${MIN2:-2048}
echo "== JAXLLM_MOSAIC_MIN_TOKENS=$MIN2"
JAXLLM_MOSAIC_MIN_TOKENS=$MIN2 timeout -k 10 ${T2:-150} python3 scripts/bench_engine.py --random-shape llama3-8b \
  --parts ttft --ttft-lens 2048 --output-json "$OUT/ttft_min$MIN2.json" > "$OUT/ttft_min$MIN2.log" 2>&1
echo "rc $?"; grep -E "^== |prefill/mixed kernel|prefill/mixed attention|warm" "$OUT/ttft_min$MIN2.log" | cut -c1-300
for f in "$OUT"/ttft_*.log; do echo "$f: $(grep -c "Can't reduce memory use" "$f") XLA memory warnings"; done
