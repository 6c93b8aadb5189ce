#!/usr/bin/env bash
# One device call: engine end to end on the GPU. Results land in $OUT (or ./out).
# float32 parity with the CPU ids, decode latency vs the bandwidth floor (+ HF peer),
# offline throughput. Each part has its own time limit so one failure costs little.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.6
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
echo "== parity"; timeout 120 python3 scripts/gpu_parity.py --check scripts/data/smollm2_cpu_ids.json \
  --backends reference auto 2>&1 | grep -v -i warn | tee "$OUT/parity.log" | tail -4
echo "== latency"; timeout 190 python3 scripts/bench_latency.py --random-shape llama3-8b --batch-size 1 8 64 \
  --input-len 2048 --num-iters 20 --max-num-batched-tokens 64 --output-json "$OUT/latency.json" \
  2>&1 | tee "$OUT/latency.log" | tail -8
echo "== throughput"; timeout 160 python3 scripts/bench_throughput.py --random-shape llama3-8b --dtype bfloat16 \
  --num-prompts 512 --input-len 512 --output-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 \
  --token-buckets 256 2048 --seq-buckets 256 --output-json "$OUT/throughput.json" \
  2>&1 | tee "$OUT/throughput.log" | tail -5
echo "== hf peer"; timeout 110 python3 -c "
import sys, json; sys.path.insert(0, 'scripts')
from bench_latency import hf_decode
from shapes import LLAMA3_8B
print(json.dumps({'hf_batch1_ctx2048_step_s': hf_decode(LLAMA3_8B, 1, 2048)}))" 2>&1 | tee "$OUT/hf.log" | tail -3
