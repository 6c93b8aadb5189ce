#!/usr/bin/env bash
# Second-wave GPU figures in one device call: runs the parts named in PARTS (default: all), each
# script with its own OUT folder and time limit; installs the carried wheels (.whl: the server's
# packages, llguidance, gguf, pyzmq, none on the H200 image) first; packs every log and JSON into
# $OUT/results.tgz (the device returns at most 8 files) and prints each part's summary.
#   PARTS="structured prefill" bash scripts/gpu_wave2.sh
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -2
fi
PARTS=${PARTS:-structured prefill spec quant moe kvoffload engine}
t0=$(date +%s)
for p in $PARTS; do
  echo "######## $p (t=$(( $(date +%s) - t0 )) s)"
  mkdir -p "$OUT/$p"
  OUT="$OUT/$p" bash "scripts/gpu_$p.sh" 2>&1 | tee "$OUT/$p/stdout.txt" | tail -${TAIL:-25}
done
echo "######## done in $(( $(date +%s) - t0 )) s"
tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/results.tgz"
ls -la "$OUT"
