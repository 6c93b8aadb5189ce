#!/usr/bin/env bash
# Issue 17 on one H200, under 6 minutes (each part has its own timeout, 200 + 35 + 3 x 45 s;
# rows are saved as they come, so a part cut short keeps what it measured; figures in $OUT):
#   1. quantized-weight matmuls, Llama-3-8B linears (qkv, o, gate_up, down) at 1 / 64 / 8192 tokens:
#      bf16, fp8 W8A8 (XLA fp8 dot, W [N, K], HLO checked), int8 / int4 weight-only (XLA), int8 via
#      JAX's hopper_mixed_type_matmul_mgpu, int8 / int4 via jaxllm's Pallas kernel (kernels/qmatmul.py,
#      1 and 64 tokens), fp8 W8A8 via jaxllm's Mosaic kernel (kernels/qmatmul_mosaic.py, 1 and 64), torch _scaled_mm fp8 (per-tensor, rowwise) and torch
#      bf16 peers; x of the 8-bit / 4-bit byte floor (4.25 TB/s and C measured here), TFLOP/s;
#   2. decode attention B64 ctx 2048: Mosaic on bf16 / fp8 pages, Pallas on bf16 / fp8 / int8 / int4,
#      each checked against the reference on the same pages;
#   3. Llama-3-8B-shape decode step, batch 1, ctx 2048: bf16 vs fp8 vs int4 weights, then
#      $PROFILE_STEPS (3) steps under jax.profiler each: kernel time by kind, the 8 costliest kernels
#      (QUANT_EXTRA=1 adds batch 64 with fp8 weights + fp8 KV vs bf16; about 2 more minutes).
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
show() { tail -n "$1"; }  # whole logs stay in $OUT (nothing filtered)
PARTS=" ${QUANT_PARTS:-1 2 3} "  # which parts to run (QUANT_PARTS="1" or "3", ...)
want() { [[ "$PARTS" == *" $1 "* ]]; }

if want 1; then
echo "== 1. matmul"
timeout -k 10 ${T_MATMUL:-200} python3 scripts/bench_quant.py matmul ${MATMUL_FLAGS:-} --json "$OUT/quant_matmul.json" \
  > "$OUT/quant_matmul.log" 2>&1; echo "rc=$?"; sed -n '/^summary/,$p' "$OUT/quant_matmul.log" | show 80
grep -i -e error -e Traceback "$OUT/quant_matmul.log" | head -5

fi
if want 2; then
echo "== 2. decode attention B64 ctx 2048"
timeout -k 10 ${T_ATTN:-35} python3 scripts/bench_quant.py attention --batch 64 --ctx 2048 \
  --json "$OUT/quant_attention.json" > "$OUT/quant_attention.log" 2>&1; echo "rc=$?"
sed -n '/^summary/,$p' "$OUT/quant_attention.log" | show 10
grep -i -e error -e Traceback "$OUT/quant_attention.log" | head -5

fi
LAT="scripts/bench_latency.py --random-shape llama3-8b --input-len 2048 --num-iters 10 --max-num-batched-tokens 64"
for q in $(want 3 && echo none fp8 int4); do
  echo "== 3. decode step batch 1, weights $q"
  flag=""; [ "$q" != none ] && flag="--quantization $q"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout -k 10 ${T_LAT:-45} python3 $LAT --batch-size 1 $flag \
    --profile-steps ${PROFILE_STEPS:-3} \
    --output-json "$OUT/quant_latency_b1_$q.json" 2>&1 | tee "$OUT/quant_latency_b1_$q.log" | show 12
done
if [ "${QUANT_EXTRA:-0}" = 1 ]; then
  for q in none fp8; do
    echo "== 3b. decode step batch 64, weights $q, kv $q"
    flag=""; [ "$q" != none ] && flag="--quantization fp8 --kv-cache-dtype fp8"
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout -k 10 ${T_LAT:-60} python3 $LAT --batch-size 64 $flag \
      --output-json "$OUT/quant_latency_b64_$q.json" 2>&1 | tee "$OUT/quant_latency_b64_$q.log" | show 3
  done
fi

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
res = {}
for f in sorted(glob.glob(os.path.join(out, "quant_*.json"))):
    try:
        res[os.path.basename(f)[:-5]] = json.load(open(f))
    except Exception as e:
        res[os.path.basename(f)[:-5]] = {"error": repr(e)}
lat = {k: v["rows"][0]["step_s"] for k, v in res.items() if k.startswith("quant_latency") and v.get("rows")}
ratios = {k: t / lat[k.rsplit("_", 1)[0] + "_none"] for k, t in lat.items()
          if not k.endswith("_none") and k.rsplit("_", 1)[0] + "_none" in lat}
res["summary"] = {"decode_step_s": lat, "x_bf16": ratios}
json.dump(res, open(os.path.join(out, "quant.json"), "w"), indent=1)
print("decode step (s):", json.dumps(lat), "\nx bf16:", json.dumps(ratios))
PY
