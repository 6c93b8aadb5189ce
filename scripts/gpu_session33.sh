#!/usr/bin/env bash
# Session 33's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   a (~8 min): scripts/gpu_session32.sh a (issue 17's decode kernel on fp8 pages with the e4m3
#     query; the 8B batch-1 step with the one-kernel split merge against XLA's merge; fp8 steps).
#   b (~8 min, needs_h200): issue 15's MoE decode, Qwen3-30B-A3B shape, context 2,048: batch 1
#     and 64 with session 33's kernels (kernels/moe_router.py, the router in one kernel;
#     kernels/rope_write.py, the head norms, RoPE and K/V write in one; 924 -> 587 kernels a
#     batch-1 step compiled on the CPU; the warm-up also times the persistent direct grouped
#     matmul, direct_decode_128x64k4c528, against the others: its log line), then batch 1 again
#     with XLA's router and XLA's head norm / RoPE / scatter (JAXLLM_MOE_ROUTER=xla
#     JAXLLM_ROPE_WRITE=xla), in the same call. Target: batch 1 <= 1.5x the floor (4.14x in
#     session 26, before the direct grouped matmul, command buffers and these).
#   c (~6 min): scripts/gpu_session32.sh c (launch count under the card's jax; int4 / fp8pallas
#     decode batch 1).
#   k (~2 min, ~5 on an H200): scripts/check_moe_kernels.py alone, then on an H200 the MoE
#     batch-1 step with session 33's kernels.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
moe_decode() {  # $1: label, $2: batch sizes; env as given
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 ${T_G:-230} python3 scripts/bench_moe.py decode \
    --random-shape qwen3-30b-a3b --batch-size $2 --input-len 2048 --num-iters 20 --profile-steps 3 \
    --output-json "$OUT/moe_decode_$1.json" > "$OUT/moe_decode_$1.log" 2>&1; echo "rc=$? ($1)"
  grep -E "^decode|^  /device|kernels a step|router|grouped matmul" "$OUT/moe_decode_$1.log" | cut -c1-600
}
case "${1:-}" in
  a) bash scripts/gpu_session32.sh a ;;
  b) echo "== session 33's kernels against XLA's paths (scripts/check_moe_kernels.py)"
     timeout -k 10 ${T_K:-150} python3 scripts/check_moe_kernels.py --json "$OUT/moe_kernels.json" \
       > "$OUT/moe_kernels.log" 2>&1; echo "rc=$?"
     grep -E "^(floor|router|rope_write|gmm)" "$OUT/moe_kernels.log"
     echo "== MoE decode, router kernel (opt-in since session 34)"
     JAXLLM_MOE_ROUTER=kernel JAXLLM_ROPE_WRITE=kernel moe_decode router "${MOE_B:-1 64}"
     echo "== MoE decode, XLA's router, head norms, RoPE and scatter"
     JAXLLM_MOE_ROUTER=xla JAXLLM_ROPE_WRITE=xla moe_decode xla "1" ;;
  k) echo "== session 33's kernels against XLA's paths (scripts/check_moe_kernels.py)"
     timeout -k 10 ${T_K:-150} python3 scripts/check_moe_kernels.py --json "$OUT/moe_kernels.json" \
       > "$OUT/moe_kernels.log" 2>&1; echo "rc=$?"
     grep -E "^(floor|router|rope_write|gmm)" "$OUT/moe_kernels.log"
     grep -iE "wrong|failed|error" "$OUT/moe_kernels.log" | head -5 | cut -c1-400
     # then, on a card with the memory for Qwen3-30B-A3B (an H200), the batch-1 step with them
     mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
     if [ "${mem:-0}" -gt 100000 ]; then echo "== MoE decode batch 1"
       JAXLLM_MOE_ROUTER=kernel JAXLLM_ROPE_WRITE=kernel moe_decode router 1; fi ;;
  c) bash scripts/gpu_session32.sh c ;;
  *) echo "usage: $0 a|b|c|k" >&2; exit 2 ;;
esac
