#!/usr/bin/env bash
# Session 12's second GPU call (< 8 minutes): multi-turn chat in bf16 with the logit margins where
# outputs with and without the host tier diverge (8 conversations), then issue 18's speculative
# verification step at batch 1 and 32 and the zero-acceptance end-to-end slowdown (the first
# three parts of gpu_spec.sh; their logs stay in /tmp, their JSON comes back).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
MARGINS=1 CONV=${MT_CONV:-8} LIMIT=${MT_LIMIT:-200} bash scripts/gpu_multiturn.sh
B="python3 scripts/bench_spec.py"
R="--random-shape llama3-8b --dtype bfloat16 --proposer random"
run() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  echo "== $name"
  timeout "$t" $B "$@" --output-json "$OUT/spec_$name.json" > "/tmp/spec_$name.log" 2>&1 || {
    echo "$name FAILED (rc $?)"; tail -5 "/tmp/spec_$name.log"; }
  python3 - "$OUT/spec_$name.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for row in r["rows"]:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
print("compiles after warm-up:", r["compiles_after_warmup"], "| start-up s:", round(r["start_s"], 1))
PY
}
run step_b1 60 step $R --batch-size 1 --input-len 1024 --num-iters 40 --seq-buckets 8 --token-buckets 8 \
  --max-num-batched-tokens 8
run step_b32 75 step $R --batch-size 32 --input-len 1024 --num-iters 30 --seq-buckets 32 160 \
  --token-buckets 32 160 --max-num-batched-tokens 160
run e2e_zero_accept 60 e2e $R --batch-size 1 --max-tokens 128 --ignore-eos --repeats 2 --seq-buckets 8 \
  --token-buckets 8 128 --max-num-batched-tokens 128
