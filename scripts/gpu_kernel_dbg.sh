#!/usr/bin/env bash
# Prefill-kernel development call on one H200 (< 4 min): Mosaic kernel correctness with the
# error located (scripts/check_prefill.py), the engine's probe inside a trace, and a copy of
# the machine's jax Mosaic GPU sources (for reading off the device).
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/jaxsrc"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off
J=$(python3 -c "import jax, os; print(os.path.dirname(jax.__file__))")
cp "$J/experimental/pallas/ops/gpu/attention_mgpu.py" "$J/_src/pallas/mosaic_gpu/primitives.py" \
   "$J/_src/pallas/mosaic_gpu/core.py" "$J/_src/pallas/mosaic_gpu/lowering.py" "$OUT/jaxsrc/" 2>&1
timeout -k 10 ${T1:-150} python3 scripts/check_prefill.py --variants ${VARIANTS:-mosaic,mosaic:64:4,mosaic_wg,twin} \
  ${CASES:+--cases $CASES} 2>&1 | tee "$OUT/check.log" | grep -v '^{' | tail -40
echo "== probe inside a trace"
timeout -k 10 ${T2:-40} python3 - <<'PY' 2>&1 | tail -5
import jax, jax.numpy as jnp
from jaxllm.kernels import prefill_choice
@jax.jit
def f(x):
    print("probe:", prefill_choice.mosaic_prefill_ok(32, 8, 128, 16, "bfloat16"))
    return x + 1
f(1.0)
PY
