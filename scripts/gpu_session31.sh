#!/usr/bin/env bash
# Session 31's GPU calls (the device's 10-minute limit each; whole logs in $OUT). Session 31 had
# ~20 minutes of device time after failed starts, so sessions 29-30's questions in two calls:
#   a (~8 min): under the GPU machine's jax (0.11.2), the fp8 Llama-3-8B batch-1 step compiled
#     on the CPU for an H100 (scripts/aot_kernels.py): how many host launches, i.e. do Mosaic GPU
#     custom calls join XLA's command buffers there (under 0.10.2 they do not: 480 launches,
#     bf16's 65); then issue 17's decode step batch 1, context 2,048, Llama-3-8B shape: bf16,
#     fp8 (paths by measurement, then the decode step compiled both ways and the faster kept:
#     quantization/step_choice.py, new in session 31; its log line says which), fp8ns (without
#     that step-level choice), fp8pallas (JAXLLM_DECODE_MATMUL=pallas: Triton matmuls only,
#     which XLA can graph), int4 (scripts/gpu_session27.sh e; targets fp8 <= 0.6x, int4 <= 0.4x).
#   b (~7 min, needs_h200): issue 15's MoE decode batch 1 and 64, Qwen3-30B-A3B shape, XLA's
#     default command buffers (scripts/gpu_session29.sh g, first configuration; target b1 <=
#     1.5x floor, 4.14x in session 26), then int4pallas.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-}" in
  a) echo "== k. --shape llama3-8b --quantization fp8 (jax $(python3 -c 'import jax; print(jax.__version__)'))"
     JAX_PLATFORMS=cpu timeout -k 10 ${T_K:-120} python3 scripts/aot_kernels.py --tokens 1 --shape llama3-8b \
       --quantization fp8 --top 12 > "$OUT/aot.log" 2>&1; echo "rc=$?"; grep "^{" "$OUT/aot.log" | cut -c1-1500
     grep -iE "error" "$OUT/aot.log" | tail -2 | cut -c1-300
     T_E=${T_E:-120} RUNS_E=${RUNS_E:-"bf16 fp8 fp8ns fp8pallas int4"} bash scripts/gpu_session27.sh e ;;
  b) echo "== g. MoE decode, XLA's default command buffers"
     XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 ${T_G:-200} python3 scripts/bench_moe.py decode \
       --random-shape qwen3-30b-a3b --batch-size 1 64 --input-len 2048 --num-iters 20 --profile-steps 3 \
       --output-json "$OUT/moe_decode.json" > "$OUT/moe_decode.log" 2>&1; echo "rc=$?"
     grep -E "^decode|^  /device|kernels a step" "$OUT/moe_decode.log" | cut -c1-400
     T_E=${T_E:-150} RUNS_E=${RUNS_E:-"int4pallas"} bash scripts/gpu_session27.sh e ;;
  *) echo "usage: $0 a|b" >&2; exit 2 ;;
esac
