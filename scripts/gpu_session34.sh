#!/usr/bin/env bash
# Session 34's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   g (~5 min, any Hopper card): issue 15's grouped matmul at 8,192 tokens (65,536 rows), one
#     Qwen3-30B-A3B layer: the warp-specialized kernel on the fused gate/up weight
#     (ws128_256x64s3, session 25's best: 0.79x torch), as the engine calls it (weights apart:
#     `_pair` one launch, `_split` two), the new `wsglu*` tilings (gate, up and silu(gate) * up
#     in one launch, weights apart), Triton tiles128, and torch `_grouped_mm` (+ CUDA graph) in
#     the same process (target >= 1.2x torch); then scripts/check_moe_kernels.py (session 33's
#     router and rope_write kernels against XLA's paths, never run on a GPU before).
#   c (~6 min, any Hopper card): scripts/check_moe_choice.py --one-call (the engine warm-up's
#     grouped-matmul choice at 65,536 rows, timed chained and one call an execution), then the
#     8,192-token bench of ws128_256x64s3 and the wsglu128_128x64s4 tilings (chained one too)
#     against torch, whose loop now pays the same [M, H] pass.
#   d (~6 min, fits an H100 at batch 1): the MoE batch-1 decode step (Qwen3-30B-A3B, ctx 2,048)
#     with session 33's router / rope_write kernels (JAXLLM_MOE_ROUTER=kernel JAXLLM_ROPE_WRITE=kernel),
#     then with XLA's paths (the default since the `g` call found both kernels slower than XLA's
#     alone: router 10-31 us over the loop's cost against ~0), fewer kernels a step aside.
#   x (~9 min): on an H200, check_moe_choice.py (the warm-up's prefill choice after the gather fix),
#     the prefill MFU and the decode step batch 1 / 64; on a smaller card, `c`.
#   p (~9 min, an H200 best; needs_h200): MOE_PARTS="3 2" scripts/gpu_moe.sh: the engine's prefill
#     8 x 2,048 (MFU; the warm-up now measures the wsglu tilings too; 0.436 in session 26,
#     target >= 0.5), then its decode step batch 1 and 64 with session 33's kernels (batch 1
#     4.14x floor in session 26, target <= 1.5x).
#   t (~9 min, needs_h200): MOE_PARTS="4 5" scripts/gpu_moe.sh: offline throughput 512 x (512 ->
#     256) against HF transformers (grouped_mm experts), never run yet (target >= 3x).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
run_g() {
  echo "== grouped matmul, 8,192 tokens, one Qwen3-30B-A3B layer"
  timeout -k 10 ${T_G:-300} python3 scripts/bench_moe.py gmm --random-shape qwen3-30b-a3b --tokens 8192 \
    --impls ${IMPLS:-ws128_256x64s3 wsglu tiles128} $PAIRS --output-json "$OUT/moe_gmm.json" \
    > "$OUT/moe_gmm.log" 2>&1; echo "rc=$?"
  grep "^T=" "$OUT/moe_gmm.log" | cut -c1-1500
  python3 -c "
import json, sys
for row in json.load(open('$OUT/moe_gmm.json'))['rows']:
    for name, r in row.items():
        if isinstance(r, dict) and 'kernels_us' in r:
            print(name, 'GPU busy', round(r.get('gpu_busy_s', 0) * 1e6), 'us:', r['kernels_us'])
" | cut -c1-900
}
PAIRS=--pairs
case "${1:-}" in
  x) # one call: on an H200 the warm-up's prefill choice alone (after the gather fix), the prefill
     # MFU and the decode step (batch 1 and 64, XLA's router: the default); else `c`
     mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
     if [ "${mem:-0}" -gt 100000 ]; then
       echo "== the engine's choice at 8,192 tokens (scripts/check_moe_choice.py)"
       timeout -k 10 ${T_C:-120} python3 scripts/check_moe_choice.py > "$OUT/moe_choice.log" 2>&1
       echo "rc=$?"; grep '^{' "$OUT/moe_choice.log" | cut -c1-1500
       MOE_PARTS="3 2" T3=${T3:-200} T2=${T2:-200} bash scripts/gpu_moe.sh
       grep -E "grouped matmul by measurement|grouped matmul timings" "$OUT/moe_prefill.log" | cut -c1-1500
     else
       bash "$0" c
     fi ;;
  c) # (any Hopper card, ~6 min) the warm-up's grouped-matmul choice at 65,536 rows, chained and one
     # call an execution; then the bench against torch with the same loop on both sides
     echo "== the engine's choice at 8,192 tokens (scripts/check_moe_choice.py)"
     timeout -k 10 ${T_C:-280} python3 scripts/check_moe_choice.py --one-call > "$OUT/moe_choice.log" 2>&1
     echo "rc=$?"; grep '^{' "$OUT/moe_choice.log" | cut -c1-1500
     grep -iE "wrong|failed" "$OUT/moe_choice.log" | head -5 | cut -c1-300
     PAIRS="" IMPLS="ws128_256x64s3 wsglu128_128x64s4" T_G=${T_G:-170} run_g
     echo "== one moe.experts call profiled (scripts/profile_moe_experts.py)"
     timeout -k 10 ${T_P:-120} python3 scripts/profile_moe_experts.py 2>&1 | grep "wall/call" ;;
  g) T_G=${T_G:-300} run_g
     echo "== session 33's kernels against XLA's paths (scripts/check_moe_kernels.py)"
     timeout -k 10 ${T_K:-150} python3 scripts/check_moe_kernels.py --json "$OUT/moe_kernels.json" \
       > "$OUT/moe_kernels.log" 2>&1; echo "rc=$?"
     grep -E "^(floor|router|rope_write|gmm)" "$OUT/moe_kernels.log"
     grep -iE "wrong|failed|error" "$OUT/moe_kernels.log" | head -5 | cut -c1-400 ;;
  d) for v in kernel xla; do  # the batch-1 step: session 33's kernels, then XLA's router / RoPE (default)
       export JAXLLM_MOE_ROUTER=$v JAXLLM_ROPE_WRITE=$v
       XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95} timeout -k 10 ${T_D:-200} python3 scripts/bench_moe.py decode \
         --random-shape qwen3-30b-a3b --batch-size ${MOE_B:-1} --input-len 2048 --num-iters 20 --profile-steps 3 \
         --output-json "$OUT/moe_decode_$v.json" > "$OUT/moe_decode_$v.log" 2>&1; echo "rc=$? ($v)"
       grep -E "^decode|^  /device|kernels a step|by measurement" "$OUT/moe_decode_$v.log" | cut -c1-600
     done ;;
  p) MOE_PARTS="3 2" T3=${T3:-260} T2=${T2:-260} bash scripts/gpu_moe.sh
     grep -E "grouped matmul by measurement|grouped matmul timings" "$OUT/moe_prefill.log" | cut -c1-1200 ;;
  t) MOE_PARTS="4 5" T4=${T4:-270} T5=${T5:-270} bash scripts/gpu_moe.sh ;;
  *) echo "usage: $0 c|g|d|p|t|x" >&2; exit 2 ;;
esac
