#!/usr/bin/env bash
# Session 14's GPU calls (each < 8 minutes). The SmolLM2 GGUF travels in two parts, one a call
# (`split -b 50M <gguf> .smol/part.`; .smol/ is ignored, and a warm machine keeps it between calls).
#   call A (carry .smol/part.aa): bash scripts/gpu_session14.sh a
#     issue 18's verification step at batch 1 / 32, zero-acceptance end to end with random drafts
#     and with a Llama-3.2-1B-shaped random draft (its D = 64 attention back on the decode kernel)
#   call B (carry .smol/part.ab and .whl): bash scripts/gpu_session14.sh b
#     SmolLM2 with ngram speculation (its padded G = 3 heads now on the decode kernel), and the
#     engine on the Llama-3.2-1B / SmolLM2 shapes with and without the decode kernel
#   after the faster ngram and the inline synchronous steps (b8c5d6d):
#   call C (carry .smol/part.aa): bash scripts/gpu_session14.sh c   (batch-32 step, zero acceptance)
#   call D (carry .smol/part.ab and .whl): bash scripts/gpu_session14.sh d   (SmolLM2 ngram)
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
  a) PARTS="step_b1 step_b32 e2e_zero_accept e2e_draft1b_zero_accept" bash scripts/gpu_spec.sh ;;
  b) PARTS="e2e_smollm2_ngram" bash scripts/gpu_spec.sh
     OUT=${OUT:-out}; mkdir -p "$OUT"  # the whole log kept there, its result lines shown here
     timeout -k 10 200 python3 scripts/check_decode_shapes.py --engine --no-kernels > "$OUT/decode_shapes.log" 2>&1
     grep -E '^\{|^  ' "$OUT/decode_shapes.log" ;;
  c) PARTS="step_b32 e2e_zero_accept" bash scripts/gpu_spec.sh ;;
  d) PARTS="e2e_smollm2_ngram" bash scripts/gpu_spec.sh ;;
  *) echo "usage: $0 a|b|c|d" >&2; exit 2 ;;
esac
