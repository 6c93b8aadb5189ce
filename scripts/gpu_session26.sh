#!/usr/bin/env bash
# Session 26's follow-up GPU calls (each under the device's 10-minute limit; whole logs in $OUT):
#   f (~6 min): issue 17 -- engine prefill 8 x 2,048, Llama-3-8B shape, default settings, bf16 and
#     `--quantization fp8` in ONE call (the ratio within a call; target fp8 >= 1.5x bf16). fp8 now
#     takes the warp-specialized GEMM where the warm-up measured it faster than XLA's fp8 GEMM
#     (`quantization/choice.measure_gemm`, logged); session 26 measured 1.46-1.50x across calls.
#     RUNS adds "fp8xla" (JAXLLM_FP8_GEMM=xla: XLA's fp8 GEMM; its warm-up took > 265 s in session 26).
#   d (~5 min, an H200: needs_h200): issue 15 -- MoE decode step and prefill MFU (gpu_moe.sh parts
#     2 and 3), now with the ws kernel's gate/up as two launches among the warm-up's candidates
#     (`ws..._split`): in session 26 the one-launch pair lost (4.9-5.4 ms an expert block against
#     2.5 ms) and prefill MFU was 0.436 (target 0.5).
#   p (~4 min): issue 15 -- bench_moe.py gmm --pairs at 8,192 tokens: each kernel with gate and up
#     stored apart, one launch (`_pair`) and two (`_split`), beside the fused weight; the chained
#     ws tilings (`moe_gmm_ws.CHAINED`, bench only) are among the kernels.
#   q (~5 min): issue 17 -- the fp8 GEMM at 8,192 tokens again, now with the chained tilings
#     (`fp8_gemm_ws.CHAINED`: a CTA's tiles as one pipeline of pipelines), beside XLA and torch.
#   m (~6 min): gpu_session18.sh i (quantized decode steps' matmul sweep).
#   s (~6 min, an H200: needs_h200): issue 17 -- Llama-3-70B shape with fp8 weights on one GPU, decode
#     batch 1 at context 2,048 against its floor (target <= 1.25x). Dummy weights are now drawn and
#     quantized a layer at a time (`quantization.quantize.draw_quantized`): 141 GB of bf16 never
#     exist, ~70 GB of fp8 do.
#   g (~6 min, an H200: needs_h200): issue 15 -- MoE decode batch 1 is bound by the host launching
#     the step's 1,650 kernels (session 26's profile: the jitted call's host span ~6.6 ms a step under the profiler,
#     GPU busy 4.75 ms, step 7.0 ms): the decode step with XLA's command buffers extended to
#     custom calls (CUDA graphs over the Triton / Mosaic kernels too) beside the default flags.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-}" in
  f) for run in ${RUNS:-bf16 fp8}; do
       q=""; [ "$run" != bf16 ] && q="--quantization fp8"
       env=""; [ "$run" = fp8xla ] && env="JAXLLM_FP8_GEMM=xla"
       echo "== f. prefill 8 x 2048, $run"
       env $env timeout -k 10 ${T_F:-260} python3 scripts/bench_engine.py --random-shape llama3-8b --parts prefill \
         --prefill-batch 8 --prefill-len 2048 $q --output-json "$OUT/prefill_$run.json" > "$OUT/prefill_$run.log" 2>&1
       echo "rc=$?"; grep -E "^== (prefill|init)|fp8 W8A8 prefill-sized" "$OUT/prefill_$run.log" | cut -c1-900
     done ;;
  d) MOE_PARTS="3 2" bash scripts/gpu_moe.sh; grep -h "MoE grouped matmul" "$OUT"/moe_prefill.log | cut -c1-900 ;;
  p) bash scripts/gpu_session25.sh p ;;
  q) bash scripts/gpu_session25.sh q ;;
  m) bash scripts/gpu_session18.sh i ;;
  s) XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 10 ${T_S:-420} python3 scripts/bench_latency.py --random-shape llama3-70b \
       --quantization fp8 --input-len 2048 --batch-size 1 --num-iters 10 --max-num-batched-tokens 64 \
       --profile-steps 3 --output-json "$OUT/latency_70b_fp8.json" > "$OUT/latency_70b_fp8.log" 2>&1
     echo "rc=$?"; tail -25 "$OUT/latency_70b_fp8.log" | cut -c1-400 ;;
  g) for flags in "" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"; do
       echo "== g. MoE decode, XLA_FLAGS='$flags'"
       XLA_FLAGS="$flags" XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 ${T_G:-270} python3 scripts/bench_moe.py decode \
         --random-shape qwen3-30b-a3b --batch-size 1 64 --input-len 2048 --num-iters 20 --profile-steps 3 \
         --output-json "$OUT/moe_decode_g${#flags}.json" > "$OUT/moe_decode_g${#flags}.log" 2>&1; echo "rc=$?"
       grep -E "^decode|^  /device" "$OUT/moe_decode_g${#flags}.log"
     done ;;
  *) echo "usage: $0 f|d|p|q|m|s|g"; exit 2 ;;
esac
