#!/usr/bin/env bash
# Session 12's GPU call (< 8 minutes): the host-tier restore (pinned) with another prompt's saves
# in flight, each thread's stacks sampled in-process during it (where the dispatch thread waits);
# then multi-turn chat in float32 (HIGHEST matmul precision), 8 conversations, with per-turn
# greedy agreement with and without the host tier (whether bf16 near-ties explain session 11's
# 0.02 agreement from turn 1 on).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PIN=on LIMIT=${KV_LIMIT:-200} bash scripts/gpu_kvoffload.sh 2>&1 | tail -30
DTYPE=float32 CONV=${MT_CONV:-8} LIMIT=${MT_LIMIT:-240} bash scripts/gpu_multiturn.sh
