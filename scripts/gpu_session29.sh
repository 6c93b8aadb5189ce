#!/usr/bin/env bash
# Session 29's GPU calls (each under the device's 10-minute limit; whole logs in $OUT). Session 29
# had no device time: these measure its CPU-side changes, found by counting a step's kernels and
# host launches on the CPU (scripts/aot_kernels.py, XLA's deviceless compile for an H100).
#   k (~1.5 min): the same counts under the GPU machine's jax (0.11.2; this machine has 0.10.2):
#     does XLA there put Mosaic GPU custom calls into command buffers (CUDA graphs)? Under 0.10.2
#     it does not: 160 of them cut an fp8 Llama-3-8B batch-1 step into 572 host launches (321
#     with graphs of 2+ kernels), bf16's into 65. Prints one JSON line per configuration.
#   e1 (~6 min): issue 17 decode batch 1, context 2,048, Llama-3-8B shape: bf16, fp8, fp8cb, fp8pallas
#     (scripts/gpu_session27.sh e; target fp8 <= 0.6x bf16).
#   e2 (~6 min): bf16, int4 (q/k/v and gate/up now fused: 669 launches, 797 apart), int4cb,
#     int4pallas (target int4 <= 0.4x bf16).
#   e0 (~5 min): bf16, bf16nocb (XLA's command buffers off) and bf16sb (JAXLLM_STABLE_BATCH=1: the
#     layers read a copy of the batch the step makes, not the new input buffers; seen in the CPU
#     compile, 201 kernels of the MoE step read them directly, 0 with it). Session 26's MoE batch-1 step spent
#     6.6 ms of host time in the jitted call with 97 host launches (49 command buffers holding
#     1,064 kernels, compiled on the CPU): if XLA re-records its graphs every step (their buffers'
#     addresses changing, e.g. temporaries of overlapped steps), graphs cost more than launches.
#   g (~9 min, needs_h200; three runs of at most T_G=180 s): MoE decode batch 1 and 64,
#     Qwen3-30B-A3B shape: XLA's default command buffers, none, and JAXLLM_STABLE_BATCH=1. llama.linear now keeps the one-token q/k/v/o projections
#     GEMMs (the compiled step wrote their products to memory, 3.7 GB written and read a step: 1,355 -> 1,115 kernels).
#   then f, s, d, q, p, a as scripts/gpu_session27.sh.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-}" in
  k) for cfg in "--shape llama3-8b" "--shape llama3-8b --quantization fp8" \
                "--shape llama3-8b --quantization fp8 --option xla_gpu_graph_min_graph_size=2" \
                "--shape llama3-8b --quantization int4 --path mosaic_nk" \
                "--shape qwen3-30b-a3b --gmm direct_decode_128x64k4 --target h200"; do
       echo "== k. $cfg"
       JAX_PLATFORMS=cpu timeout -k 10 ${T_K:-120} python3 scripts/aot_kernels.py --tokens 1 $cfg --top 12 \
         > "$OUT/aot.log" 2>&1; echo "rc=$?"; grep "^{" "$OUT/aot.log" | cut -c1-1200; grep -iE "error" "$OUT/aot.log" | tail -2 | cut -c1-300
     done ;;
  e0) RUNS_E=${RUNS_E:-"bf16 bf16nocb bf16sb"} bash scripts/gpu_session27.sh e ;;
  g) for v in "|0" "--xla_gpu_enable_command_buffer=|0" "|1"; do
       flags=${v%|*}; sb=${v#*|}
       echo "== g. MoE decode, XLA_FLAGS='$flags' JAXLLM_STABLE_BATCH=$sb"
       JAXLLM_STABLE_BATCH=$sb XLA_FLAGS="$flags" XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 ${T_G:-180} python3 scripts/bench_moe.py decode \
         --random-shape qwen3-30b-a3b --batch-size 1 64 --input-len 2048 --num-iters 20 --profile-steps 3 \
         --output-json "$OUT/moe_decode_g${#flags}_$sb.json" > "$OUT/moe_decode_g${#flags}_$sb.log" 2>&1; echo "rc=$?"
       grep -E "^decode|^  /device|kernels a step" "$OUT/moe_decode_g${#flags}_$sb.log" | cut -c1-400
     done ;;
  e1) RUNS_E=${RUNS_E:-"bf16 fp8 fp8cb fp8pallas"} bash scripts/gpu_session27.sh e ;;
  e2) RUNS_E=${RUNS_E:-"bf16 int4 int4cb int4pallas"} bash scripts/gpu_session27.sh e ;;
  *) bash scripts/gpu_session27.sh "$@" ;;
esac
