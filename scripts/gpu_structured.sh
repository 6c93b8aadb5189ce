#!/usr/bin/env bash
# Structured outputs on one H200 (< 3 minutes): 64 JSON-schema requests vs 64 unconstrained on one
# engine, Llama-3-8B shape with dummy weights (bf16), same prompts and sampling; prints and writes
# $OUT/structured.json: the output throughput ratio (target >= 0.95), the host's bitmask time per
# step against the step time, and the test schema's grammar compile time (first and cached).
# llguidance is not on the H200 image: run scripts/fetch_wheels.sh here first and carry ".whl".
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -c "import llguidance" 2>/dev/null; then
  if ls .whl/llguidance-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/llguidance-*.whl && export PYTHONPATH=$PWD:/tmp/site || { echo "llguidance install failed"; exit 1; }
  else
    echo "llguidance missing: run scripts/fetch_wheels.sh on the host and carry .whl" | tee "$OUT/structured.txt"
    exit 1
  fi
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
echo "== structured outputs: json schema vs unconstrained, llama3-8b shape"
timeout -k 10 ${T1:-170} python3 scripts/bench_structured.py --random-shape llama3-8b --load-format dummy \
  --dtype bfloat16 --num-prompts 64 --input-len 64 --output-len 128 --max-num-seqs 64 \
  --max-model-len 2048 --max-num-batched-tokens 2048 --token-buckets 64 2048 --seq-buckets 64 \
  --rounds 2 --output-json "$OUT/structured.json" 2>&1 | tee "$OUT/structured.txt" | tail -8
