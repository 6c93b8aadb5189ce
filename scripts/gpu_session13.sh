#!/usr/bin/env bash
# Session 13's GPU calls (< 9 minutes): the decode kernel with k + 1 tokens of a request per CTA
# (queries_per_item, speculative verification) checked and timed against the per-token kernel
# and a plain decode step's attention; then issue 18's parts of gpu_spec.sh (SPEC_PARTS, default
# the verification step at batch 1 and 32 and the zero-acceptance end-to-end slowdown); with
# PROFILE=1 (default) a cProfile of the synchronous steps at batch 1, with TRACE=1 a
# jax.profiler trace of the batch-32 steps (GPU busy per mode). Call 1 ran it as it is; call 3
# as `SPEC_PARTS="step_b1 step_b32" PROFILE=0 TRACE=1` (scripts/gpu_session13c.sh).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== check_mosaic_verify"
timeout -k 10 170 python3 scripts/check_mosaic_verify.py --batch 1 32 64 --ctx 1024 --k 4 \
  --json "$OUT/check_mosaic_verify.json" > /tmp/check_mosaic_verify.log 2>&1 || echo "check_mosaic_verify rc $?"
grep -E '^\{|summary' /tmp/check_mosaic_verify.log | python3 -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        print(line.strip()); continue
    r = json.loads(line)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("device", "jax")})
' || tail -20 /tmp/check_mosaic_verify.log
PARTS="${SPEC_PARTS:-step_b1 step_b32 e2e_zero_accept}" LOGS=/tmp bash scripts/gpu_spec.sh
B="python3 scripts/bench_spec.py step --random-shape llama3-8b --dtype bfloat16 --proposer random --input-len 1024"
if [ "${PROFILE:-1}" = 1 ]; then
  echo "== host profile, batch 1 (sync plain and speculative steps)"
  timeout -k 10 75 $B --batch-size 1 --num-iters 40 --seq-buckets 8 --token-buckets 8 \
    --max-num-batched-tokens 8 --profile 30 > /tmp/spec_profile.log 2>&1 || echo "profile rc $?"
  grep -A 45 '== host profile' /tmp/spec_profile.log | grep -v '^\s*$' | cut -c1-150
fi
if [ "${TRACE:-0}" = 1 ]; then
  echo "== step trace, batch 32"
  timeout -k 10 120 $B --batch-size 32 --num-iters 30 --seq-buckets 32 160 --token-buckets 32 160 \
    --max-num-batched-tokens 160 --trace /tmp/spec_trace \
    --output-json "$OUT/spec_step_trace_b32.json" > /tmp/spec_trace.log 2>&1 || echo "step trace rc $?"
  grep -E -A 10 '^== trace' /tmp/spec_trace.log | cut -c1-160
  python3 - "$OUT/spec_step_trace_b32.json" <<'PY' || tail -20 /tmp/spec_trace.log
import json, sys
for row in json.load(open(sys.argv[1]))["rows"]:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("_trace")})
PY
fi
