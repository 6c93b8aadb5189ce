#!/usr/bin/env bash
# One device call: the engine end to end on one GPU (two for the tp parity at the end).
# Decode latency of the Llama-3-8B shape at batch 1/8/64 vs the bandwidth floor, profiled, with
# the HF + torch.compile peer at batch 1 in the same process; offline throughput 512 x (512 -> 256)
# with the HF peer; both with overlapped steps (async scheduling) on and off on the same engine;
# float32 parity with the stored CPU ids, and tp=2 vs tp=1 where 2 GPUs exist (unless SKIP_TP).
# Each part has its own time limit so one failure costs little. Results land in $OUT (or ./out).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
# JAX takes 45% of GPU 0 so the HF peer fits beside it in the same process.
export CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
echo "== latency"; timeout -k 10 ${T1:-200} python3 scripts/bench_latency.py --random-shape llama3-8b \
  --batch-size 1 8 64 --input-len 2048 --num-iters 20 --max-num-batched-tokens 64 --profile-steps ${PROF:-3} \
  --async-scheduling on off --hf --hf-batch-size 1 --output-json "$OUT/latency.json" 2>&1 | tail -14
echo "== throughput"; timeout -k 10 ${T2:-230} python3 scripts/bench_throughput.py --random-shape llama3-8b \
  --dtype bfloat16 --num-prompts 512 --input-len 512 --output-len 256 --max-num-seqs 256 \
  --max-num-batched-tokens 2048 --token-buckets 256 2048 --seq-buckets 256 --hf --hf-batch 64 \
  --async-scheduling on off --output-json "$OUT/throughput.json" 2>&1 | tail -5
echo "== parity"; timeout -k 10 ${T3:-50} python3 scripts/gpu_parity.py --check scripts/data/smollm2_cpu_ids.json \
  --backends auto 2>&1 | tee "$OUT/parity.log" | tail -2
unset CUDA_VISIBLE_DEVICES; export XLA_PYTHON_CLIENT_MEM_FRACTION=0.6
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && [ -z "${SKIP_TP:-}" ]; then
  echo "== tp parity"; timeout -k 10 ${T4:-80} python3 scripts/gpu_tp_parity.py --tp 1 2 --shapes smollm2-like \
    2>&1 | tee "$OUT/tp_parity.log" | tail -3
fi
