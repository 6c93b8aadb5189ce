#!/usr/bin/env bash
# Session 24's GPU calls (each under the device's 10-minute limit; whole logs stay in $OUT):
#   k (~3 min): issue 17 -- the Mosaic decode kernel on fp8 / int4 pages, B 64 context 2,048:
#     default config beside a sweep of (splits, stages, deq_stages) -- deq_stages > 0 has the
#     producer warpgroup convert the tiles (new) -- with ptxas' register / spill report, then
#   m (~6 min): gpu_session18.sh i (fp8 / int8 / int4 decode matmuls, Mosaic and XLA paths,
#     1 and 64 tokens, torch peers);
#   g (~3 min): issue 15 -- the MoE grouped matmul at 8,192 tokens (Qwen3-30B-A3B experts), the
#     warp-specialized kernel (kernels/moe_gmm_ws.py, new) beside ragged_dot_mgpu, the Triton
#     tiles and torch `_grouped_mm` (bench_moe.py gmm);
#   km: k then m in one call (T_CHECK + T_MATMUL <= 570 s); kg: k then g.
# None ran in session 24 (every device start failed). Next session, in order: kg, m, then
# gpu_session18.sh e (decode step with quantized weights: does the warm-up pick the Mosaic
# matmuls?), b (MoE decode incl. the direct path), h, g, b2, a. If the sweep shows a deq_stages
# config faster than the default, make it the default for quantized pages (decode_schedule).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
part_k() {
  echo "== k. Mosaic decode on quantized pages, config sweep"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 10 ${T_CHECK:-200} python3 scripts/check_mosaic_quant.py \
    --formats ${FORMATS:-fp8,int4} --sweep ${SWEEP:-1:2,1:4,2:3,1:2:2,1:3:2,1:2:1,1:4:2} \
    --json "$OUT/cmq.json" > "$OUT/cmq.log" 2>&1; echo "rc=$?"
  grep -o 'Used [0-9]* registers.*\|[0-9]* bytes spill.*' "$OUT/cmq.log" | sort | uniq -c | head -20
  python3 - "$OUT/cmq.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"{r['kv']:>9} {r['kernel']:<16} ok={r.get('ok')} err={r.get('rel_err', float('nan')):.1e} "
          f"us={r.get('us', float('nan')):7.1f} gpu_us={r.get('gpu_us', float('nan')):7.1f} "
          f"x_bf16={r.get('x_bf16_gpu_us', r.get('x_bf16_us', float('nan'))):5.2f} "
          f"frac_C={r.get('frac_C', float('nan')):.2f} {r.get('error', '')[-200:]}")
PY
}
part_g() {
  echo "== g. MoE grouped matmul, 8,192 tokens"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 ${T_GMM:-300} python3 scripts/bench_moe.py gmm \
    --random-shape qwen3-30b-a3b --tokens ${GMM_TOKENS:-8192} --output-json "$OUT/moe_gmm.json" \
    > "$OUT/moe_gmm.log" 2>&1; echo "rc=$?"
  grep -v "^ *$" "$OUT/moe_gmm.log" | tail -40
}
case "${1:-}" in
  k) part_k ;;
  m) bash scripts/gpu_session18.sh i ;;
  g) part_g ;;
  kg) part_k; part_g ;;
  km) part_k; T_MATMUL=${T_MATMUL:-360} bash scripts/gpu_session18.sh i ;;
  *) echo "usage: $0 k|m|g|km|kg"; exit 2 ;;
esac
