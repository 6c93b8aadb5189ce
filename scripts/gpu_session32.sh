#!/usr/bin/env bash
# Session 32's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   a (~9 min): issue 17's decode kernel on fp8 pages, B 64, context 2,048, Llama-3-8B heads
#     (scripts/check_mosaic_quant.py --formats fp8): bf16, fp8 Pallas, fp8 Mosaic (early / late V)
#     and mosaic_qk8, new in session 32 (`qk_fp8`: the query rounded to e4m3, the QK wgmma on
#     the K tile as copied, only V converted; target <= 0.55x bf16, 0.87x on session 24's H100);
#     then session 31's a: the fp8 8B batch-1 step's host launches compiled on the CPU under the
#     card's jax, and decode batch 1, context 2,048: bf16, fp8 (step-level choice), fp8ns
#     (without it), int4 (#17: fp8 <= 0.6x bf16, int4 <= 0.4x).
#   b (~7 min, needs_h200): as scripts/gpu_session31.sh b (#15 MoE decode batch 1 / 64).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-}" in
  a) echo "== q. Mosaic decode on fp8 pages, with and without the e4m3 query"
     MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 10 ${T_Q:-150} python3 scripts/check_mosaic_quant.py \
       --formats fp8 --json "$OUT/cmq.json" > "$OUT/cmq.log" 2>&1; echo "rc=$?"
     grep -o 'Used [0-9]* registers.*\|[0-9]* bytes spill.*' "$OUT/cmq.log" | sort | uniq -c | head -8
     python3 - "$OUT/cmq.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"{r['kv']:>5} {r['kernel']:<14} ok={r.get('ok')} err={r.get('rel_err', float('nan')):.1e} "
          f"q_err={r.get('fp8_q_err', float('nan')):.1e} gpu_us={r.get('gpu_us', float('nan')):7.1f} "
          f"x_bf16={r.get('x_bf16_gpu_us', r.get('x_bf16_us', float('nan'))):5.2f} "
          f"frac_C={r.get('frac_C', float('nan')):.2f} {r.get('error', '')[-300:]}")
PY
     T_E=${T_E:-110} RUNS_E=${RUNS_E:-"bf16 fp8 fp8ns int4"} bash scripts/gpu_session31.sh a ;;
  b) bash scripts/gpu_session31.sh b ;;
  *) echo "usage: $0 a|b" >&2; exit 2 ;;
esac
