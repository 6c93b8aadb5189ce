#!/usr/bin/env bash
# Session 36's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   p (~9 min, any Hopper card; an H200 for issue 15's figures): MOE_PARTS="3 2" scripts/gpu_moe.sh
#     (the prefill 8 x 2,048 MFU; the decode step at batch 1 and 64, where the warm-up now also
#     times the direct decode kernel with its down launch under each unsplit tiling), then batch 1
#     with the split router kernel (JAXLLM_MOE_ROUTER=split: the RMSNorm, router GEMV, softmax,
#     top-k in two launches, 3 kernels a layer fewer; probed at start-up, XLA's router if wrong)
#     in a bucket of two tokens (`--min-bucket 2`: a padding row the direct kernel skips; compiled
#     for an H100 on the CPU, 731 kernels a step against 875 in the bucket of one: no one-row
#     product padded to two, each RMSNorm one kernel, the K/V write one scatter).
#   c (~5.5 min, the machine `t` left warm): the router alone at a 2-token bucket (xla, the one-program
#     kernel, split: `check_moe_kernels.py --tokens 2 --cases router`), then batch 1 in a bucket of
#     two tokens with the split router (rows of 1-2 tokens summed on the CUDA cores, the RMSNorm
#     statistics in one load, the 32 partials in one load: `p`'s split kernels took 11.4 and
#     10.5 us a layer) and with XLA's router.
#   t (~9 min): MOE_PARTS="4 5" scripts/gpu_moe.sh: offline throughput 512 x (512 -> 256) against
#     HF transformers (grouped_mm experts) in its own process (target >= 3x). On session 36's H100
#     both parts ran out of their 270 s: HF (torch.compile, batches of 96) printed no figure; the
#     engine was ready after ~3.5 min (weights drawn, three expert stacks split through host
#     memory, the grouped-matmul warm-up) and was 72 s into the 512 requests. So one part a call:
#   t5 (~9 min): the engine's offline throughput alone (T5=560), no peer ratio;
#   t4 (~9 min): the HF peer alone (T4=560) into $OUT/moe_tput_hf.json; `bench_throughput.py
#     --hf-result` reads it back for the ratio (or compare the two JSONs by hand).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "${1:-}" in
  p) MOE_PARTS="3 2" T3=${T3:-150} T2=${T2:-230} bash scripts/gpu_moe.sh
     grep -E "grouped matmul by measurement|grouped matmul timings" "$OUT/moe_prefill.log" | cut -c1-1200
     grep -E "by measurement|down_" "$OUT/moe_decode.log" | head -6 | cut -c1-1500
     JAXLLM_MOE_ROUTER=split XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95} timeout -k 10 ${T_B2:-150} \
       python3 scripts/bench_moe.py decode --random-shape qwen3-30b-a3b --batch-size 1 --min-bucket 2 --input-len 2048 \
       --num-iters 20 --profile-steps 3 --output-json "$OUT/moe_decode_split.json" > "$OUT/moe_decode_split.log" 2>&1
     echo "rc=$? (split router)"
     grep -E "^decode|^engine grouped|^  /device|^    |kernels a step" "$OUT/moe_decode_split.log" | cut -c1-400
     grep -iE "router kernel" "$OUT/moe_decode_split.log" | head -3 | cut -c1-300 ;;
  c) timeout -k 5 ${T_K:-50} python3 scripts/check_moe_kernels.py --tokens 2 --cases router --json "$OUT/router.json" \
       > "$OUT/router.log" 2>&1; echo "rc=$? (router alone)"; grep -E "^(floor|router)" "$OUT/router.log"
     for r in split xla; do
       JAXLLM_MOE_ROUTER=$r XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95} timeout -k 5 ${T_B:-135} \
         python3 scripts/bench_moe.py decode --random-shape qwen3-30b-a3b --batch-size 1 --min-bucket 2 --input-len 2048 \
         --num-iters 20 --profile-steps 2 --output-json "$OUT/moe_decode_b2_$r.json" > "$OUT/moe_decode_b2_$r.log" 2>&1
       echo "rc=$? ($r router, bucket 2)"
       grep -E "^decode|^  /device|^    |kernels a step" "$OUT/moe_decode_b2_$r.log" | cut -c1-600
       grep -iE "router kernel" "$OUT/moe_decode_b2_$r.log" | head -3 | cut -c1-300
     done ;;
  t) MOE_PARTS="4 5" T4=${T4:-270} T5=${T5:-270} bash scripts/gpu_moe.sh ;;
  t5) MOE_PARTS="5" T5=${T5:-560} bash scripts/gpu_moe.sh ;;
  t4) MOE_PARTS="4" T4=${T4:-560} bash scripts/gpu_moe.sh ;;
  *) echo "usage: $0 p|c|t|t5|t4" >&2; exit 2 ;;
esac
