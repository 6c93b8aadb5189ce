#!/usr/bin/env bash
# Session 38's GPU calls (the device's 10-minute limit each; whole logs in $OUT):
#   a (~8 min, any Hopper card): the Qwen3-30B-A3B batch-1 step in its bucket of two tokens (issue
#     15, target <= 1.5x the floor), three processes: the default (decode attention split up to
#     16 ways; the split merge now cut by query rows, `split_combine.chunk_rows`, 4 programs a
#     (token, KV head) where session 37 had one), JAXLLM_DECODE_MAX_SPLITS=32
#     (`decode_schedule.split_cap`: one token's 4 KV heads take 128 CTAs, not 64), and that with
#     JAXLLM_ROPE_WRITE=kernel (head norms, RoPE and the K/V write in one kernel, now over
#     (token, head group) programs). Before them, `check_moe_kernels.py --cases rope_write` times
#     the kernel against XLA's path alone; last, that in a bucket of one token ("bucket1": no
#     padding row, so the direct expert kernels launch no dead slots, and the one-row dense
#     linears can take `kernels/gemv.py` where the warm-up measures it faster than XLA's
#     padded-to-two GEMM). RUNS_A picks the runs (default "split16 split32 rope bucket1").
#   l (~4 min, an H200 for issue 14's figure): the Llama-3-8B batch-1 step at context 2,048
#     (issue 14: <= 1.15x the floor on an H200; 1.08x on session 33's H100), the default and with
#     JAXLLM_ROPE_WRITE=all (RoPE and the K/V write of a model without head norms in one kernel:
#     the same 426 kernels a step as XLA's under jax 0.10, where the K/V write was one scatter;
#     jax 0.11.2 compiled it as two on session 37's H200), three steps profiled each.
#   k (~6 min, any Hopper card): issue 17's "batch 64 with fp8 weights and fp8 KV <= 0.6x" of bf16,
#     never run (gpu_quant.sh's QUANT_EXTRA part never was): Llama-3-8B shape, decode batch 64 at
#     context 2,048, bf16 and then `--quantization fp8 --kv-cache-dtype fp8`, two processes in one
#     call, and their ratio. PROF_K=n: n more steps each under the profiler (gpu_session39.sh k).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
OUT=${OUT:-out}; mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "${1:-}" in
  a) timeout -k 5 ${T_K:-80} python3 scripts/check_moe_kernels.py --tokens 2 --cases rope_write \
       --json "$OUT/rope.json" > "$OUT/rope.log" 2>&1; echo "rc=$? (rope_write alone)"
     grep -E "^(floor|rope)" "$OUT/rope.log"
     for run in ${RUNS_A:-split16 split32 rope bucket1}; do
       env="" bucket=2
       case "$run" in split32) env="JAXLLM_DECODE_MAX_SPLITS=32" ;;
         rope) env="JAXLLM_DECODE_MAX_SPLITS=32 JAXLLM_ROPE_WRITE=kernel" ;;
         bucket1) env="JAXLLM_DECODE_MAX_SPLITS=32 JAXLLM_ROPE_WRITE=kernel" bucket=1 ;; esac
       env $env XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95} timeout -k 5 ${T_B:-125} \
         python3 scripts/bench_moe.py decode --random-shape qwen3-30b-a3b --batch-size 1 --min-bucket $bucket \
         --input-len 2048 --num-iters 20 --profile-steps 2 --output-json "$OUT/b1_$run.json" > "$OUT/b1_$run.log" 2>&1
       echo "rc=$? ($run: $env)"
       grep -E "^decode|^  /device|^    |kernels a step" "$OUT/b1_$run.log" | cut -c1-700
       grep -E "dense linears at|grouped matmul by measurement" "$OUT/b1_$run.log" | cut -c1-600
     done ;;
  k) for run in bf16 fp8kv; do
       flag=""; [ $run = fp8kv ] && flag="--quantization fp8 --kv-cache-dtype fp8"
       XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout -k 10 ${T_Q:-170} python3 scripts/bench_latency.py \
         --random-shape llama3-8b --input-len 2048 --num-iters 10 --max-num-batched-tokens 64 --batch-size 64 \
         --profile-steps ${PROF_K:-0} $flag --output-json "$OUT/b64_$run.json" > "$OUT/b64_$run.log" 2>&1
       echo "rc=$? ($run)"
       grep -A$((${PROF_K:-0} ? 14 : 3)) "^C = " "$OUT/b64_$run.log" | cut -c1-700
     done
     python3 -c "import json; a, b = (json.load(open('$OUT/b64_' + m + '.json'))['rows'][0]['step_s'] for m in ('bf16', 'fp8kv')); print(f'batch 64, fp8 weights + fp8 KV / bf16 step: {b / a:.3f} ({b * 1e3:.2f} / {a * 1e3:.2f} ms; issue 17: <= 0.6)')" ;;
  l) for run in xla all; do
       JAXLLM_ROPE_WRITE=$run XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout -k 10 ${T_L:-120} python3 \
         scripts/bench_latency.py --random-shape llama3-8b --input-len 2048 --num-iters 10 \
         --max-num-batched-tokens 64 --batch-size 1 --profile-steps 3 --output-json "$OUT/b1_8b_$run.json" \
         > "$OUT/b1_8b_$run.log" 2>&1; echo "rc=$? (JAXLLM_ROPE_WRITE=$run)"
       grep -A4 "^C = " "$OUT/b1_8b_$run.log" | cut -c1-300; grep -iE "busy|kernels" "$OUT/b1_8b_$run.log" | cut -c1-600 | head -3
     done ;;
  *) echo "usage: $0 a|l|k" >&2; exit 2 ;;
esac
