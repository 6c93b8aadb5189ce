#!/usr/bin/env bash
# Session 27's GPU calls (each under the device's 10-minute limit; whole logs in $OUT):
#   a (~1.5 min): the fused per-token fp8 quantization (kernels/act_quant.py: RMSNorm + quantize,
#     silu(gate) * up + quantize, one Triton kernel each) against XLA's kernels for the same ops,
#     16,384 / 64 / 1 rows, Llama-3-8B widths, with the bytes floor (scripts/bench_act_quant.py);
#     silu*mul also with y held in bf16 and 8 warps (at 1.59x its floor on session 27's H100, the
#     float32 row over 16 warps is probably one program an SM).
#   f (~8 min): issue 17 -- engine prefill 8 x 2,048, Llama-3-8B shape, bf16 and `--quantization
#     fp8` in ONE call (target fp8 >= 1.5x bf16), now with the fused quantization feeding every
#     fp8 linear. Runs: bf16; fp8ws (the ws GEMM forced, no start-up GEMM timing: session 26's
#     way); fp8 (default: the start-up times XLA's GEMM, now unautotuned, against the kernel;
#     session 27's H100 did not finish that in 300 s before the change). RUNS may add
#     "fp8unfused" (JAXLLM_ACT_QUANT=xla) and "fp8apart" (JAXLLM_FUSE_FP8=0: q/k/v and gate/up
#     apart; fused is the default since session 28).
#   af: a then f in one call.
#   e (~3 min): issue 17 -- decode step batch 1, context 2,048, Llama-3-8B shape: bf16, fp8 (q/k/v
#     and gate/up fused, the default since session 28), fp8apart (JAXLLM_FUSE_FP8=0: session 28's
#     H100 gave 1.28x bf16, 2.55 ms a step in XLA's concatenation of gate and up); target
#     fp8 <= 0.6x bf16. RUNS_E may add "int4" (target <= 0.4x; session 25's H100: 0.87x, its wall
#     2.4 ms over its GPU time: launch-bound) and any run suffixed "cb" (e.g. "fp8cb", "int4cb"):
#     the same with XLA's command buffers (CUDA graphs) over the custom calls too. Session 29:
#     "fp8pallas" / "int4pallas" (JAXLLM_DECODE_MATMUL=pallas: the Triton decode matmuls only,
#     which XLA can put in command buffers, where Mosaic custom calls split them), "fp8mosaic",
#     "int4nk" (Mosaic only), "int4apart" (JAXLLM_FUSE_INT=0: int q/k/v and gate/up apart), and
#     any run suffixed "nocb" (e.g. "bf16nocb"): XLA's command buffers off; "sb" before it (e.g.
#     "bf16sb", "fp8sb"): JAXLLM_STABLE_BATCH=1 (the layers read a copy of the batch the step makes).
#     Session 31: any run suffixed "ns" (e.g. "fp8ns"): JAXLLM_STEP_CHOICE=0 (no step-level choice
#     between measured and graphable matmul paths, quantization/step_choice.py). Session 32: "xc"
#     before it (e.g. "bf16xc", "fp8xcns"): JAXLLM_DECODE_COMBINE=xla (split partials merged by
#     XLA's three kernels a layer, not kernels/split_combine.py's one).
#   s, d, g, q, p, m: as scripts/gpu_session26.sh.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
bw() { case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H100*) echo 3.35e12 ;; *) echo 4.8e12 ;; esac; }
case "${1:-}" in
  a) timeout -k 10 ${T_A:-150} python3 scripts/bench_act_quant.py --bw "$(bw)" --output-json "$OUT/act_quant.json" \
       > "$OUT/act_quant.log" 2>&1; echo "rc=$?"; grep -E "^device|^\{" "$OUT/act_quant.log"; tail -3 "$OUT/act_quant.log" | cut -c1-600 ;;
  f) for run in ${RUNS:-bf16 fp8ws fp8}; do
       q=""; [ "$run" != bf16 ] && q="--quantization fp8"
       case "$run" in fp8unfused) env="JAXLLM_ACT_QUANT=xla" ;; fp8ws) env="JAXLLM_FP8_GEMM=fg_128x256x128s3b8" ;;
         fp8apart) env="JAXLLM_FUSE_FP8=0" ;; *) env="" ;; esac
       echo "== f. prefill 8 x 2048, $run"
       env $env timeout -k 10 ${T_F:-240} python3 scripts/bench_engine.py --random-shape llama3-8b --parts prefill \
         --prefill-batch 8 --prefill-len 2048 $q --output-json "$OUT/prefill_$run.json" > "$OUT/prefill_$run.log" 2>&1
       echo "rc=$?"; grep -E "^== (prefill|init)|fp8 W8A8 prefill-sized|timed in|chosen in|ready|Error" "$OUT/prefill_$run.log" | cut -c1-900
     done ;;
  af) bash "$0" a; bash "$0" f ;;
  e) for run in ${RUNS_E:-bf16 fp8 fp8apart}; do
       r=${run%ns}; ns=""; [ "$r" != "$run" ] && ns="JAXLLM_STEP_CHOICE=0"  # "...ns": no step-level choice
       r0=$r; r=${r%xc}; [ "$r" != "$r0" ] && ns="$ns JAXLLM_DECODE_COMBINE=xla"  # "...xc": XLA's split merge
       mode=${r%nocb}; mode=${mode%cb}; sb=""; [ "${mode%sb}" != "$mode" ] && { mode=${mode%sb}; sb="JAXLLM_STABLE_BATCH=1"; }
       q=""; case "$mode" in bf16) ;; int4*) q="--quantization int4" ;; *) q="--quantization fp8" ;; esac
       env=""; [ "$mode" = fp8apart ] && env="JAXLLM_FUSE_FP8=0"
       case "$mode" in *pallas) env="JAXLLM_DECODE_MATMUL=pallas" ;; *mosaic) env="JAXLLM_DECODE_MATMUL=mosaic" ;;
         int4nk) env="JAXLLM_DECODE_MATMUL=mosaic_nk" ;; int4apart) env="JAXLLM_FUSE_INT=0" ;; esac
       case "$r" in *nocb) flags="--xla_gpu_enable_command_buffer=" ;;  # none: every kernel its own launch
         *cb) flags="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1" ;;
         *) flags="" ;; esac
       echo "== e. decode step batch 1, context 2048, $run"
       env $env $sb $ns XLA_FLAGS="$flags" XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout -k 10 ${T_E:-170} python3 scripts/bench_latency.py \
         --random-shape llama3-8b --input-len 2048 --num-iters 10 --max-num-batched-tokens 64 --batch-size 1 $q \
         --profile-steps 3 --output-json "$OUT/latency_b1_$run.json" > "$OUT/latency_b1_$run.log" 2>&1
       echo "rc=$?"; grep -A4 "^C = " "$OUT/latency_b1_$run.log" | cut -c1-300; grep -iE "busy|kernels|chosen in" "$OUT/latency_b1_$run.log" | cut -c1-600 | head -4
       grep -E "decode steps, matmul paths|graphable paths did not" "$OUT/latency_b1_$run.log" | cut -c1-700
     done ;;
  *) bash scripts/gpu_session26.sh "$@" ;;
esac
