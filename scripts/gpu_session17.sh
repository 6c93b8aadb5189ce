#!/usr/bin/env bash
# The GPU calls planned in session 17 (no GPU was lent in sessions 16 and 17), in priority order,
# each under the device's 10-minute limit (parts have their own timeouts). The SmolLM2 GGUF
# travels in two parts, one a call (`split -b 50M <gguf> .smol/part.`; .smol/ is ignored, and a
# warm machine keeps it between calls); `.whl/` holds the gguf wheel the image lacks.
#   a (carry .smol/part.aa, .whl; ~7 min): issue 18 -- the verification step at batch 1 / 32,
#     zero acceptance end to end with overlapped and synchronous verification steps; then
#     issue 17 -- quantized-weight matmuls incl. jaxllm's Pallas int8/int4 kernel (qmatmul.py)
#   b (carry .smol/part.ab, .whl; ~8 min): issue 18 -- SmolLM2 ngram, overlapped and synchronous;
#     issue 17 -- decode step batch 1 with bf16 / fp8 / int4 weights (int4/int8 paths now chosen
#     by measurement at warm-up: the log's "quantized matmuls by measurement" line)
#   c (~6 min): issue 14 -- TTFT 2k/8k/32k and prefill throughput, with the prefill kernel chosen
#     per bucket by measurement (the log's "prefill/mixed attention" lines)
#   d (~9 min): issue 15 -- scripts/gpu_moe.sh (grouped matmul, decode, prefill, offline vs HF)
#   e (~5 min): issue 16 -- structured outputs through the server (gpu_structured_serving.sh)
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
  a) PARTS="step_b1 step_b32 e2e_zero_accept" bash scripts/gpu_spec.sh
     QUANT_PARTS=1 bash scripts/gpu_quant.sh ;;
  b) PARTS="e2e_smollm2_ngram" bash scripts/gpu_spec.sh
     QUANT_PARTS=3 bash scripts/gpu_quant.sh ;;
  c) bash scripts/gpu_ttft.sh ;;
  d) bash scripts/gpu_moe.sh ;;
  e) bash scripts/gpu_structured_serving.sh ;;
  *) echo "usage: $0 a|b|c|d|e" >&2; exit 2 ;;
esac
