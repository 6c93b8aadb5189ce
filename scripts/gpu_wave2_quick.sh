#!/usr/bin/env bash
# The short form of gpu_wave2.sh for one device call of under 10 minutes (the figures the second
# wave's issues most need, each part under its own time limit; whole logs kept in $OUT):
#   1. structured outputs, Llama-3-8B shape: 64 JSON-schema vs 64 unconstrained (gpu_structured.sh);
#   2. TTFT at 2,048 and 32,768 tokens and prefill 64 x 2,048 (default settings, prefill kernel by
#      the start-up probe) vs the FLOP floor, then HF transformers (sdpa) in its own process;
#   3. decode attention B64 ctx 2048 on bf16 / fp8 / int8 / int4 pages (bench_quant.py attention);
#   4. MoE grouped matmul, one Qwen3-30B-A3B layer, 1 / 64 / 512 / 8192 tokens (bench_moe.py gmm);
#   5. speculative decoding: a k = 4 verification step vs a plain decode step at batch 1.
# Results packed into $OUT/results.tgz (the device returns at most 8 files).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ls .whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
part() { echo "######## $1 (t=$(( $(date +%s) - t0 )) s)"; }
part structured; mkdir -p "$OUT/structured"
OUT="$OUT/structured" T1=${T_STRUCT:-160} bash scripts/gpu_structured.sh 2>&1 | tail -10
part ttft; mkdir -p "$OUT/ttft"
E="--ttft-lens 2048 32768 --reps 2 --prefill-batch 64 --prefill-len 2048 --num-prompts 2 --random-input-len 32 --random-output-len 4"
JAXLLM_PREFILL_KERNEL=auto timeout -k 10 ${T_TTFT:-120} python3 scripts/bench_engine.py $E \
  --output-json "$OUT/ttft/ttft_jax.json" > "$OUT/ttft/ttft_jax.log" 2>&1; echo "rc=$?"
grep -E "^== |prefill/mixed attention|KV pool|Can't reduce" "$OUT/ttft/ttft_jax.log" | cut -c1-300
timeout -k 10 ${T_HF:-70} python3 scripts/bench_engine.py --peer hf $E --output-json "$OUT/ttft/ttft_hf.json" \
  > "$OUT/ttft/ttft_hf.log" 2>&1; echo "rc=$?"; grep -E "^== " "$OUT/ttft/ttft_hf.log" | cut -c1-300
part quant_attention; mkdir -p "$OUT/quant"
timeout -k 10 ${T_ATTN:-40} python3 scripts/bench_quant.py attention --batch 64 --ctx 2048 \
  --json "$OUT/quant/quant_attention.json" > "$OUT/quant/quant_attention.log" 2>&1; echo "rc=$?"
sed -n '/^summary/,$p' "$OUT/quant/quant_attention.log" | tail -10
part moe_gmm; mkdir -p "$OUT/moe"
timeout -k 10 ${T_MOE:-80} python3 scripts/bench_moe.py gmm --tokens 1 64 512 8192 \
  --output-json "$OUT/moe/moe_gmm.json" > "$OUT/moe/moe_gmm.log" 2>&1; echo "rc=$?"; tail -14 "$OUT/moe/moe_gmm.log"
part spec_step_b1; mkdir -p "$OUT/spec"
timeout -k 10 ${T_SPEC:-60} python3 scripts/bench_spec.py step --random-shape llama3-8b --dtype bfloat16 --proposer random \
  --batch-size 1 --input-len 1024 --num-iters 40 --seq-buckets 8 --token-buckets 8 --max-num-batched-tokens 8 \
  --output-json "$OUT/spec/spec_step_b1.json" > "$OUT/spec/spec_step_b1.log" 2>&1; echo "rc=$?"
tail -6 "$OUT/spec/spec_step_b1.log"
part done
tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/results.tgz"
