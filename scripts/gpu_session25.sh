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
#   f (~6 min): issue 17 -- engine prefill 8 x 2,048, Llama-3-8B shape, default settings: bf16,
#     fp8 weights (XLA's fp8 GEMM), fp8 weights with JAXLLM_FP8_GEMM=$FG (the kernel above);
#     target: fp8 >= 1.5x bf16 tokens/s;
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
  f) for run in bf16 fp8 fp8ws; do
       q=""; [ "$run" != bf16 ] && q="--quantization fp8"
       env=""; [ "$run" = fp8ws ] && env="JAXLLM_FP8_GEMM=${FG:-fg_128x256x128s3b8}"
       echo "== f. prefill 8 x 2048, $run"
       env $env timeout -k 10 ${T_F:-170} python3 scripts/bench_engine.py --random-shape llama3-8b --parts prefill \
         --prefill-batch 8 --prefill-len 2048 $q --output-json "$OUT/prefill_$run.json" > "$OUT/prefill_$run.log" 2>&1
       echo "rc=$?"; grep -E "^== (prefill|init)" "$OUT/prefill_$run.log" | cut -c1-600
     done ;;
  m) bash scripts/gpu_session18.sh i ;;
  d) MOE_PARTS="2 3" bash scripts/gpu_moe.sh ;;
  *) echo "usage: $0 p|q|f|m|d"; exit 2 ;;
esac
