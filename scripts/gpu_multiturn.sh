#!/usr/bin/env bash
# Multi-turn chat on one H200 (< 5 minutes): Llama-3-8B shape (dummy weights), each turn resends
# the growing conversation, device pool sized to 10% of the working set; prefix hit rate,
# throughput and greedy agreement without and with the host tier (issue 19).
# DTYPE=float32: the same in float32 (slow: the 8B shape in float32 passed 240 s with 8
# conversations). MARGINS=1: one more untimed pass with top-2 logprobs, the logit margin where
# the two configurations' outputs first diverge (whether bf16 near-ties are why they differ).
# SCA="auto 2": one host-tier engine per save_copies_ahead value.
# CPU smoke run: SHAPE=tiny CONV=4 USER=64 CHUNK=128 PY=.venv/bin/python bash scripts/gpu_multiturn.sh
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== multi-turn: ${CONV:-32} conversations x 4 turns, ${USER:-1024} user tokens a turn"
timeout -k 10 ${LIMIT:-280} "$PY" scripts/bench_multiturn.py --random-shape "${SHAPE:-llama3-8b}" \
  --conversations "${CONV:-32}" --turns 4 --user-tokens "${USER:-1024}" --output-tokens 32 \
  --pool-fraction 0.1 --chunk "${CHUNK:-2048}" ${DTYPE:+--dtype "$DTYPE"} ${MARGINS:+--margins} ${SCA:+--save-copies-ahead $SCA} --cpu-gib "${CPU_GIB:-24}" --repeats 2 \
  --output-json "$OUT/multiturn.json" 2>&1 | tee "$OUT/multiturn.log" | tail -8
echo "rc=$?"
