#!/usr/bin/env bash
# Session 16's GPU calls: speculative steps overlapped with the next (spec/shift.py), issue 18.
# The SmolLM2 GGUF travels in two parts, one a call (`split -b 50M <gguf> .smol/part.`; .smol/ is
# ignored, and a warm machine keeps it between calls).
#   call A (carry .smol/part.aa and .whl): bash scripts/gpu_session16.sh a
#     the verification step at batch 1 / 32 (synchronous, as before), zero acceptance end to end
#     with overlapped verification steps and with synchronous ones (--spec-async off)
#   call B (carry .smol/part.ab and .whl): bash scripts/gpu_session16.sh b
#     SmolLM2 with ngram speculation, batch 1, overlapped verification steps and synchronous ones
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
  a) PARTS="step_b1 step_b32 e2e_zero_accept" bash scripts/gpu_spec.sh ;;
  b) PARTS="e2e_smollm2_ngram" bash scripts/gpu_spec.sh ;;
  *) echo "usage: $0 a|b" >&2; exit 2 ;;
esac
