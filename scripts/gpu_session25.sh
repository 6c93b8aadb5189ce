#!/usr/bin/env bash
# Session 25's follow-up GPU calls (each under the device's 10-minute limit; whole logs in $OUT):
#   p (~4 min): issue 15 -- the MoE grouped matmul at 8,192 tokens with gate and up stored apart
#     as the engine stores them (bench_moe.py gmm --pairs: `<kernel>_pair` one launch for both,
#     `<kernel>_split` two launches) beside the fused-weight figure: in session 25 the engine's
#     warm-up timed the warp-specialized kernel's pair at 5.2-6.3 ms per expert block while the
#     fused-weight bench gave 1.8 ms, so the warm-up chose ragged_dot_mgpu (2.95 ms);
#   m (~6 min): gpu_session18.sh i, now that int4's 1-row steps no longer fault (session 25 fix);
#   d (~5 min, an H200: the 61 GB of Qwen3-30B-A3B weights left too little of an H100 for the
#     bench's pool and step in session 25): gpu_moe.sh parts 2 and 3 (decode step, prefill MFU).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-}" in
  p) echo "== p. MoE grouped matmul, 8,192 tokens, engine-layout pairs"
     XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 ${T_GMM:-400} python3 scripts/bench_moe.py gmm \
       --random-shape qwen3-30b-a3b --tokens ${GMM_TOKENS:-8192} --pairs --output-json "$OUT/moe_gmm.json" \
       > "$OUT/moe_gmm.log" 2>&1; echo "rc=$?"
     grep "^T=" "$OUT/moe_gmm.log" | tr '|' '\n' ;;
  m) bash scripts/gpu_session18.sh i ;;
  d) MOE_PARTS="2 3" bash scripts/gpu_moe.sh ;;
  *) echo "usage: $0 p|m|d"; exit 2 ;;
esac
