"""What the decode kernel's `qk_fp8` (JAXLLM_DECODE_QK_FP8=1) costs in quality, on the embedded
SmolLM2 on the CPU: perplexity of eval_quant's fixed text and KL from the float model with fp8
(e4m3) KV pages, first as the engine runs them, then with the query rounded to e4m3 as the
kernel rounds it (`mosaic_decode.q_fp8`). The CPU engine runs the reference attention, so the
rounding is emulated there; the kernel matches the reference on the rounded query to 3e-3
(tests/test_mosaic_quant.py). Prints one JSON line.

    JAX_PLATFORMS=cpu python scripts/eval_qk_fp8.py
"""

from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval_quant import TEXT, evaluate  # noqa: E402

from jaxllm.kernels import mosaic_decode, ref  # noqa: E402


def main() -> None:
    modes = [("kv_fp8", {"kv_cache_dtype": "fp8"})]
    plain = evaluate(None, modes, TEXT, gen_tokens=0, pad_to=1)["kv_fp8"]
    exact = ref.ragged_paged_attention

    def rounded_q(q, kv_pages, layer, md, *, sm_scale):
        if kv_pages.dtype != jnp.float8_e4m3fn:
            return exact(q, kv_pages, layer, md, sm_scale=sm_scale)
        q8 = mosaic_decode.q_fp8(q, sm_scale).astype(q.dtype)  # scaled by sm_scale * log2(e)
        return exact(q8, kv_pages, layer, md, sm_scale=float(np.log(2.0)))

    ref.ragged_paged_attention = rounded_q  # read by the engine's runner when it is built
    try:
        qk8 = evaluate(None, modes, TEXT, gen_tokens=0, pad_to=1)["kv_fp8"]
    finally:
        ref.ragged_paged_attention = exact
    keep = ("ppl", "ppl_ratio", "kl")
    print(json.dumps({"kv_fp8": {k: plain[k] for k in keep},
                      "kv_fp8_qk_fp8": {k: qk8[k] for k in keep}}))


if __name__ == "__main__":
    main()
