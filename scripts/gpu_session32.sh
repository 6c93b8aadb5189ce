#!/usr/bin/env bash
# Session 32's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   a (~8 min): issue 17's decode kernel on fp8 pages, B 64, context 2,048, Llama-3-8B heads
#     (scripts/check_mosaic_quant.py --formats fp8): bf16, fp8 Pallas, fp8 Mosaic (early / late V)
#     and mosaic_qk8, new in session 32 (`qk_fp8`: the query rounded to e4m3, the QK wgmma on
#     the K tile as copied, only V converted; target <= 0.55x bf16, 0.87x on session 24's H100).
#     Then decode batch 1, context 2,048, Llama-3-8B shape (scripts/gpu_session27.sh e): bf16
#     (split partials merged by kernels/split_combine.py, new in session 32: 426 kernels a step
#     compiled on the CPU instead of 492), bf16xc (XLA's merge, as before; #14: batch 1 <= 1.15x
#     the floor, 1.18x in session 9), fp8 (session 31's step-level choice of matmul paths), fp8ns
#     (without it; #17: fp8 <= 0.6x bf16).
#   b (~7 min, needs_h200): as scripts/gpu_session31.sh b (#15 MoE decode batch 1 / 64).
#   c (~6 min): session 31's a without what `a` ran: the fp8 8B batch-1 step's host launches
#     compiled on the CPU under the card's jax (do Mosaic custom calls join command buffers
#     there?), then int4 and fp8pallas decode batch 1 (#17: int4 <= 0.4x bf16).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-}" in
  a) echo "== q. Mosaic decode on fp8 pages, with and without the e4m3 query"
     MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 10 ${T_Q:-150} python3 scripts/check_mosaic_quant.py \
       --formats fp8 --json "$OUT/cmq.json" > "$OUT/cmq.log" 2>&1; echo "rc=$?"
     grep -o 'Used [0-9]* registers.*\|[0-9]* bytes spill.*' "$OUT/cmq.log" | sort | uniq -c | head -8
     grep -E "^(case|summary)" "$OUT/cmq.log"
     T_E=${T_E:-110} RUNS_E=${RUNS_E:-"bf16 bf16xc fp8 fp8ns"} bash scripts/gpu_session27.sh e ;;
  b) bash scripts/gpu_session31.sh b ;;
  c) T_E=${T_E:-120} RUNS_E=${RUNS_E:-"int4 fp8pallas"} bash scripts/gpu_session31.sh a ;;
  *) echo "usage: $0 a|b|c" >&2; exit 2 ;;
esac
