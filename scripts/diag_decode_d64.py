"""GPU diagnosis of the Mosaic decode kernel at head dim 64 (wrong on the H200 when a CTA walks
more than one 64-key block; right at D = 128 and with one block: check_decode_shapes.py):

    python3 scripts/diag_decode_d64.py

Kernel variants (the kernel body's source with one edit each: the kernel as it is, as it was
before q was read again every block, and two edits of the rescale that changed nothing) x inputs (random; K = 0, so every
score is equal and the online softmax never rescales; V = 1, so any output but 1 means the
accumulator and the denominator were rescaled differently; q = 0: every score 0 again, unless
the QK product reads something else than q), Llama-3.2-1B heads (K 8, G 4, D
64), context 512, batch 8 and 64. One JSON line per case; ok = rel err < 1e-2.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import check_padded_group as cpg  # noqa: E402
from bench_kernels import check  # noqa: E402
from jaxllm.kernels import mosaic_decode, mosaic_decode_kernel, ref  # noqa: E402

RESCALE = "            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])\n"
Q_IN_REGISTERS = ("        reload_q = head_dim == keys\n", "        reload_q = False\n")
EDITS = {
    "base": [],
    # on the kernel as it was (q in registers): the carried accumulator and the row factor
    # pinned to their layouts in the loop
    "pinned": [Q_IN_REGISTERS, (
        RESCALE, "            acc = cast(acc, plgpu.Layout.WGMMA)\n"
                 "            alpha = cast(alpha, row)\n"
                 "            acc = acc * cast(lax.broadcast_in_dim(alpha, acc.shape, [0]), plgpu.Layout.WGMMA)\n")],
    # ... and the factor built as the scores' broadcasts are (the form that is right at D = 128)
    "wide": [Q_IN_REGISTERS, (
        RESCALE, "            acc = acc * jnp.exp2(lax.broadcast_in_dim(m, acc.shape, [0])"
                 " - lax.broadcast_in_dim(m_new, acc.shape, [0]))\n")],
    # the kernel as landed (ad944ef) reads q from SMEM every block at D = 64; "q_in_registers"
    # undoes that (the kernel as it was), "base" is the kernel as it is
    "q_in_registers": [Q_IN_REGISTERS],
}


def _module(name: str, path: str, src: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = path
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def variant(name: str):
    """The wrapper module (mosaic_decode.py) launching an edited copy of the kernel body
    (mosaic_decode_kernel.py)."""
    path = mosaic_decode_kernel.__file__
    src = open(path).read()
    for old, new in EDITS[name]:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    body = _module(f"mosaic_decode_kernel_{name}", path, src)
    mod = _module(f"mosaic_decode_{name}", mosaic_decode.__file__, open(mosaic_decode.__file__).read())
    mod.decode_kernel = body.decode_kernel
    return mod


def main() -> None:
    cpg.K, cpg.G, cpg.D = 8, 4, 64
    scale = 64 ** -0.5
    reff = jax.jit(functools.partial(ref.ragged_paged_attention, sm_scale=scale))
    for name in EDITS:
        try:
            mod = variant(name)
        except Exception as e:  # noqa: BLE001
            print(json.dumps(dict(variant=name, error=repr(e)[-300:])), flush=True)
            continue
        for batch, splits, stages in ((8, None, None), (8, 8, None), (64, None, None), (64, None, 1)):
            for inp in ("random", "k0", "v1", "q0"):
                c = cpg.case(batch, 512, 1, layers=2)
                if inp == "k0":
                    c["kv"] = c["kv"].at[:, 0].set(0)
                elif inp == "v1":
                    c["kv"] = c["kv"].at[:, 1].set(1)
                if inp == "q0":  # every score 0 whatever K is
                    c["qs"] = jnp.zeros_like(c["qs"])
                want = np.asarray(reff(c["qs"][-1], c["kv"], jnp.int32(0), c["md"]).astype(jnp.float32))
                fn = functools.partial(mod.paged_decode_attention, sm_scale=scale, num_splits=splits,
                                       num_stages=stages)
                row = dict(variant=name, batch=batch, splits=splits, stages=stages, input=inp)
                try:
                    row["rel_err"] = round(check(fn, c, want), 5)
                    row["ok"] = row["rel_err"] < 1e-2
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[-300:]
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
