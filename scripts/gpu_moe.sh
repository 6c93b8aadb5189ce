#!/usr/bin/env bash
# MoE on one H200 (< 8 minutes): (1) the grouped matmul of one Qwen3-30B-A3B layer (128 experts,
# top-8, hidden 2048, expert intermediate 768, bf16) at 1, 64, 512, 8192 tokens: XLA ragged_dot,
# JAX's bundled ragged_dot_mgpu (3 tilings), jaxllm's decode kernels (up to 512 tokens): the
# Triton one (kernels/moe_gmm.py, 4 tilings `decode_*`) and its Mosaic GPU twin
# (kernels/moe_gmm_mosaic.py, 3 tilings `mosaic_*`), a gather of each row's expert, torch _grouped_mm
# (eager and CUDA graph), each checked against ragged_dot first (a wrong variant is reported,
# not timed), then timed over 16 routings in turn (experts from HBM, not L2) against the
# touched-bytes floor from the copy bandwidth measured in the same process; (2) the engine's decode step, Qwen3-30B-A3B shape (random bf16 weights drawn
# on the device), context 2048, batch 1 and 64, against (non-expert weights + distinct experts
# touched + K/V) / copy bandwidth, printing the touched-expert count and the grouped-matmul
# implementation the engine picked by measurement. Results: $OUT/moe_gmm.json, $OUT/moe_decode.json
# and $OUT/moe.txt; whole logs
# (nothing filtered) in $OUT/moe_gmm.log and moe_decode.log.
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
{
  echo "== grouped matmul, one Qwen3-30B-A3B layer"
  timeout ${T1:-200} python3 scripts/bench_moe.py gmm --tokens 1 64 512 8192 \
    --output-json "$OUT/moe_gmm.json" > "$OUT/moe_gmm.log" 2>&1 || echo "gmm: failed or timed out ($?)"
  tail -12 "$OUT/moe_gmm.log"
  echo "== decode step, qwen3-30b-a3b shape, ctx 2048"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout ${T2:-240} python3 scripts/bench_moe.py decode \
    --random-shape qwen3-30b-a3b --batch-size 1 64 --input-len 2048 --num-iters 20 \
    --output-json "$OUT/moe_decode.json" > "$OUT/moe_decode.log" 2>&1 || echo "decode: failed or timed out ($?)"
  tail -8 "$OUT/moe_decode.log"
} | tee "$OUT/moe.txt"
