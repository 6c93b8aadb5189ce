#!/usr/bin/env bash
# KV offload on one H200 (< 6 minutes): TTFT of a 16k-token Llama-3-8B-shape prompt (dummy
# weights) from the host tier (asynchronous load, and inline) vs recomputed, each repeat a
# fresh prompt restored wholly from the host tier, with where the restore's time went; the
# same restore with another prompt's saves in flight; the stall of 4 decoding streams; and
# restore bandwidth vs host-to-device copies of the same bytes. Once per host-tier memory
# (PIN="on off": pinned host memory, the default, then numpy), each in its own process.
# CPU smoke run: SHAPE=tiny INPUT_LEN=512 CHUNK=128 CPU_GIB=0.05 PY=.venv/bin/python bash scripts/gpu_kvoffload.sh
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/kvoffload_gpu.txt"
for pin in ${PIN:-on off}; do
  echo "== kv offload: ${INPUT_LEN:-16384}-token prompt, host tier (pinned $pin) vs recompute"
  timeout -k 10 ${LIMIT:-170} "$PY" scripts/bench_kvoffload.py --random-shape "${SHAPE:-llama3-8b}" \
    --input-len "${INPUT_LEN:-16384}" --chunk "${CHUNK:-2048}" --cpu-gib "${CPU_GIB:-8}" --repeats 3 \
    --pin-host-memory $pin --output-json "$OUT/kvoffload_pin_$pin.json" 2>&1 \
    | tee "$OUT/kvoffload_pin_$pin.log" | tail -12
  echo "rc=$?"
done
