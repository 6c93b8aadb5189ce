#!/usr/bin/env bash
# Issue 15's expert-parallel figures, for a machine of several GPUs (nvidia-h100-x2 / -x4 or the
# H200 kinds; ask `status` first: multi-GPU kinds are lent only at times). One call each part,
# within the device's 10 minutes; whole logs and JSON in $OUT. N = the GPUs of the machine
# (TP=2 default; TP=4 on four). Every figure is per device against that device's floor
# (`bench_moe.py`: its share of weights and K/V, and under expert parallelism the experts touched
# on the busiest device), the copy bandwidth measured in the same process.
#   q (~8 min): Qwen3-30B-A3B shape, decode batch 1 and 64 at context 2,048: experts split along
#     F (vLLM's default without the flag) and whole experts a device (--enable-expert-parallel),
#     then prefill 8 x 2,048 with expert parallelism (MFU on the active parameters).
#   p (~5 min): float32 greedy ids of a four-layer Qwen3-30B-A3B-shaped model at tp 1, tp N and
#     tp N with expert parallelism must be identical (`gpu_tp_parity.py --ep`).
#   m (~8 min): Mixtral-8x7B shape (94 GB bf16: 47 GB a device at TP 2) decode batch 1 and 64
#     with expert parallelism, then with EPLB (one redundant slot a device, rebalanced every 8 steps).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
OUT=${OUT:-out}; mkdir -p "$OUT"
TP=${TP:-2}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
dec() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.9} timeout -k 10 "$t" python3 scripts/bench_moe.py "$@" -tp "$TP" \
    --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$? ($name: $*)"
  grep -E "^decode|^prefill|^  /device|EPLB: rebalanced|by measurement" "$OUT/$name.log" | tail -8 | cut -c1-400
}
case "${1:-}" in
  q) D="decode --random-shape qwen3-30b-a3b --batch-size 1 64 --input-len 2048 --num-iters 20"
     dec qwen3_tp "${T1:-170}" $D
     dec qwen3_ep "${T2:-170}" $D --enable-expert-parallel
     dec qwen3_ep_prefill "${T3:-170}" prefill --random-shape qwen3-30b-a3b --prefill-batch 8 --prefill-len 2048 \
       --enable-expert-parallel ;;
  m) D="decode --random-shape mixtral-8x7b --batch-size 1 64 --input-len 2048 --num-iters 20 --enable-expert-parallel"
     dec mixtral_ep "${T1:-260}" $D
     dec mixtral_eplb "${T2:-260}" $D --enable-eplb \
       --eplb-config "{\"window_size\": 8, \"step_interval\": 8, \"num_redundant_experts\": $TP}" ;;
  p) timeout -k 10 ${T1:-300} python3 scripts/gpu_tp_parity.py --tp 1 "$TP" --shapes qwen3-moe-4l --ep \
       2>&1 | tee "$OUT/ep_parity.log" | grep -E "^\{|Error" | cut -c1-400; echo "rc=${PIPESTATUS[0]}" ;;
  *) echo "usage: TP=N $0 q|p|m" >&2; exit 2 ;;
esac
