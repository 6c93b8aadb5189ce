#!/usr/bin/env bash
# The GPU calls planned in session 18, in priority order, each under the device's 10-minute
# limit (parts have their own timeouts). `.whl/` carries the gguf wheel the image lacks.
#   a (~8 min): issue 14 -- TTFT 2k/8k/32k and prefill throughput with the prefill kernel chosen
#     per bucket by measurement (gpu_ttft.sh; the log's "prefill/mixed attention" lines, now
#     that the bench scripts set up logging); then issue 18 -- the batch-32 verification step
#     again (160-row and 256-token buckets)
#   b (~8 min): issue 15 -- scripts/gpu_moe.sh parts 1 and 2 (grouped matmul, decode step);
#   b2 (~8 min): its parts 4 and 5 (offline throughput: HF peer, then jaxllm); b3 (~3 min): part 3
#     (prefill MFU); b4 (~5 min, an H200 only: 94 GB of weights): part 6, the Mixtral-8x7B decode. All five in one call did not fit 10 minutes on a fresh machine (session 22).
#   c (~9 min): issue 17 -- qmatmul tilings swept at 1 token, fp8 (weight-only, new) / int8 / int4
#     (bench_quant.py matmul --tilings all: kernel time apart from the XLA ops around it)
#   e (~8 min): issue 17 -- decode step batch 1 with bf16 / fp8 / int4 weights, the path
#     measured per layout at warm-up in the log ("quantized matmuls by measurement")
#   d (~8 min): issue 16 -- structured outputs through the server (gpu_structured_serving.sh), one
#     server per placement of the mask work (JAXLLM_MASK_ON thread / engine / dispatch): on the
#     CPU (session 19, scripts/host_step.py, greedy, 64 rows) the three were within run-to-run
#     noise of one another; the GPU's last comparison of them predates the fix that stopped every
#     mask being computed twice
#   f (~8 min): issue 17 -- the Mosaic prefill kernel on fp8 pages, of record: check_prefill.py on
#     bf16 / e4m3 / e5m2 pages (poisoned, every row), then bench_kernels.py --prefill at 1x8192 and
#     1x32768 with the Mosaic and Pallas kernels on bf16 and fp8 pages beside cuDNN (jax, torch)
#   g (~3 min): the decode kernel's shapes (check_decode_shapes.py: D 64 with several blocks a CTA,
#     padded groups; all correct on the H100 in session 21; since session 22 also int4 / int8 pages
#     at D 128 and 64, and SmolLM2's padded group: int4 correct at D 64 -> add 64 to
#     mosaic_kv_quant.INT_HEAD_DIMS) and int8 / int4 pages in it
#     (check_mosaic_quant.py; failed to lower under jax 0.11.2 in sessions 20 and 21; the cause was
#     found and fixed on the CPU with scripts/jax011_lowering.sh, unchecked on a GPU, so not routed)
#   h (~6 min): issue 17 -- int8 / int4 pages in the Mosaic prefill kernel (session 22, on the CPU:
#     interpreter-checked, lowered for cuda under jax 0.11.2; not routed): check_prefill.py on
#     int8 / int4 pages (poisoned, every row), then bench_kernels.py --prefill at 1x8192 with the
#     Mosaic kernel on bf16 / fp8 / int8 / int4 pages and Pallas on the int ones. Correct and
#     faster than Pallas: add the format to mosaic_prefill.INT_FORMATS.
#   i (~9 min): issue 17 -- jaxllm's Mosaic fp8 W8A8 and int4 / int8 weight-only decode matmuls
#     (session 23, on the CPU: interpreter-checked, lowered under jax 0.10 and 0.11.2, offered to
#     the warm-up's choice on Hopper; int weights re-laid out [N, K] where the kernel wins):
#     bench_quant.py matmul, 1 and 64 tokens, every tiling beside XLA, the Triton kernel and
#     torch `_scaled_mm`: i fp8, i2 (~9 min) int8, int4 and HF FP8 blocks; then e shows whether the step's
#     warm-up picks them
# Session 20 (one H100) ran a, c and f; session 21 (one H100) ran g and e (fp8 decode step 1.02x
# bf16; its warm-up's matmul timings were the dispatch's, fixed since), b (failed: a hung
# process held the GPU's memory; scripts fixed) and d (the server's KV pool did not fit the
# allocator's largest free block; fixed). Session 22 (one H200) ran g (int8 / int4 correct; int4
# routed), e, d (run scripts/fetch_wheels.sh here first and carry .whl: the server packages and
# llguidance are not on the image) and b, which timed out part by part and was then run as
# separate calls (the commands in docs/benchmarks.md). Session 23 had no GPU. Next: i, i2, e, b, h, g (its shapes part: int pages at
# D 64), then b2 (the offline MoE
# throughput vs HF, never measured), e and b again (both now print a profile of the step: kernel
# time by kind and the costliest kernels), a.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
  a) T1=${T1:-230} bash scripts/gpu_ttft.sh
     PARTS="step_b32 step_b32_t256" bash scripts/gpu_spec.sh ;;
  b) MOE_PARTS="1 2" bash scripts/gpu_moe.sh ;;
  b2) MOE_PARTS="4 5" bash scripts/gpu_moe.sh ;;
  b3) MOE_PARTS="3" bash scripts/gpu_moe.sh ;;
  b4) MOE_PARTS="6" bash scripts/gpu_moe.sh ;;  # Mixtral-8x7B shape: an H200 (needs_h200)
  c) MATMUL_FLAGS="${MATMUL_FLAGS:---tilings all --tokens 1 --shapes qkv gate_up down --modes fp8 int8 int4 --no-peers}" \
     T_MATMUL=${T_MATMUL:-540} QUANT_PARTS=1 bash scripts/gpu_quant.sh ;;
  i) MATMUL_FLAGS="${MATMUL_FLAGS:---modes fp8 int8 int4 --tokens 1 64 --paths mosaic xla}" T_MATMUL=${T_MATMUL:-570} QUANT_PARTS=1 \
     bash scripts/gpu_quant.sh ;;
  i2) MATMUL_FLAGS="${MATMUL_FLAGS:---modes int8 int4 fp8b --tokens 1 64 --no-peers}" T_MATMUL=${T_MATMUL:-570} \
     QUANT_PARTS=1 bash scripts/gpu_quant.sh ;;
  e) QUANT_PARTS=3 T_LAT=${T_LAT:-180} bash scripts/gpu_quant.sh ;;  # warm-up measures ~6 Mosaic tilings a layout more
  d) MASK_ON="${MASK_ON:-thread engine dispatch}" T_UP=${T_UP:-100} T_BENCH=${T_BENCH:-60} \
     bash scripts/gpu_structured_serving.sh ;;
  f) export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off; OUT=${OUT:-out}; mkdir -p "$OUT"
     timeout -k 10 ${T_CHECK:-200} python3 scripts/check_prefill.py --variants mosaic --kv-cache-dtype auto fp8 fp8_e5m2 \
       --out "$OUT/check_prefill_fp8.json" 2>&1 | tail -45
     PREFILL_SMOKE=0 timeout -k 10 ${T_BENCH:-300} python3 scripts/bench_kernels.py --prefill --prefill-cases 8192,32768 \
       --prefill-kernels mosaic,mosaic@fp8,mosaic@fp8_e5m2,pallas,pallas@fp8,jax_cudnn,torch_cudnn \
       --out "$OUT/prefill_fp8.json" 2>&1 | tail -12 ;;
  h) export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off; OUT=${OUT:-out}; mkdir -p "$OUT"
     timeout -k 10 ${T_CHECK:-240} python3 scripts/check_prefill.py --variants mosaic --kv-cache-dtype int8 int4 \
       --out "$OUT/check_prefill_int.json" 2>&1 | tail -35
     PREFILL_SMOKE=0 timeout -k 10 ${T_BENCH:-240} python3 scripts/bench_kernels.py --prefill --prefill-cases 8192 \
       --prefill-kernels mosaic,mosaic@fp8,mosaic@int8,mosaic@int4,pallas@int8,pallas@int4 \
       --out "$OUT/prefill_int.json" 2>&1 | tail -12 ;;
  g) export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
     timeout -k 10 ${T_SHAPES:-120} python3 scripts/check_decode_shapes.py 2>&1 | tail -30
     timeout -k 10 ${T_INT:-90} python3 scripts/check_mosaic_quant.py --formats fp8,int8,int4 2>&1 | tail -40 ;;
  *) echo "usage: $0 a|b|b2|b3|b4|c|d|e|f|g|h|i|i2" >&2; exit 2 ;;
esac
