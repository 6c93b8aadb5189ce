"""GPU check of the Mosaic decode kernel across head shapes, against ref.py (poisoned output):

    python3 scripts/check_decode_shapes.py

(K kv heads, G query heads per KV head, head dim D) in Llama-3-8B's (8, 4, 128), Llama-3.2-1B's
(8, 4, 64), SmolLM2's (3, 3, 64) padded to G = 4 (check_padded_group.padded_group), and (3, 3, 128)
padded; B decode tokens at context 512 (B = 1: one 64-key block per split; B = 8 and 64:
several blocks per CTA), 16-token pages. One JSON line per case; ok = rel err < 1e-2.
"""

from __future__ import annotations

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import check_padded_group as cpg  # noqa: E402
from bench_kernels import check  # noqa: E402
from jaxllm.kernels import mosaic_decode, ref  # noqa: E402
from check_padded_group import padded_group  # noqa: E402


def main() -> None:
    bad = 0
    for K, G, D in ((8, 4, 128), (8, 4, 64), (3, 3, 64), (3, 3, 128)):
        cpg.K, cpg.G, cpg.D = K, G, D
        scale = D ** -0.5
        kernel = functools.partial(mosaic_decode.paged_decode_attention, sm_scale=scale)
        fn = kernel if G & (G - 1) == 0 else functools.partial(padded_group, kernel, sm_scale=scale)
        for batch in (1, 8, 64):
            c = cpg.case(batch, 512, 1, layers=2)
            want = np.asarray(jax.jit(functools.partial(ref.ragged_paged_attention, sm_scale=scale))(
                c["qs"][-1], c["kv"], jnp.int32(0), c["md"]).astype(jnp.float32))
            row = dict(K=K, G=G, D=D, batch=batch)
            try:
                err = check(fn, c, want)
                row.update(rel_err=round(err, 5), ok=err < 1e-2)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[-500:]
            bad += not row.get("ok")
            print(json.dumps(row), flush=True)
    print(f"summary: {bad} failed")


if __name__ == "__main__":
    main()
