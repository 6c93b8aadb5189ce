#!/usr/bin/env bash
# Session 13's GPU call (< 9 minutes): the decode kernel with k + 1 tokens of a request per CTA
# (queries_per_item, speculative verification) checked and timed against the per-token kernel
# and a plain decode step's attention; then issue 18's verification step at batch 1 and 32, the
# zero-acceptance end-to-end slowdown, and a host profile of the synchronous steps at batch 1.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== check_mosaic_verify"
timeout 170 python3 scripts/check_mosaic_verify.py --batch 1 32 64 --ctx 1024 --k 4 \
  --json "$OUT/check_mosaic_verify.json" > /tmp/check_mosaic_verify.log 2>&1 || echo "check_mosaic_verify rc $?"
grep -E '^\{|summary' /tmp/check_mosaic_verify.log | python3 -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        print(line.strip()); continue
    r = json.loads(line)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("device", "jax")})
' || tail -20 /tmp/check_mosaic_verify.log
PARTS="step_b1 step_b32 e2e_zero_accept" LOGS=/tmp bash scripts/gpu_spec.sh
echo "== host profile, batch 1 (sync plain and speculative steps)"
timeout 75 python3 scripts/bench_spec.py step --random-shape llama3-8b --dtype bfloat16 --proposer random \
  --batch-size 1 --input-len 1024 --num-iters 40 --seq-buckets 8 --token-buckets 8 \
  --max-num-batched-tokens 8 --profile 30 > /tmp/spec_profile.log 2>&1 || echo "profile rc $?"
grep -A 45 '== host profile' /tmp/spec_profile.log | grep -v '^\s*$' | cut -c1-150
