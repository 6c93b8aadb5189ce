#!/usr/bin/env bash
# Structured outputs through the server on one H200 (< 4 minutes): `jaxllm serve` on the Llama-3-8B
# shape with dummy weights, then `bench_serving.py --structured-output json`: 64 unconstrained
# requests, then 64 under the JSON schema (fresh prompts), 128 output tokens each at temperature 1;
# prints the output-throughput ratio (issue 16: >= 0.95) and the host's mask time per step.
# The prefill kernel is the portable one by default here (PREFILL_KERNEL=auto for the Hopper
# choice), which keeps the server's start-up compiles short. Carry .whl (server packages, llguidance).
# MASK_ON: one server and bench per value of JAXLLM_MASK_ON (where the step's constrained rows are
# computed: thread, dispatch, engine; default "thread"), each bench's JSON as structured_<value>.json
# and the server's log with the bench's output after it as serve_<value>.log.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! PYTHONPATH=$PWD:/tmp/site python3 -c "import fastapi, uvicorn, llguidance" 2>/dev/null && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
[ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site
PORT=${PORT:-8321}
for MO in ${MASK_ON:-thread}; do
echo "== JAXLLM_MASK_ON=$MO"
JAXLLM_MASK_ON=$MO JAXLLM_PREFILL_KERNEL=${PREFILL_KERNEL:-pallas} python3 -m jaxllm.cli serve --random-shape llama3-8b \
  --load-format dummy --max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 2048 --port $PORT \
  > "$OUT/serve_$MO.log" 2>&1 &
SRV=$!
for _ in $(seq ${T_UP:-150}); do curl -sf localhost:$PORT/health > /dev/null && break; kill -0 $SRV 2>/dev/null || break; sleep 1; done
grep -E "prefill/mixed|compiled|engine ready" "$OUT/serve_$MO.log" | cut -c1-250
timeout -k 10 ${T_BENCH:-120} python3 scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --structured-output json \
  --num-prompts 64 --max-concurrency 64 --input-len 64 --output-len ${OUTPUT_LEN:-128} --ignore-eos --temperature 1.0 \
  --result-json "$OUT/structured_$MO.json" > "$OUT/bench_$MO.log" 2>&1; echo "rc=$?"
grep -E "ratio|TPOT|TTFT|throughput|mask" "$OUT/bench_$MO.log" | tail -14
kill $SRV 2>/dev/null; wait $SRV 2>/dev/null
# Two files a placement: the device returns at most 8 (session 22 lost the third placement's JSON).
{ echo "== bench_serving.py"; cat "$OUT/bench_$MO.log"; } >> "$OUT/serve_$MO.log" && rm -f "$OUT/bench_$MO.log"
done
