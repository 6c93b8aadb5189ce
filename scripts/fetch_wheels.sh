#!/usr/bin/env bash
# Run HERE (with network) before a GPU run that needs packages the H200 image lacks: saves their
# wheels in .whl/ (git-ignored via .git/info/exclude); pass carry=[".whl"] to the device call.
# The H200 image has jax/flax/numpy/tokenizers/httpx but not llguidance (structured outputs) nor
# the server's fastapi/uvicorn/pydantic (`jaxllm serve`: scripts/gpu_engine.sh; fastapi 0.165
# also needs opentelemetry-api, fetched with its dependencies below).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
PY=${PY:-python3}
plats=""
for n in 17 24 27 28 31 34 35; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 $plats -d .whl "llguidance==${LLGUIDANCE_VERSION:-1.9.1}"
# The server's packages with their dependencies (pure Python but pydantic-core).
$PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 $plats -d .whl "fastapi==${FASTAPI_VERSION:-0.165.0}" \
  "uvicorn==${UVICORN_VERSION:-0.54.0}" "pydantic==${PYDANTIC_VERSION:-2.14.4}" prometheus-client
# py-spy (scripts/gpu_structured_profile.sh samples the server with it), gguf, pyzmq.
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 $plats -d .whl \
  "py-spy==${PYSPY_VERSION:-0.4.3}" "gguf==${GGUF_VERSION:-0.19.0}" "pyzmq==${PYZMQ_VERSION:-27.3.0}"
ls -la .whl
