#!/usr/bin/env bash
# Session 13's third GPU call (< 7 minutes): the k + 1-token decode kernel without the gathers
# around it (q copied and outputs written token by token), checked and timed; issue 18's
# verification step at batch 1 and 32; a trace of the batch-32 steps (GPU busy per mode).
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
PARTS="step_b1 step_b32" LOGS=/tmp bash scripts/gpu_spec.sh
echo "== step trace, batch 32"
timeout 120 python3 scripts/bench_spec.py step --random-shape llama3-8b --dtype bfloat16 --proposer random \
  --batch-size 32 --input-len 1024 --num-iters 30 --seq-buckets 32 160 --token-buckets 32 160 \
  --max-num-batched-tokens 160 --trace /tmp/spec_trace \
  --output-json "$OUT/spec_step_trace_b32.json" > /tmp/spec_trace.log 2>&1 || echo "step trace rc $?"
grep -E -A 10 '^== trace' /tmp/spec_trace.log | cut -c1-160
python3 - "$OUT/spec_step_trace_b32.json" <<'PY' || tail -20 /tmp/spec_trace.log
import json, sys
for row in json.load(open(sys.argv[1]))["rows"]:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("_trace")})
PY
