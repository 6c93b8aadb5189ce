#!/usr/bin/env bash
# Prefill kernel on one H200, one call (< 4 min): (1) the Mosaic kernel's correctness on ragged
# batches with the error located (scripts/check_prefill.py: poisoned outputs, q~N and q=0,
# GQA 1/4/8, pages 16-128, chunks over a cached prefix, decode rows, padding); (2) the engine's
# probe, reached inside a trace as in the engine; (3) scripts/bench_kernels.py --prefill:
# the paged kernels against torch SDPA (cuDNN, flash) and jax cuDNN attention in the same run
# (mosaic_direct: the kernel without its alignment lax.cond, to price the cond; mosaic:128:3:
# a 3-stage K/V ring). Runtime <= T1 + T2 + T3 = 100 + 30 + 240 s by default (on 2026-12-02
# T1=50 covered 7 of the 14 check rows and T3=115 three cases x 5 kernels).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
echo "== check"
timeout -k 10 ${T1:-100} python3 scripts/check_prefill.py --variants ${VARIANTS:-mosaic} \
  ${CASES:+--cases $CASES} --out "$OUT/check_prefill.json" 2>&1 | tee "$OUT/check.log" | grep -v '^{' | tail -16
echo "== probe inside a trace"
timeout -k 10 ${T2:-30} python3 - <<'PY' 2>&1 | tail -3
import jax
from jaxllm.kernels import prefill_choice
@jax.jit
def f(x):
    print("probe:", prefill_choice.mosaic_prefill_ok(32, 8, 128, 16, "bfloat16"))
    return x + 1
f(1.0)
PY
echo "== bench"
PREFILL_SMOKE=${PREFILL_SMOKE:-} timeout -k 10 ${T3:-240} python3 scripts/bench_kernels.py --prefill \
  --prefill-cases ${PCASES:-8192,32768,ragged8,mixed,2048} \
  --prefill-kernels ${KERNELS:-mosaic,mosaic_direct,mosaic:128:3,pallas,jax_cudnn,jax_mgpu,torch_cudnn,torch_flash} \
  --out "$OUT/prefill_kernels.json" 2>&1 | tee "$OUT/prefill_kernels.log" | grep -v "^    \|^  smoke" | tail -14
