#!/usr/bin/env bash
# Shorter device call: float32 parity and decode latency at batch 1 and 64 only.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== parity"; timeout -k 10 110 python3 scripts/gpu_parity.py --check scripts/data/smollm2_cpu_ids.json \
  --backends reference auto 2>&1 | tee "$OUT/parity.log" | tail -4
echo "== latency"; timeout -k 10 240 python3 scripts/bench_latency.py --random-shape llama3-8b --batch-size 1 64 \
  --input-len 2048 --num-iters 20 --max-num-batched-tokens 64 --output-json "$OUT/latency.json" \
  2>&1 | tee "$OUT/latency.log" | tail -7
