#!/usr/bin/env bash
# KV offload on one H200 (< 4 minutes): TTFT of a 16k-token Llama-3-8B-shape prompt (random
# weights) from the host tier vs recomputed, and restore bandwidth vs host-to-device copies.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/kvoffload_gpu.txt"
echo "== kv offload: 16k prompt, host tier vs recompute"
timeout 220 python3 scripts/bench_kvoffload.py --random-shape llama3-8b --input-len 16384 --chunk 4096 \
  --cpu-gib 8 --repeats 3 --output-json "$OUT/kvoffload.json" 2>&1 \
  | tee "$OUT/kvoffload.log" | tail -25
echo "rc=$?"
