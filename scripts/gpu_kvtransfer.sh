#!/usr/bin/env bash
# P/D transfer on one H200 (< 4 minutes): two Llama-3-8B-shape engines (random weights) in one
# process, producer and consumer over jax.experimental.transfer; pull time per 1k tokens of KV,
# consumer TTFT with the pull vs recomputed, pull bandwidth vs a device-to-device copy.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== kv transfer: 4k prompt, pulled vs recomputed"
timeout 220 python3 scripts/bench_kvtransfer.py --random-shape llama3-8b --input-len 4096 --chunk 2048 \
  --repeats 3 --output-json "$OUT/kvtransfer.json" 2>&1 \
  | tee "$OUT/kvtransfer.log" | tail -20
echo "rc=$?"
