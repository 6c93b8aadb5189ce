#!/usr/bin/env bash
# Session 25's follow-up GPU calls (each under the device's 10-minute limit; whole logs in $OUT):
#   p (~4 min): issue 15 -- the MoE grouped matmul at 8,192 tokens with gate and up stored apart
#     as the engine stores them (bench_moe.py gmm --pairs: `<kernel>_pair` one launch for both,
#     `<kernel>_split` two launches) beside the fused-weight figure: in session 25 the engine's
#     warm-up timed the warp-specialized kernel's pair at 5.2-6.3 ms per expert block while the
#     fused-weight bench gave 1.8 ms, so the warm-up chose ragged_dot_mgpu (2.95 ms);
#   q (~4 min): issue 17 -- fp8 W8A8 at 8,192 tokens: jaxllm's warp-specialized GEMM with the
#     scales fused (kernels/fp8_gemm_ws.py, new, CPU-checked) beside XLA's fp8 GEMM and torch
#     `_scaled_mm` (target >= 1,300 TFLOP/s); if it wins, route prefill-sized fp8 steps to it;
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
  q) echo "== q. fp8 W8A8 GEMM at 8,192 tokens"
     timeout -k 10 ${T_Q:-300} python3 scripts/bench_quant.py matmul --modes fp8 --tokens 8192 \
       --paths xla ws --json "$OUT/quant_fp8_gemm.json" > "$OUT/quant_fp8_gemm.log" 2>&1; echo "rc=$?"
     sed -n '/^summary/,$p' "$OUT/quant_fp8_gemm.log" | tail -40; grep -i -e error -e Traceback "$OUT/quant_fp8_gemm.log" | head -5 ;;
  m) bash scripts/gpu_session18.sh i ;;
  d) MOE_PARTS="2 3" bash scripts/gpu_moe.sh ;;
  *) echo "usage: $0 p|q|m|d"; exit 2 ;;
esac
