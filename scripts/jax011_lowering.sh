#!/usr/bin/env bash
# The Mosaic GPU kernels lowered for cuda under the GPU machine's jax (0.11.2) on this CPU
# machine: a Python 3.12 venv (pyenv's 3.12, or $PY312) with jax/jaxlib 0.11.2 from PyPI, then
# the tests that export the kernels for cuda (`-k lowers_for_cuda`; Mosaic's lowering, layout
# inference included, runs in Python at export). CI's jax is 0.10.x, whose lowering differs:
# the int8 / int4 decode kernel exported under 0.10 but failed layout inference under 0.11.2
# (session 21 reproduced and fixed that here, with no GPU). Not part of CI (a second venv).
#   bash scripts/jax011_lowering.sh [test files, default: the Mosaic kernels' tests]  (K=... picks)
set -euo pipefail
cd "$(dirname "$0")/.."
V=${JAX011_VENV:-/tmp/jax011-venv}
PY312=${PY312:-$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1)}
if [ ! -x "$V/bin/python" ]; then
  "${PY312:?no Python 3.12 found: set PY312}" -m venv "$V"
  "$V/bin/pip" install -q "jax==${JAX_VERSION:-0.11.2}" "jaxlib==${JAX_VERSION:-0.11.2}" numpy pytest hypothesis
fi
"$V/bin/python" -c "import jax; print('jax', jax.__version__)"
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(tests/test_mosaic_quant.py tests/test_mosaic_heads.py tests/test_mosaic_verify.py tests/test_qmatmul_mosaic.py tests/test_qmatmul_int_mosaic.py tests/test_moe_gmm_ws.py
                                 tests/test_mosaic_prefill_fp8.py tests/test_prefill_kernel.py)
PYTHONPATH=$PWD "$V/bin/python" -m pytest -rfEp -p no:cacheprovider "${FILES[@]}" -k "${K:-lowers_for_cuda or cuda}"
