#!/usr/bin/env bash
# Where the server's host time goes with structured outputs on one H200 (issue 16): the same
# server and load as gpu_structured_serving.sh, run twice: with Python's default GIL switch
# interval (5 ms) and with SWITCH (default 0.0005 s, set by a wrapper before the server starts),
# printing each run's ratio (OUTPUT_LEN tokens per request, default 128); in the first run py-spy (carried in .whl) samples the server during
# each phase (raw folded stacks per thread under $OUT, summarised by scripts/pyspy_summary.py).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
PORT=${PORT:-8321}
for SW in default ${SWITCH:-0.0005}; do
  JAXLLM_PREFILL_KERNEL=pallas python3 -c "
import runpy, sys
if '$SW' != 'default':
    sys.setswitchinterval(float('$SW'))
sys.argv = ['jaxllm', 'serve', '--random-shape', 'llama3-8b', '--load-format', 'dummy', '--max-model-len', '2048',
            '--max-num-seqs', '64', '--max-num-batched-tokens', '2048', '--port', '$PORT']
runpy.run_module('jaxllm.cli', run_name='__main__')" > "$OUT/serve_$SW.log" 2>&1 &
  SRV=$!
  for _ in $(seq ${T_UP:-110}); do curl -sf localhost:$PORT/health > /dev/null && break; kill -0 $SRV 2>/dev/null || break; sleep 1; done
  grep -E "compiled|engine ready" "$OUT/serve_$SW.log" | cut -c1-200
  timeout -k 10 ${T_BENCH:-90} python3 scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --structured-output json \
    --num-prompts 64 --max-concurrency 64 --input-len 64 --output-len ${OUTPUT_LEN:-128} --ignore-eos --temperature 1.0 \
    --result-json "$OUT/structured_$SW.json" > "$OUT/bench_$SW.log" 2>&1 &
  BENCH=$!
  if [ "$SW" = default ] && command -v py-spy > /dev/null; then
    sleep 0.6; py-spy record --pid $SRV --threads --nonblocking -r 500 -d 1 -f raw -o "$OUT/pyspy_plain.txt" > /dev/null 2>&1
    for _ in $(seq 200); do grep -q -- "-- unconstrained" "$OUT/bench_$SW.log" && break; sleep 0.05; done
    sleep 0.3; py-spy record --pid $SRV --threads --nonblocking -r 500 -d 1 -f raw -o "$OUT/pyspy_json.txt" > /dev/null 2>&1
  fi
  wait $BENCH; echo "switch interval $SW: rc=$?"
  grep -E "TPOT|ratio" "$OUT/bench_$SW.log"
  kill $SRV 2>/dev/null; wait $SRV 2>/dev/null
done
for f in "$OUT"/pyspy_*.txt; do [ -f "$f" ] && python3 scripts/pyspy_summary.py "$f"; done
