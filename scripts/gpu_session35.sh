#!/usr/bin/env bash
# Session 35's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   a (~8 min, any Hopper card; fits an H100 since the per-layer split goes through host memory
#     when the card lacks room for a second copy of a stack, and the bench's random pages are
#     aliased to the pool): issue 15's MoE decode step (Qwen3-30B-A3B, context 2,048, batch 1
#     and 64) against its touched-bytes floor, then the grouped matmul's chained slot-space
#     tiling checked on a GPU at 512 tokens (CTAs with a lone tile: the case fixed in session 34)
#     and timed at 8,192 against its unchained twin and torch.
#   b (~6 min, on the machine `a` left warm): the lone-tile check again (cached compiles), then the
#     MoE prefill 8 x 2,048 (MFU) with the chained tiling among the warm-up's candidates where
#     the check found it right, else without (JAXLLM_GMM_CHAINED=0). Since session 35's calls
#     the engine measures it by default; call 4's run without it: JAXLLM_GMM_CHAINED=0
#     MOE_PARTS=3 bash scripts/gpu_moe.sh.
#   ab (~9 min, one call): a's decode step, then b (the lone-tile check and the prefill), without
#     a's 8,192-token bench.
#   d (~7 min): the MoE batch-1 decode step profiled in the bucket of 8 tokens (as the engine's
#     default buckets ran it then: the warm-up's grouped-matmul choice weighs 64 real rows and 8)
#     and in a bucket of its own (8 rows: the direct kernels, no sort; the engine's default for
#     MoE models on a GPU since), then the lone-tile check.
#   p: `gpu_session34.sh p` (the prefill MFU and the decode step; 0.498 MFU on an H100 here).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
lone() {  # the chained slot-space tilings where CTAs hold one tile: 4 experts, top-1, 1,100 tokens
  # (~275 rows an expert: 144 glu and 96 down tiles on 132 CTAs); checked against ragged_dot
  echo "== grouped matmul where CTAs hold a lone tile (chained tilings and their unchained twins)"
  timeout -k 10 ${T_L:-120} python3 scripts/bench_moe.py gmm --random-shape qwen3-30b-a3b --experts 4 --top-k 1 \
    --tokens 1100 --impls wsglu128_128x64s4 --output-json "$OUT/moe_gmm_lone.json" \
    > "$OUT/moe_gmm_lone.log" 2>&1; echo "rc=$?"
  grep -E "^T=|wrong" "$OUT/moe_gmm_lone.log" | cut -c1-1500
}
case "${1:-}" in
  a) MOE_PARTS="2" T2=${T2:-280} bash scripts/gpu_moe.sh
     grep -iE "can't reduce|out of memory|RESOURCE_EXHAUSTED|through host" "$OUT/moe_decode.log" | head -5 | cut -c1-300
     lone
     timeout -k 10 ${T_G:-170} python3 scripts/bench_moe.py gmm --random-shape qwen3-30b-a3b --tokens 8192 \
       --impls wsglu128_128x64s4d256 --output-json "$OUT/moe_gmm.json" \
       > "$OUT/moe_gmm.log" 2>&1; echo "rc=$?"
     grep -E "^T=|wrong" "$OUT/moe_gmm.log" | cut -c1-1500 ;;
  ab) MOE_PARTS="2" T2=${T2:-230} bash scripts/gpu_moe.sh
     grep -iE "can't reduce|out of memory|RESOURCE_EXHAUSTED|through host" "$OUT/moe_decode.log" | head -5 | cut -c1-300
     T_L=${T_L:-100} T3=${T3:-220} bash "$0" b ;;
  d) for mb in 8 1; do
       XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 10 ${T_D:-160} python3 scripts/bench_moe.py decode \
         --random-shape qwen3-30b-a3b --batch-size 1 --min-bucket $mb --input-len 2048 --num-iters 20 \
         --profile-steps 3 --output-json "$OUT/moe_decode_b$mb.json" > "$OUT/moe_decode_b$mb.log" 2>&1
       echo "rc=$? (bucket $mb)"
       grep -E "^decode|^engine grouped|^  /device|^    |kernels a step" "$OUT/moe_decode_b$mb.log" | cut -c1-400
       grep -iE "can't reduce|RESOURCE_EXHAUSTED|through host" "$OUT/moe_decode_b$mb.log" | head -3 | cut -c1-300
     done
     T_L=${T_L:-100} lone ;;
  b) lone
     if python3 -c "
import json, sys
rows = json.load(open('$OUT/moe_gmm_lone.json'))['rows']
bad = [n for r in rows for n, v in r.items() if n.startswith('ws') and isinstance(v, dict) and 'error' in v]
ok = any(n.endswith('c') for r in rows for n in r)
print('wrong:', bad or 'none'); sys.exit(0 if ok and not bad else 1)"; then export JAXLLM_GMM_CHAINED=1
     else export JAXLLM_GMM_CHAINED=0; fi
     echo "JAXLLM_GMM_CHAINED=$JAXLLM_GMM_CHAINED"
     MOE_PARTS="3" T3=${T3:-260} bash scripts/gpu_moe.sh
     grep -E "grouped matmul by measurement|grouped matmul timings" "$OUT/moe_prefill.log" | cut -c1-1500 ;;
  p) bash scripts/gpu_session34.sh p ;;
  *) echo "usage: $0 a|b|ab|d|p" >&2; exit 2 ;;
esac
