"""Weight quantization (fp8 / int8 / int4) and pre-quantized checkpoints kept quantized.

`methods.py` (names and checks, no JAX), `qarray.py` (the quantized weight and its matmul),
`quantize.py` (quantizing a float state at load), `checkpoints.py` (HF FP8 and GGUF Q8_0 /
Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K tensors), `kernels.py` (the matmul paths and their tuning table).
KV-cache quantization lives beside the kernels that read it: `jaxllm/kernels/kv_quant.py`.
"""
