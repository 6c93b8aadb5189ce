#!/usr/bin/env bash
# Session 11's GPU call (< 8 minutes): what stalls a decode step during a P/D pull
# (transfer_bw.py --interference, 8 and 1 connections), multi-turn chat with and without the host
# tier with per-turn output agreement, then the host-tier restore (pinned) with the contended case.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for n in 8 1; do
  echo "== pull interference, $n connections"
  timeout -k 10 60 python3 scripts/transfer_bw.py --mib 512 --connections $n --interference $n \
    --output-json "$OUT/interference_$n.json" 2>&1 | tail -6
done
LIMIT=${MT_LIMIT:-170} bash scripts/gpu_multiturn.sh
PIN=on LIMIT=${KV_LIMIT:-170} bash scripts/gpu_kvoffload.sh 2>&1 | tail -25
