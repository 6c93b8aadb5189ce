#!/usr/bin/env bash
# Speculative decoding with tensor parallelism on 2 H200s (kind nvidia-h200-x2; < 3 minutes):
# the Llama-3-8B shape (dummy bf16 weights) at tensor_parallel_size=2, batch 1, end to end,
# with a Llama-3.2-1B-shaped draft (dummy weights, k = 4) and a random EAGLE-3 head
# (scripts/spec_heads.py, k = 3), each split over the target's mesh. Random weights: acceptance
# ~0, so these give the per-step cost of the draft loop / head program vs no speculation on the
# same engine, and check on the accelerator's layout (unrolled, fused per shard, Pallas/Mosaic
# attention in shard_map) that greedy output is identical and nothing compiles after warm-up.
# Prints and writes $OUT/spec_tp_*.json.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv | tee "$OUT/spec_tp_gpu.txt"
D=/tmp/spec_heads; rm -rf $D
python3 scripts/spec_heads.py draft-config $D/draft1b >/dev/null \
  && python3 scripts/spec_heads.py eagle $D/eagle3 --method eagle3 --target llama3-8b >/dev/null \
  || echo "spec_heads.py FAILED"
E2E="--random-shape llama3-8b --dtype bfloat16 -tp 2 --batch-size 1 --max-tokens 64 --ignore-eos --repeats 1 \
  --seq-buckets 8 --token-buckets 8 128 --max-num-batched-tokens 128"
run() {  # name, timeout, speculative_config
  echo "== $1"
  timeout "$2" python3 scripts/bench_spec.py e2e $E2E --speculative-config "$3" \
    --output-json "$OUT/spec_tp_$1.json" > "$OUT/spec_tp_$1.log" 2>&1 || echo "$1 FAILED (rc $?)"
  python3 - "$OUT/spec_tp_$1.json" <<'PY' || tail -20 "$OUT/spec_tp_$1.log"
import json, sys
r = json.load(open(sys.argv[1]))
for row in r["rows"]:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
print("compiles after warm-up:", r["compiles_after_warmup"], "| start-up s:", round(r["start_s"], 1))
PY
}
run draft1b 80 "{\"method\": \"draft_model\", \"model\": \"$D/draft1b\", \"num_speculative_tokens\": 4}"
run eagle3 70 "{\"method\": \"eagle3\", \"model\": \"$D/eagle3\", \"num_speculative_tokens\": 3}"
