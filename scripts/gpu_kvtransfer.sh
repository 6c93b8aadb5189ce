#!/usr/bin/env bash
# P/D transfer on one H200 (< 8 minutes). First the transport alone (scripts/transfer_bw.py:
# 512 MiB of 32 MiB KV chunks pulled between two transfer servers by socket connections and
# slab size, vs a device copy); then two Llama-3-8B-shape engines (dummy weights) in one
# process, producer and consumer over jax.experimental.transfer, once per transport setting in
# TRANSPORTS (default: the sweep's fastest, then 4 and 2 connections): pull time per 1k tokens of
# KV, consumer TTFT with the pull vs recomputed, pull bandwidth vs a device-to-device copy, and
# the consumer's decode ITL p50/p99 (and largest gaps) with prefills in the same engine vs
# pulled from the producer. Outputs: transfer_bw.{json,log}, kvtransfer_<i>.{json,log}.
# CPU smoke run: SHAPE=tiny INPUT_LEN=512 CHUNK=128 MIB=64 CONNS=1,2 PY=.venv/bin/python bash scripts/gpu_kvtransfer.sh
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== transfer transport sweep"
timeout -k 10 ${BW_LIMIT:-100} "$PY" scripts/transfer_bw.py --mib "${MIB:-512}" --chunk-mib 32 \
  --connections "${CONNS:-1,2,4,8,16}" --transfer-mib "${XFER:-256}" --pinned "${PINNED:-0}" \
  --output-json "$OUT/transfer_bw.json" 2>&1 | tee "$OUT/transfer_bw.log" | tail -20
BEST=$("$PY" - "$OUT/transfer_bw.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, KeyError, ValueError):
    rows = []
b = max(rows, key=lambda r: r["gb_s"], default=None)
print(json.dumps({} if b is None else {"num_connections": b["connections"], "transfer_size_mib": b["transfer_mib"],
                                       "parallel_copies": b["copies"], "pinned_buffers": b["pinned"]}))
PY
)
TRANSPORTS=${TRANSPORTS:-"$BEST;{\"num_connections\": 4};{\"num_connections\": 2}"}
i=0
IFS=';' read -ra TS <<< "$TRANSPORTS"
for T in "${TS[@]}"; do
  echo "== kv transfer $i: ${INPUT_LEN:-4096}-token prompts, pulled vs recomputed; decode ITL; transport $T"
  timeout -k 10 ${LIMIT:-150} "$PY" scripts/bench_kvtransfer.py --random-shape "${SHAPE:-llama3-8b}" \
    --input-len "${INPUT_LEN:-4096}" --chunk "${CHUNK:-2048}" --repeats 3 --transport "$T" \
    --itl-streams 8 --itl-tokens 64 --itl-arrivals 4 --output-json "$OUT/kvtransfer_$i.json" > "$OUT/kvtransfer_$i.log" 2>&1
  echo "rc=$?"
  grep -A3 '"itl"\|largest' "$OUT/kvtransfer_$i.json" | head -12; grep pulled_tokens "$OUT/kvtransfer_$i.json" | tail -1
  tail -2 "$OUT/kvtransfer_$i.log"
  i=$((i + 1))
done
