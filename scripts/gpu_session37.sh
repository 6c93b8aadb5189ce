#!/usr/bin/env bash
# Session 37's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   g (~5 min, any Hopper card): the direct MoE expert MLP with each slot's one row on the CUDA
#     cores (`moe_gmm.Tiling(block_m=1)`, "row_*": no 16-row tensor-core tile gathering 15 rows
#     only to mask them; for down, silu(gate) * up of one row, not 16) against session 36's
#     `decode_128x64k4` (down at ~41% of the copy bandwidth there), alone at a 2-token bucket
#     (`check_moe_kernels.py --tokens 2 --cases gmm`, 1 and 2 real tokens), then the Qwen3-30B-A3B
#     batch-1 step in its bucket of two tokens, where the warm-up now also measures
#     `direct_row_128x64k4` / `direct_row_64x64k4` (and the best one's down under `row_128x64k1`).
#   d (~6 min, any Hopper card): the dense linears of one- and two-token steps through
#     `kernels/gemv.py` where the warm-up measures it faster than XLA's dot (`models/gemv_choice.py`;
#     session 37's H200 profile: the q/k/v GEMM at two rows 11.4 us a layer, 2.2x its bytes), the
#     Qwen3-30B-A3B batch-1 step in its bucket of two tokens with it and with JAXLLM_DENSE_GEMV=0.
#   q (~6 min, any Hopper card): issue 17's offline throughput 512 x (512 -> 256), Llama-3-8B shape,
#     bf16 and then fp8 weights + fp8 KV pages (`bench_throughput.py --quantization fp8
#     --kv-cache-dtype fp8`), two processes in one call, and their ratio.
#   t (~8.5 min, an H200): offline throughput 512 x (512 -> 256), the HF peer and then the engine
#     in one call (issue 15: ">= 3x HF in the same call"). Session 37 ran them as two calls on one
#     warm H200 (`gpu_session36.sh t4`: 218 s wall, HF's compile and first chunk 124 s of it;
#     `t5`: 232 s), so each part gets 290 s here; on an 80 GB card use `gpu_session36.sh t5`/`t4`.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "${1:-}" in
  g) timeout -k 5 ${T_K:-100} python3 scripts/check_moe_kernels.py --tokens 2 --cases gmm --json "$OUT/gmm.json" \
       > "$OUT/gmm.log" 2>&1; echo "rc=$? (expert MLP alone)"; grep -E "^(floor|gmm)" "$OUT/gmm.log"
     XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95} timeout -k 5 ${T_B:-170} \
       python3 scripts/bench_moe.py decode --random-shape qwen3-30b-a3b --batch-size 1 --min-bucket 2 --input-len 2048 \
       --num-iters 20 --profile-steps 2 --output-json "$OUT/moe_decode_b2.json" > "$OUT/moe_decode_b2.log" 2>&1
     echo "rc=$? (batch 1, bucket 2)"
     grep -E "^decode|^engine grouped|^  /device|^    |kernels a step" "$OUT/moe_decode_b2.log" | cut -c1-600
     grep -E "by measurement|grouped matmul timings" "$OUT/moe_decode_b2.log" | head -4 | cut -c1-1500 ;;
  d) for g in ${GEMV_MODES:-1 0}; do
       JAXLLM_DENSE_GEMV=$g XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95} timeout -k 5 ${T_B:-170} \
         python3 scripts/bench_moe.py decode --random-shape qwen3-30b-a3b --batch-size 1 --min-bucket 2 --input-len 2048 \
         --num-iters 20 --profile-steps 2 --output-json "$OUT/moe_decode_gemv$g.json" > "$OUT/moe_decode_gemv$g.log" 2>&1
       echo "rc=$? (JAXLLM_DENSE_GEMV=$g)"
       grep -E "^decode|^  /device|^    |kernels a step" "$OUT/moe_decode_gemv$g.log" | cut -c1-600
       grep -E "dense linears|grouped matmul by measurement" "$OUT/moe_decode_gemv$g.log" | cut -c1-1200
     done ;;
  q) TP="--random-shape llama3-8b --dtype bfloat16 --num-prompts 512 --input-len 512 --output-len 256 --max-num-seqs 256
        --max-num-batched-tokens 2048 --token-buckets 256 2048 --seq-buckets 256"
     for m in bf16 fp8; do
       flag=""; [ $m = fp8 ] && flag="--quantization fp8 --kv-cache-dtype fp8"
       timeout -k 5 ${T_Q:-170} python3 scripts/bench_throughput.py $TP $flag --output-json "$OUT/tput_$m.json" \
         > "$OUT/tput_$m.log" 2>&1; echo "rc=$? ($m)"
       grep -E "^(engine|jaxllm) |roofline:|KV cache:|compiles" "$OUT/tput_$m.log" | cut -c1-300
     done
     python3 -c "import json; a, b = (json.load(open('$OUT/tput_' + m + '.json'))['jaxllm']['output_tokens_per_s'] for m in ('bf16', 'fp8')); print(f'fp8 weights + fp8 KV / bf16 output tok/s: {b / a:.3f} ({b:.1f} / {a:.1f})')" ;;
  t) MOE_PARTS="4 5" T4=${T4:-290} T5=${T5:-290} bash scripts/gpu_moe.sh ;;
  *) echo "usage: $0 g|d|q|t" >&2; exit 2 ;;
esac
