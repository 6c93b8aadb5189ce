#!/usr/bin/env bash
# Session 12's second GPU call (< 8 minutes): multi-turn chat in bf16 with the logit margins where
# outputs with and without the host tier diverge (8 conversations), then issue 18's speculative
# verification step at batch 1 and 32 and the zero-acceptance end-to-end slowdown (three parts of
# gpu_spec.sh; their logs stay in /tmp, their JSON comes back).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
MARGINS=1 CONV=${MT_CONV:-8} LIMIT=${MT_LIMIT:-200} bash scripts/gpu_multiturn.sh
PARTS="step_b1 step_b32 e2e_zero_accept" LOGS=/tmp bash scripts/gpu_spec.sh
