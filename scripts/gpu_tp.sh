#!/usr/bin/env bash
# One device call on a 2-GPU machine: decode latency of the Llama-3-8B shape at tp=1 (with the
# HF + torch.compile peer in the same process) and tp=2, every step profiled; the Llama-3-70B
# shape at tp=2, each with overlapped steps on and off (ASYNC); SKIP_TP1=1 leaves out tp=1; then
# (PARITY=1) tp=2 vs tp=1 float32 greedy parity. NVLink multicast stays off.
# Results land in $OUT (or ./out).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
LAT="scripts/bench_latency.py --input-len 2048 --num-iters 20 --max-num-batched-tokens 64 --profile-steps ${PROF:-3} --async-scheduling ${ASYNC:-on off}"
# JAX takes 45% of GPU 0 so the HF peer fits beside it. HF at batch 64 and context 2048 ran out
# of memory even so (its prefill materialises logits for every position): batch 1 only.
[ -z "${SKIP_TP1:-}" ] && echo "== 8b tp=1" && CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout -k 10 ${T1:-280} python3 $LAT \
  --random-shape llama3-8b --batch-size 1 8 64 --hf --hf-batch-size 1 \
  --output-json "$OUT/latency_8b_tp1.json" 2>&1 | tail -12
echo "== 8b tp=2"; XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout -k 10 ${T2:-120} python3 $LAT --random-shape llama3-8b \
  --batch-size 1 64 -tp 2 --output-json "$OUT/latency_8b_tp2.json" 2>&1 | tail -8
echo "== 70b tp=2"; XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 ${T3:-170} python3 $LAT --random-shape llama3-70b \
  --batch-size 1 64 -tp 2 --num-iters 10 --output-json "$OUT/latency_70b_tp2.json" 2>&1 | tail -8
if [ "${PARITY:-0}" = 1 ]; then
  echo "== parity tp"; timeout -k 10 150 python3 scripts/gpu_tp_parity.py --tp 1 2 2>&1 \
    | tee "$OUT/tp_parity.log" | tail -5
fi
