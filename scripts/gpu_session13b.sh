#!/usr/bin/env bash
# Session 13's second GPU call (< 8 minutes): where a speculative step's time goes at batch 1 and
# 32 (bench_spec step with a jax.profiler trace per mode: GPU busy vs wall, kernel time by kind,
# top kernels; and a cProfile of the host), then the zero-acceptance end-to-end run of a
# Llama-3.2-1B-shaped draft model (gpu_spec.sh's part, its draft's shadow pass now on the
# k + 1-token decode kernel).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== step trace, batch 1 and 32"
timeout -k 10 200 python3 scripts/bench_spec.py step --random-shape llama3-8b --dtype bfloat16 --proposer random \
  --batch-size 1 32 --input-len 1024 --num-iters 30 --seq-buckets 8 32 160 --token-buckets 8 32 160 \
  --max-num-batched-tokens 160 --trace /tmp/spec_trace --profile 28 \
  --output-json "$OUT/spec_step_trace.json" > /tmp/spec_trace.log 2>&1 || echo "step trace rc $?"
grep -E -A 14 '^== trace' /tmp/spec_trace.log | cut -c1-160
grep -A 36 '== host profile, spec steps, batch 32' /tmp/spec_trace.log | grep -v '^\s*$' | cut -c1-150
python3 - "$OUT/spec_step_trace.json" <<'PY' || tail -20 /tmp/spec_trace.log
import json, sys
for row in json.load(open(sys.argv[1]))["rows"]:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("_trace")})
PY
PARTS="e2e_draft1b_zero_accept" LOGS=/tmp bash scripts/gpu_spec.sh
