#!/usr/bin/env bash
# Run HERE (with network) before a GPU run that needs packages the H200 image lacks: saves their
# wheels in .whl/ (git-ignored via .git/info/exclude); pass carry=[".whl"] to the device call.
# The H200 image has jax/flax/numpy/tokenizers but not llguidance (structured outputs).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
PY=${PY:-python3}
plats=""
for n in 17 24 27 28 31 34 35; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 $plats -d .whl "llguidance==${LLGUIDANCE_VERSION:-1.9.1}"
ls -la .whl
