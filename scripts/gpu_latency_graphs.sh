#!/usr/bin/env bash
# One device call: Llama-3-8B-shape decode latency with the smallest token bucket at 16 (as the
# engine's defaults), HF + torch.compile batch 1 as the peer in the same process; then the same
# with XLA's command buffers (CUDA graphs) extended to custom calls (the Mosaic attention kernel).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
LAT="scripts/bench_latency.py --random-shape llama3-8b --batch-size 1 8 64 --input-len 2048 --num-iters 20
  --max-num-batched-tokens 64 --profile-steps 3 --min-bucket 1 --min-token-bucket 16"
echo "== default"; timeout -k 10 ${T1:-150} python3 $LAT --hf --hf-batch-size 1 --output-json "$OUT/latency.json" \
  2>&1 | tail -9
echo "== command buffers + custom calls"; XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1" \
  timeout -k 10 ${T2:-100} python3 $LAT --output-json "$OUT/latency_graphs.json" 2>&1 | tail -8
