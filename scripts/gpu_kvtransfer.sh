#!/usr/bin/env bash
# P/D transfer on one H200 (< 4 minutes): two Llama-3-8B-shape engines (dummy weights) in one
# process, producer and consumer over jax.experimental.transfer; pull time per 1k tokens of KV,
# consumer TTFT with the pull vs recomputed, pull bandwidth vs a device-to-device copy, and the
# consumer's decode ITL p50/p99 with prefills in the same engine vs prefilled by the producer.
# CPU smoke run: SHAPE=tiny INPUT_LEN=512 CHUNK=128 PY=.venv/bin/python bash scripts/gpu_kvtransfer.sh
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== kv transfer: ${INPUT_LEN:-4096}-token prompts, pulled vs recomputed; decode ITL"
timeout ${LIMIT:-225} "$PY" scripts/bench_kvtransfer.py --random-shape "${SHAPE:-llama3-8b}" \
  --input-len "${INPUT_LEN:-4096}" --chunk "${CHUNK:-2048}" --repeats 3 \
  --itl-streams 8 --itl-tokens 64 --itl-arrivals 4 --output-json "$OUT/kvtransfer.json" 2>&1 \
  | tee "$OUT/kvtransfer.log" | tail -25
echo "rc=$?"
