#!/usr/bin/env bash
# One device call (< 6 min): prefill attention on one H200 and time to first token.
#  1. scripts/bench_kernels.py --prefill: small mixed batches checked first (poisoned, every row
#     against a float32 reference), then 1x2048, 1x8192, 1x32768 and 8 ragged sequences of 1k-8k
#     (Llama-3-8B heads, bf16, causal FLOPs): the paged Mosaic kernel (+ a variant), the portable
#     Pallas kernel, jax cuDNN attention, JAX's bundled Mosaic flash attention, torch SDPA cuDNN
#     and flash backends (contiguous K/V); and a mixed step (4 x 512-token chunks + 60 decode
#     rows at context 2048) for the paged kernels (the engine's choice for mixed steps).
#  2. TTFT, one prompt of 2048 and 32768 tokens, Llama-3-8B shape (random weights), one prefill
#     step (bench_throughput, max_tokens 1) with the HF transformers (sdpa) peer; the engine's
#     prefill kernel chosen by the probe (JAXLLM_PREFILL_KERNEL=auto; the log says which).
# Writes $OUT/prefill.json (kernel table + TTFT rows) and the raw logs.
set -u -o pipefail
export JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
echo "== kernels"
timeout ${T1:-190} python3 scripts/bench_kernels.py --prefill \
  --prefill-kernels ${KERNELS:-mosaic,mosaic:64:4,pallas,jax_cudnn,jax_mgpu,torch_cudnn,torch_flash} \
  --out "$OUT/prefill_kernels.json" 2>&1 | tee "$OUT/prefill_kernels.log" | tail -12
for n in 2048 32768; do
  echo "== ttft $n"
  JAXLLM_PREFILL_KERNEL=${PREFILL_KERNEL:-auto} XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout ${T2:-75} python3 scripts/bench_throughput.py \
    --random-shape llama3-8b --dtype bfloat16 --num-prompts 1 --input-len $n --output-len 1 \
    --max-num-seqs 1 --max-num-batched-tokens $n --token-buckets $n --seq-buckets 1 --hf --hf-batch 1 \
    --output-json "$OUT/ttft_$n.json" 2>&1 | tee "$OUT/ttft_$n.log" | tail -4
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
res = {}
for name in ("prefill_kernels", "ttft_2048", "ttft_32768"):
    try:
        res[name] = json.load(open(os.path.join(out, name + ".json")))
    except Exception as e:  # noqa: BLE001
        res[name] = {"error": repr(e)}
json.dump(res, open(os.path.join(out, "prefill.json"), "w"), indent=1)
print("wrote", os.path.join(out, "prefill.json"))
PY
