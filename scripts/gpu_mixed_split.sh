#!/usr/bin/env bash
# The mixed random workload (1,000 prompts, 544/288/0.88, defaults) and its profiled steady state,
# with the decode rows of mixed steps on the decode kernel (JAXLLM_MIXED_DECODE_ROWS=decode,
# kernels/mixed_split.py) and without (one mixed kernel), each in its own process, one H200
# (< 8 minutes). Figures: $OUT/split_<mode>/engine_jax.json (mixed: fraction_of_roofline, by_kind;
# mixed_profile: wall vs GPU busy, kernel time by kind).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
for MODE in ${MODES:-decode prefill}; do
  echo "=== JAXLLM_MIXED_DECODE_ROWS=$MODE"
  JAXLLM_MIXED_DECODE_ROWS=$MODE OUT="$OUT/split_$MODE" ENGINE_ARGS="--parts mixed mixed_profile --no-python-tracer" \
    HF=0 PARTS=engine T1=${T1:-230} bash scripts/gpu_engine.sh 2>&1 | grep -v "^ *\"\|^{\|^}"
  grep -E "mixed steps|prefill/mixed|compiled|warm" "$OUT/split_$MODE/engine_jax.log" | cut -c1-250 | head -8
done
# at most 8 files come back from a device call: one archive of the logs, plus each run's figures
for MODE in ${MODES:-decode prefill}; do cp "$OUT/split_$MODE/engine_jax.json" "$OUT/engine_$MODE.json" 2>/dev/null; done
(cd "$OUT" && tar czf logs.tgz split_* && rm -rf split_*)
