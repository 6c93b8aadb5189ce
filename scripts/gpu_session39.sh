#!/usr/bin/env bash
# Session 39's GPU call (the device's 10-minute limit; whole logs in $OUT):
#   v (~7 min, any Hopper card): the warm-up's choices by measurement now time decode-sized calls
#     over weights (dense gemv, quantized matmuls) or routings (MoE grouped matmul) in turn, more
#     bytes than the L2 holds (`timing.turns`), and the defaults are now a split cap of 32 and
#     `rope_write` for models with head norms (session 39's first calls, H100). Runs: the
#     Qwen3-30B-A3B batch-1 step in its bucket of two tokens with the new defaults (session 39's H100
#     before: 4.33 ms with XLA's dense dots and the direct down launch, 5.18 ms when the warm-up
#     chose gemv from L2-resident timings); then issue 17's Llama-3-8B batch-1 step, bf16 and fp8
#     (`scripts/gpu_session27.sh e`: fp8 / bf16 <= 0.6; 0.726 before on session 39's H100).
#   m (~2.5 min): v's first run alone (the MoE batch-1 step with the new defaults).
#   k (~7 min): `gpu_session38.sh k` (issue 17: batch 64, fp8 weights + fp8 KV against bf16; 0.814
#     and 1.65x its floor on session 39's H100) with two profiled steps each: where the fp8 step's
#     time over its floor goes (the fp8 KV decode kernel, the fp8 matmuls, the rest).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "${1:-}" in
  v|m) XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95} timeout -k 5 ${T_B:-140} python3 scripts/bench_moe.py decode \
       --random-shape qwen3-30b-a3b --batch-size 1 --min-bucket 2 --input-len 2048 --num-iters 20 \
       --profile-steps 2 --output-json "$OUT/b1_moe.json" > "$OUT/b1_moe.log" 2>&1
     echo "rc=$? (Qwen3-30B-A3B batch 1, defaults)"
     grep -E "^decode|^  /device|^    |kernels a step" "$OUT/b1_moe.log" | cut -c1-700
     grep -E "dense linears at|dense linears' timings|grouped matmul by measurement|grouped matmul timings" \
       "$OUT/b1_moe.log" | cut -c1-1500
     if [ "$1" = v ]; then RUNS_E=${RUNS_E:-"bf16 fp8"} T_E=${T_E:-140} bash scripts/gpu_session27.sh e; fi ;;
  k) PROF_K=2 T_Q=${T_Q:-200} bash scripts/gpu_session38.sh k ;;
  *) echo "usage: $0 v|m|k" >&2; exit 2 ;;
esac
