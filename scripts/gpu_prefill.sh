#!/usr/bin/env bash
# One device call (< 6 min): prefill attention on one H200 and time to first token.
#  1. scripts/bench_kernels.py --prefill: small mixed batches checked first (poisoned, every row
#     against a float32 reference), then 1x2048, 1x8192, 1x32768 and 8 ragged sequences of 1k-8k
#     (Llama-3-8B heads, bf16, causal FLOPs): the paged Mosaic kernel (+ a variant), the portable
#     Pallas kernel, jax cuDNN attention, JAX's bundled Mosaic flash attention, torch SDPA cuDNN
#     and flash backends (contiguous K/V); and a mixed step (4 x 512-token chunks + 60 decode
#     rows at context 2048) for the paged kernels (the engine's choice for mixed steps).
#  2. TTFT, one prompt of 2048 and 32768 tokens, Llama-3-8B shape (random weights), default
#     engine settings, vs the FLOP floor (scripts/bench_engine.py, also used by gpu_engine.sh),
#     then HF transformers (sdpa) in its own process; the engine's prefill kernel chosen by the
#     probe (JAXLLM_PREFILL_KERNEL=auto; the log line says which and why).
# Writes $OUT/prefill.json (kernel table + TTFT rows) and the raw logs.
set -u -o pipefail
export JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
echo "== kernels"
timeout -k 10 ${T1:-170} python3 scripts/bench_kernels.py --prefill \
  --prefill-kernels ${KERNELS:-mosaic,mosaic:64:4,pallas,jax_cudnn,jax_mgpu,torch_cudnn,torch_flash} \
  --out "$OUT/prefill_kernels.json" 2>&1 | tee "$OUT/prefill_kernels.log" | tail -12
echo "== ttft (jaxllm, default settings, prefill kernel by probe)"
JAXLLM_PREFILL_KERNEL=${PREFILL_KERNEL:-auto} timeout -k 10 ${T2:-120} python3 scripts/bench_engine.py \
  --ttft-lens 2048 32768 --reps 2 --prefill-batch 1 --prefill-len 64 --num-prompts 2 \
  --random-input-len 32 --random-output-len 4 --output-json "$OUT/ttft_jax.json" > "$OUT/ttft_jax.log" 2>&1
echo "rc=$?"; grep -i "prefill/mixed attention\|attention backend" "$OUT/ttft_jax.log" | head -3
echo "== ttft (HF transformers, sdpa)"
timeout -k 10 ${T3:-70} python3 scripts/bench_engine.py --peer hf --ttft-lens 2048 32768 --reps 2 \
  --prefill-batch 1 --prefill-len 64 --output-json "$OUT/ttft_hf.json" > "$OUT/ttft_hf.log" 2>&1
echo "rc=$?"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
res = {}
for name in ("prefill_kernels", "ttft_jax", "ttft_hf"):
    try:
        res[name] = json.load(open(os.path.join(out, name + ".json")))
    except Exception as e:  # noqa: BLE001
        res[name] = {"error": repr(e)}
for n in (2048, 32768):
    j, h = res["ttft_jax"].get(f"ttft_{n}", {}), res["ttft_hf"].get(f"ttft_{n}", {})
    if "ttft_s" in j:
        print(f"TTFT {n}: jaxllm {j['ttft_s'] * 1e3:.1f} ms = {j['x_floor']:.2f}x floor"
              + (f", HF {h['ttft_s'] * 1e3:.1f} ms ({h['ttft_s'] / j['ttft_s']:.2f}x ours)" if "ttft_s" in h else ""))
json.dump(res, open(os.path.join(out, "prefill.json"), "w"), indent=1)
print("wrote", os.path.join(out, "prefill.json"))
PY
