#!/usr/bin/env bash
# One short device call on a 2-GPU machine: Llama-3-8B-shape decode latency (bf16, context 2048,
# async scheduling on, 3 profiled steps each) at tp=1 (batch 1/8/64) and tp=2 (batch 1/64).
# For re-measuring a kernel or engine change without the HF peers. Results land in $OUT.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LAT="scripts/bench_latency.py --random-shape llama3-8b --input-len 2048 --num-iters 20 --max-num-batched-tokens 64 --profile-steps 3"
echo "== 8b tp=1"; CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout -k 10 ${T1:-200} python3 $LAT \
  --batch-size 1 8 64 --output-json "$OUT/latency_8b_tp1.json" 2>&1 | tail -9
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "== 8b tp=2"; XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout -k 10 ${T2:-160} python3 $LAT --batch-size 1 64 -tp 2 \
    --output-json "$OUT/latency_8b_tp2.json" 2>&1 | tail -8
fi
