"""An EAGLE / EAGLE-3 head split over the target's tensor-parallel mesh (one process).

The head is one Llama decoder layer, split as the target's layers are (`parallel/sharding.py`'s
rules, by the same names): q/k/v and gate/up column-parallel, o and down row-parallel (XLA
all-reduces their partial sums), its pages `[1, 2, K', P, S, D]` by KV head (KV heads repeated
when the mesh does not divide them, `parallel/mesh.py`), attention per shard (`shard_map`), an
own embedding / LM head (EAGLE-3) by vocabulary; fc and the norms are small and replicated.

What it shares with the target is taken as it is placed: the target's embedding and LM head
(vocabulary-parallel; the lookup is the target's masked local gather + all-reduce), and the
hidden states the target step returns (`ModelRunner.last_hidden`, replicated as the target's
residual stream is, read in place by the head's program: no copy, no transfer).

Why split rather than replicate: a replicated head would hold all its KV heads on every device
(per block, as much as one whole target layer's KV: 25% on top of an 8B target's share at
tp=8), and run the same step N times over. Split, its pages cost 1/N of that on each device,
and the same block ids index them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.models.config import ModelConfig
from jaxllm.spec.draft import split_layout

HEAD = "EAGLE head"  # (in the errors of speculative_config.model)

# Head weights split like the target's stacked layer weights (by name, without the layer axis).
_LAYER = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def place_head(cfg: ModelConfig, w: dict[str, np.ndarray], dtype, par) -> tuple[ModelConfig, dict]:
    """(the head's config with its stored KV heads, its weights placed shard by shard on the
    mesh of `par`, the target's `TensorParallel`)."""
    import dataclasses
    from jaxllm.parallel.sharding import param_spec, repeat_kv_heads
    layout = split_layout(cfg, par.tp, HEAD)
    out = {}
    for name, a in w.items():
        a = np.asarray(a)
        if name in ("wk", "wv"):
            a = repeat_kv_heads(a, layout, cfg.head_dim)
        if name in _LAYER:
            spec = P(*param_spec(name, (1, *a.shape), par.tp)[1:])
        elif name in ("embed", "lm_head"):
            spec = param_spec(name, a.shape, par.tp)
        else:
            spec = P()
        a = a.astype(np.int32 if name == "d2t" else jnp.dtype(dtype), copy=False)
        out[name] = jax.device_put(a, NamedSharding(par.mesh, spec))
    return dataclasses.replace(cfg, num_kv_heads=layout.stored_kv_heads), out


def jit_program(fn, weights: dict, par):
    """jit the head's program `fn(w, pages, hidden, tok, md, sel, pos0, count, tables) -> (pages,
    drafts)` with fixed shardings: the pages split in place, everything else replicated (a
    mis-placed input is an error, not a recompile)."""
    w = {n: a.sharding for n, a in weights.items()}
    rep = par.replicated
    return jax.jit(fn, donate_argnums=(1,), in_shardings=(w, par.kv_sharding, *[rep] * 7),
                   out_shardings=(par.kv_sharding, rep))
