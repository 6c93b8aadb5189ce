#!/usr/bin/env bash
# Session 38's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   a (~6 min, any Hopper card): the Qwen3-30B-A3B batch-1 step in its bucket of two tokens (issue
#     15, target <= 1.5x the floor), three processes: the default (decode attention split up to
#     16 ways; the split merge now cut by query rows, `split_combine.chunk_rows`, 4 programs a
#     (token, KV head) where session 37 had one), JAXLLM_DECODE_MAX_SPLITS=32
#     (`decode_schedule.split_cap`: one token's 4 KV heads take 128 CTAs, not 64), and that with
#     JAXLLM_ROPE_WRITE=kernel (head norms, RoPE and the K/V write in one kernel, now over
#     (token, head group) programs). Before them, `check_moe_kernels.py --cases rope_write` times
#     the kernel against XLA's path alone. RUNS_A picks the runs (default "split16 split32 rope").
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "${1:-}" in
  a) timeout -k 5 ${T_K:-80} python3 scripts/check_moe_kernels.py --tokens 2 --cases rope_write \
       --json "$OUT/rope.json" > "$OUT/rope.log" 2>&1; echo "rc=$? (rope_write alone)"
     grep -E "^(floor|rope)" "$OUT/rope.log"
     for run in ${RUNS_A:-split16 split32 rope}; do
       env=""
       case "$run" in split32) env="JAXLLM_DECODE_MAX_SPLITS=32" ;;
         rope) env="JAXLLM_DECODE_MAX_SPLITS=32 JAXLLM_ROPE_WRITE=kernel" ;; esac
       env $env XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95} timeout -k 5 ${T_B:-150} \
         python3 scripts/bench_moe.py decode --random-shape qwen3-30b-a3b --batch-size 1 --min-bucket 2 \
         --input-len 2048 --num-iters 20 --profile-steps 2 --output-json "$OUT/b1_$run.json" > "$OUT/b1_$run.log" 2>&1
       echo "rc=$? ($run: $env)"
       grep -E "^decode|^  /device|^    |kernels a step" "$OUT/b1_$run.log" | cut -c1-700
     done ;;
  *) echo "usage: $0 a" >&2; exit 2 ;;
esac
