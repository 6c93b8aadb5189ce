"""Qwen3-MoE, Qwen2-MoE and Mixtral: the Llama-family decoder with expert MLPs.

Attention is `Llama`'s. Each layer's MLP is either dense (its weights in
`layers`, as in llama.py, for the layers of `mlp_only_layers` /
`decoder_sparse_step`) or the expert block (`experts`, stacked [Lm, E, ...]:
router, per-expert SwiGLU, Qwen2-MoE's sigmoid-gated shared expert). The layer
scan runs over segments of consecutive layers of one kind, so an all-MoE model
is one scan and a mixed one a few.

Hooks: `experts_fn(x, weights, ids, w_gate, w_up, w_down, valid)` computes the
routed experts (default `moe.experts` on one device; parallel/experts.py wraps
it in shard_map for tensor or expert parallelism); `expert_map` (see eplb.py)
turns logical expert ids into physical slots when experts are replicated;
`router_fn(x, w_router, valid, top_k, routing, norm_topk_prob, ln_mlp, eps)` normalises the
residual stream and routes in one kernel (kernels/moe_router.py `route_small`, on one GPU),
returning (weights, ids, normed x), or None where it does not take the batch (XLA's RMSNorm and
router then): its padding tokens come back with id E, so `experts_fn` gets no `valid`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.models import llama, llama_state
from jaxllm.models.config import ModelConfig
from jaxllm.models.linear import consumers, linear
from jaxllm.models.llama import Llama, LayerStack, _param
from jaxllm.models.params import value
from jaxllm.models.moe import expert_loads, experts as moe_experts, route, split_experts
from jaxllm.models.moe_config import MoEConfig
from jaxllm.quantization import act

EXPERT_WEIGHTS = ("e_gate", "e_up", "e_down")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = ModelConfig.from_hf(hf)
    return dataclasses.replace(cfg, moe=MoEConfig.from_hf(hf, cfg.num_layers))


def segments(cfg: ModelConfig) -> list[tuple[bool, int, int, int]]:
    """(is_moe, first layer, layer count, first index in that kind's stack) per run of one kind."""
    out: list[list] = []
    counts = {True: 0, False: 0}
    for i in range(cfg.num_layers):
        kind = cfg.moe.is_moe(i)
        if out and out[-1][0] == kind:
            out[-1][2] += 1
        else:
            out.append([kind, i, 1, counts[kind]])
        counts[kind] += 1
    return [tuple(s) for s in out]


class ExpertStack(nnx.Module):
    """The MoE layers' weights, each with a leading [Lm] axis.

    `placement` ([Lm, S] physical slot -> logical expert, EPLB) stores S slots per
    layer instead of E experts, plus the map arrays `log2phys` / `log_count`
    (eplb/balancer.py); random weights are drawn per expert and copied to its slots.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, placement: np.ndarray | None = None,
                 expert_split: tuple[int, int] | None = None):
        m: MoEConfig = cfg.moe
        Lm, H, F, E = len(m.moe_layers), cfg.hidden_size, m.moe_intermediate_size, m.num_experts
        self.router = _param((Lm, H, E), dtype, rngs)
        self.e_gate = _param((Lm, E, H, F), dtype, rngs)
        self.e_up = _param((Lm, E, H, F), dtype, rngs)
        self.e_down = _param((Lm, E, F, H), dtype, rngs)
        if placement is not None:
            from jaxllm.eplb.placement import maps

            rows = np.arange(Lm)[:, None]
            for name in ("e_gate", "e_up", "e_down"):
                var = getattr(self, name)
                var.set_value(value(var)[rows, placement])
            l2p, cnt = maps(placement, E)
            self.log2phys = nnx.Variable(jnp.asarray(l2p))
            self.log_count = nnx.Variable(jnp.asarray(cnt))
        if expert_split is not None:  # (groups, splits): the expert x tensor parallel layout
            for name in ("e_gate", "e_up", "e_down"):
                var = getattr(self, name)
                var.set_value(split_experts(value(var), name, *expert_split))
        Fs = m.shared_expert_intermediate_size
        if Fs:
            self.s_gate = _param((Lm, H, Fs), dtype, rngs)
            self.s_up = _param((Lm, H, Fs), dtype, rngs)
            self.s_down = _param((Lm, Fs, H), dtype, rngs)
            self.s_router = _param((Lm, H, 1), dtype, rngs)

    def weights(self) -> dict[str, jax.Array]:
        return {k: value(v) for k, v in vars(self).items() if isinstance(v, nnx.Variable)}


class MoeLlama(Llama):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
                 attention_fn=None, embed_fn=None, experts_fn: Callable | None = None,
                 expert_map: Callable | None = None, num_slots: int | None = None,
                 placement: np.ndarray | None = None, count_loads: bool = False,
                 expert_split: tuple[int, int] | None = None, router_fn: Callable | None = None,
                 rope_write_fn: Callable | None = None):
        super().__init__(cfg, dtype, rngs=rngs, attention_fn=attention_fn, embed_fn=embed_fn,
                         rope_write_fn=rope_write_fn)
        m: MoEConfig = cfg.moe
        self.layers = LayerStack(cfg, dtype, rngs, mlp_layers=cfg.num_layers - len(m.moe_layers))
        self.experts = ExpertStack(cfg, dtype, rngs, placement, expert_split)
        self.experts_fn = experts_fn or moe_experts
        # expert_map(ids [T, k], layer weights, md) -> physical slot ids [T, k] (EPLB); None: identity
        self.expert_map = expert_map
        self.count_loads = count_loads  # also return rows per logical expert [Lm, E] (EPLB)
        self.router_fn = router_fn

    def _moe(self, x: jax.Array, w: dict[str, jax.Array], md: AttentionMetadata):
        """The expert block on the residual stream x (its RMSNorm first): (output [T, H], rows
        per logical expert [E])."""
        m: MoEConfig = self.cfg.moe
        valid = md.positions >= 0
        routed = None
        if self.router_fn is not None and self.expert_map is None:
            routed = self.router_fn(x, w["router"], valid, m.top_k, m.routing, m.norm_topk_prob,
                                    w["ln_mlp"], self.cfg.rms_norm_eps)
        if routed is None:
            h = act.norm(x, w["ln_mlp"], self.cfg.rms_norm_eps)
            logits = linear(h, w["router"], out_dtype=jnp.float32)
            weights, ids = route(logits, m.top_k, m.routing, m.norm_topk_prob)
        else:
            weights, ids, h = routed  # padding tokens: id E, no expert; h normed by the kernel
        load = expert_loads(ids, m.num_experts, valid)
        if self.expert_map is not None:
            ids = self.expert_map(ids, w, md)
        y = self.experts_fn(h, weights, ids, w["e_gate"], w["e_up"], w["e_down"],
                            valid if routed is None else None)
        if m.shared_expert_intermediate_size:
            shared = linear(jax.nn.silu(linear(h, w["s_gate"])) * linear(h, w["s_up"]),
                                  w["s_down"])
            y = y + jax.nn.sigmoid(linear(h, w["s_router"])) * shared
        return y, load

    def _layer(self, x, w, kv_pages, layer, md, inv_freq):
        """One decoder layer: (x, kv_pages, expert load [E] or None for a dense layer, the
        layer's (k_scale, v_scale) as used)."""
        x, kv_pages, scale = self._attention(x, w, kv_pages, layer, md, inv_freq)
        if "router" not in w:
            h = act.norm(x, w["ln_mlp"], self.cfg.rms_norm_eps,
                         consumers(w, "w_gate", "w_up", "w_gu"))
            return x + self._mlp(h, w, md), kv_pages, None, scale
        y, load = self._moe(x, w, md)
        return x + y, kv_pages, load, scale

    def _layers(self, x, kv_pages, md, inv_freq, layer_weights):
        loads, used = [], []
        kv_scale = value(self.kv_scale)
        if layer_weights is not None:
            layer_fn = llama.per_layer(self._layer, inv_freq)
            for i, w in enumerate(layer_weights):
                x, kv_pages, load, scale = layer_fn(x, self._with_kv_scale(w, kv_scale[i]), kv_pages,
                                                    jnp.int32(i), md)
                used.append(scale[None])
                if load is not None:
                    loads.append(load[None])
            self._set_kv_scale(jnp.concatenate(used))
            return (x, kv_pages, jnp.concatenate(loads)) if self.count_loads else (x, kv_pages)
        attn = self._with_kv_scale(self.layers.weights(), kv_scale)
        experts = self.experts.weights()
        dense = {k: attn.pop(k) for k in ("w_gate", "w_up", "w_down") if k in attn}
        L = self.cfg.num_layers

        def body(carry, xs):
            x, kv = carry
            w, layer = xs
            x, kv, load, scale = self._layer(x, w, kv, layer, md, inv_freq)
            return (x, kv), (load, scale)

        def part(tree: dict, start: int, n: int, total: int) -> dict:
            if start == 0 and n == total:
                return tree
            return {k: jax.lax.slice_in_dim(v, start, start + n) for k, v in tree.items()}

        for is_moe, first, n, j in segments(self.cfg):
            mlp = experts if is_moe else dense
            total = len(self.cfg.moe.moe_layers) if is_moe else L - len(self.cfg.moe.moe_layers)
            w = part(attn, first, n, L) | part(mlp, j, n, total)
            layer_ids = jnp.arange(first, first + n, dtype=jnp.int32)
            (x, kv_pages), (load, scale) = jax.lax.scan(body, (x, kv_pages), (w, layer_ids))
            used.append(scale)
            if is_moe:
                loads.append(load)
        self._set_kv_scale(jnp.concatenate(used))
        return (x, kv_pages, jnp.concatenate(loads)) if self.count_loads else (x, kv_pages)


def split_model_layers(params, cfg: ModelConfig, shards: int = 1) -> list[dict[str, jax.Array]]:
    """The unrolled layout: one dict per layer (attention + its dense or expert MLP weights),
    q/k/v (and a dense layer's gate/up) fused as the dense models' are (`llama_state.fuse_layer`,
    `shards` tensor-parallel shards): one GEMM instead of three launches a layer (session 29's
    compiled Qwen3-30B-A3B batch-1 step: q and k/v as separate GEMMs with their pads)."""
    out = [{} for _ in range(cfg.num_layers)]
    kinds = [cfg.moe.is_moe(i) for i in range(cfg.num_layers)]
    index = {True: [i for i, k in enumerate(kinds) if k], False: [i for i, k in enumerate(kinds) if not k]}
    for group in ("layers", "experts"):
        for name, var in params[group].items():
            if group == "experts":
                rows = index[True]
            elif name in ("w_gate", "w_up", "w_down"):
                rows = index[False]
            else:
                rows = range(cfg.num_layers)
            for i, layer in zip(rows, llama_state.unstack(var, range(len(rows)))):
                out[i][name] = layer
    return [llama_state.fuse_layer(w, shards) for w in out]


def split_axes(expert_parallel: bool) -> dict[str, int]:
    """Mesh-split axis of each expert weight on its stacked [Lm, ...] layout.

    Expert parallel: whole experts per device (axis 1). Otherwise each expert is
    split along its intermediate dimension, as the dense MLP is (vLLM's default).
    """
    if expert_parallel:
        experts = {"e_gate": 1, "e_up": 1, "e_down": 1}
    else:
        experts = {"e_gate": 3, "e_up": 3, "e_down": 2}
    return experts | {"s_gate": 2, "s_up": 2, "s_down": 1}


def _expert_tensors(weights: dict, layer: int, E: int, consume: bool):
    """Yield (expert, gate [H, F], up [H, F], down [F, H]) from any known layout, popping if asked."""
    take = weights.pop if consume else weights.__getitem__
    p = f"model.layers.{layer}."
    fused = p + "mlp.experts.gate_up_proj"
    if fused in weights:  # transformers >= 5 in-memory layout: [E, 2F, H] (gate first), [E, H, F]
        gu, down = take(fused), take(p + "mlp.experts.down_proj")
        F = gu.shape[1] // 2
        for e in range(E):
            yield e, gu[e, :F].T, gu[e, F:].T, down[e].T
        return
    stacked = p + "mlp.experts.gate_proj.weight"
    if stacked in weights:  # llama.cpp's GGUF stacks (gguf_moe.py): [E, F, H], [E, F, H], [E, H, F]
        g, u, d = (take(p + f"mlp.experts.{n}_proj.weight") for n in ("gate", "up", "down"))
        for e in range(E):
            yield e, g[e].T, u[e].T, d[e].T
        return
    if p + "block_sparse_moe.experts.0.w1.weight" in weights:  # Mixtral checkpoints
        q = p + "block_sparse_moe.experts.{}."
        names = ("w1", "w3", "w2")
    else:  # Qwen-MoE checkpoints
        q = p + "mlp.experts.{}."
        names = ("gate_proj", "up_proj", "down_proj")
    for e in range(E):
        g, u, d = (take(q.format(e) + n + ".weight") for n in names)
        yield e, g.T, u.T, d.T


def hf_to_state(cfg: ModelConfig, weights: dict[str, np.ndarray], dtype, consume: bool = False
                ) -> dict[str, Any]:
    """HF-named weights -> nested state; per-expert tensors stacked into [Lm, E, ...] in place."""
    m: MoEConfig = cfg.moe
    dense = [i for i in range(cfg.num_layers) if not m.is_moe(i)]
    state = llama_state.hf_to_state(cfg, weights, dtype, consume=consume, mlp_layers=dense)
    Lm, H, F, E = len(m.moe_layers), cfg.hidden_size, m.moe_intermediate_size, m.num_experts
    ex = {"e_gate": np.empty((Lm, E, H, F), dtype), "e_up": np.empty((Lm, E, H, F), dtype),
          "e_down": np.empty((Lm, E, F, H), dtype)}
    key = lambda i: "block_sparse_moe" if f"model.layers.{i}.block_sparse_moe.gate.weight" in weights else "mlp"
    ex["router"] = llama_state.stack_layers(weights, m.moe_layers, f"{key(m.moe_layers[0])}.gate.weight",
                                            dtype, True, consume)
    for j, i in enumerate(m.moe_layers):
        for e, g, u, d in _expert_tensors(weights, i, E, consume):
            ex["e_gate"][j, e], ex["e_up"][j, e], ex["e_down"][j, e] = g, u, d
    if m.shared_expert_intermediate_size:
        st = lambda n, t=True: llama_state.stack_layers(weights, m.moe_layers, n, dtype, t, consume)
        ex |= {"s_gate": st("mlp.shared_expert.gate_proj.weight"),
               "s_up": st("mlp.shared_expert.up_proj.weight"),
               "s_down": st("mlp.shared_expert.down_proj.weight"),
               "s_router": st("mlp.shared_expert_gate.weight")}
    state["experts"] = ex
    return state
