"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) as one Flax NNX module.

Layer weights are stacked along a leading layer axis and the forward pass is a
`lax.scan` over layers: XLA compiles one layer body instead of L copies, which
keeps start-up compiles short (they dominate on CPU) and lets the KV page array
ride through the scan carry, updated in place.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.kernels import act_quant, gemv, kv_quant
from jaxllm.kernels.ref import write_kv
from jaxllm.models import gemv_choice
from jaxllm.models.config import ModelConfig
from jaxllm.models.linear import consumers, linear
# The registry's loading hooks for this family (`registry.ModelEntry.to_state` / `split_layers`).
from jaxllm.models.llama_state import hf_to_state, split_layers  # noqa: F401
from jaxllm.models.params import set_value, value
from jaxllm.models.rope import apply_rope, rope_inv_freq
from jaxllm.quantization import act

AttentionFn = Callable[..., jax.Array]


rms_norm = act_quant.rms_norm_ref  # float32 statistics, cast back before the weight (as HF does)


def _param(shape: tuple[int, ...], dtype, rngs: nnx.Rngs, scale: float | None = 0.02) -> nnx.Param:
    if scale is None:
        return nnx.Param(jnp.ones(shape, dtype))
    return nnx.Param((scale * jax.random.normal(rngs.params(), shape)).astype(dtype))


class LayerStack(nnx.Module):
    """All decoder layers' weights, each with a leading [L] axis.

    `mlp_layers` (default L) is how many layers have a dense MLP: MoE models
    (moe_model.py) keep dense MLPs only for their non-expert layers.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, mlp_layers: int | None = None):
        L, E, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.ln_attn = _param((L, E), dtype, rngs, None)
        self.ln_mlp = _param((L, E), dtype, rngs, None)
        self.wq = _param((L, E, H * D), dtype, rngs)
        self.wk = _param((L, E, K * D), dtype, rngs)
        self.wv = _param((L, E, K * D), dtype, rngs)
        self.wo = _param((L, H * D, E), dtype, rngs)
        Lf = L if mlp_layers is None else mlp_layers
        if Lf:
            self.w_gate = _param((Lf, E, F), dtype, rngs)
            self.w_up = _param((Lf, E, F), dtype, rngs)
            self.w_down = _param((Lf, F, E), dtype, rngs)
        if cfg.qkv_bias:
            self.bq = _param((L, H * D), dtype, rngs)
            self.bk = _param((L, K * D), dtype, rngs)
            self.bv = _param((L, K * D), dtype, rngs)
        if cfg.o_bias:
            self.bo = _param((L, E), dtype, rngs)
        if cfg.qk_norm:
            self.q_norm = _param((L, D), dtype, rngs, None)
            self.k_norm = _param((L, D), dtype, rngs, None)

    def weights(self) -> dict[str, jax.Array]:
        return {k: value(v) for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class Llama(nnx.Module):
    """Decoder-only transformer: tokens + paged KV cache -> logits of selected rows."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
                 attention_fn: AttentionFn | None = None,
                 embed_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                 rope_write_fn: Callable | None = None):
        from jaxllm.kernels.ref import ragged_paged_attention

        self.cfg = cfg
        self.attention_fn = attention_fn or ragged_paged_attention
        self.embed_fn = embed_fn  # None: a plain gather (tensor parallel: parallel/embedding.py)
        # rope_write_fn(qkv, (H, K), q_norm, k_norm, eps, positions, inv_freq, kv_pages, layer,
        # slot_mapping) -> (q, kv_pages) or None: head norms, RoPE and the K/V write of a fused
        # q/k/v projection in one kernel where it takes the step (kernels/rope_write.py
        # `rope_write_small`, on one GPU)
        self.rope_write_fn = rope_write_fn
        self.embed = _param((cfg.vocab_size, cfg.hidden_size), dtype, rngs)
        self.layers = LayerStack(cfg, dtype, rngs)
        self.norm = _param((cfg.hidden_size,), dtype, rngs, None)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param((cfg.hidden_size, cfg.vocab_size), dtype, rngs)
        # Per-layer (k_scale, v_scale) of fp8 KV pages (kernels/kv_quant.py), float32 [L, 2]:
        # params, so the step reads them as data. 1.0 unless a checkpoint ships k_scale /
        # v_scale (`hf_to_state`) or `calculate_kv_scales` calibrates them; other page
        # formats never read them.
        self.kv_scale = nnx.Param(jnp.ones((cfg.num_layers, 2), jnp.float32))

    # Calibration (`calculate_kv_scales`, set by the runner): layers whose kv_scale is 0 take
    # amax / fp8 max of the step's real K/V (`kv_quant.calibrated_scales`), and `_layers`
    # writes the scales used back into `kv_scale`, which the runner returns from the step.
    calibrate_kv: bool = False

    def _with_kv_scale(self, w: dict[str, jax.Array], scales: jax.Array) -> dict[str, jax.Array]:
        return w | {"kv_scale": scales}

    def _set_kv_scale(self, used: jax.Array) -> None:
        if self.calibrate_kv:
            set_value(self.kv_scale, used)

    def _attention(self, x: jax.Array, w: dict[str, jax.Array], kv_pages: jax.Array,
                   layer: jax.Array, md: AttentionMetadata, inv_freq: np.ndarray):
        """(x + self-attention(x), kv_pages, this layer's (k_scale, v_scale) [2] as used).

        fp8 pages hold k / k_scale and v / v_scale; the attention kernel is not told: it gets
        q * k_scale and its output is multiplied by v_scale (exact for per-tensor scales).
        int4 pages hold k R and v R (`kv_quant.rotation`): the kernel gets q R, and its output
        is multiplied by R^T (exact for an orthonormal R).
        """
        cfg = self.cfg
        T = x.shape[0]
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = act.norm(x, w["ln_attn"], cfg.rms_norm_eps, consumers(w, "wq", "wk", "wv", "wqkv"))
        scale = w.get("kv_scale", jnp.ones((2,), jnp.float32))  # fp8 pages: (k, v) scales
        if "wqkv" in w:  # fused (the unrolled layout, `fuse_layer`): one matmul, shard-major columns
            wqkv = w["wqkv"]
            done = self._rope_write_partials(h, w, kv_pages, layer, md, inv_freq)
            if done is not None:
                q, kv_pages = done
                return x + self._attend(q, kv_pages, layer, md, w, False, None), kv_pages, scale
            qkv = linear(h, wqkv, "te,esp->tsp") if isinstance(wqkv, jax.Array) else (h @ wqkv)[:, None]
            if cfg.qkv_bias:
                qkv = qkv + w["bqkv"]
            if self.rope_write_fn is not None and qkv.shape[1] == 1:  # one shard: q, k, v side by side
                norms = (w["q_norm"], w["k_norm"]) if cfg.qk_norm else (None, None)
                done = self.rope_write_fn(qkv[:, 0], (H, K), *norms, cfg.rms_norm_eps, md.positions,
                                          inv_freq, kv_pages, layer, md.slot_mapping)
                if done is not None:  # plain pages: nothing scaled or rotated
                    q, kv_pages = done
                    return x + self._attend(q, kv_pages, layer, md, w, False, None), kv_pages, scale
            nq, nk = H * D // qkv.shape[1], K * D // qkv.shape[1]
            q, k, v = qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]
        else:
            q, k, v = linear(h, w["wq"]), linear(h, w["wk"]), linear(h, w["wv"])
            if cfg.qkv_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        q, k, v = q.reshape(T, H, D), k.reshape(T, K, D), v.reshape(T, K, D)
        if cfg.qk_norm:
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, md.positions, inv_freq)
        k = apply_rope(k, md.positions, inv_freq)
        fp8 = kv_quant.page_format(kv_pages.dtype, kv_pages.shape[-1], D) == "fp8"
        if fp8:
            if self.calibrate_kv:
                scale = kv_quant.calibrated_scales(scale, k, v, md.slot_mapping >= 0, kv_pages.dtype)
            k, v = kv_quant.unscale(k, scale[0]), kv_quant.unscale(v, scale[1])
            q = (q.astype(jnp.float32) * scale[0]).astype(q.dtype)
        rot = kv_quant.page_rotation(kv_pages, D)
        if rot is not None:
            q, k, v = (kv_quant.rotate(a, rot) for a in (q, k, v))
        kv_pages = write_kv(kv_pages, layer, k, v, md.slot_mapping)
        return x + self._attend(q, kv_pages, layer, md, w, fp8, rot, scale), kv_pages, scale

    def _rope_write_partials(self, h, w, kv_pages, layer, md, inv_freq):
        """(q, kv_pages) when the q/k/v projection is a measured gemv with a K split
        (`gemv_choice`) and `rope_write_fn` takes its float32 partials as they are: the split
        sum goes into that kernel, no kernel of its own. Else None (the projection as usual)."""
        cfg, wqkv = self.cfg, w["wqkv"]
        if (self.rope_write_fn is None or cfg.qkv_bias or not isinstance(wqkv, jax.Array)
                or wqkv.ndim != 3 or wqkv.shape[1] != 1):
            return None
        tiling = gemv_choice.tiling_for(h.shape[0], wqkv)
        if tiling is None or tiling.k_splits == 1:
            return None
        parts = gemv.gemv(h, wqkv.reshape(wqkv.shape[0], -1), tiling, partials=True)  # [S, T, C]
        norms = (w["q_norm"], w["k_norm"]) if cfg.qk_norm else (None, None)
        return self.rope_write_fn(parts, (cfg.num_heads, cfg.num_kv_heads), *norms, cfg.rms_norm_eps,
                                  md.positions, inv_freq, kv_pages, layer, md.slot_mapping)

    def _attend(self, q, kv_pages, layer, md, w, fp8: bool, rot, scale=None) -> jax.Array:
        """Attention over the written pages and the o projection: [T, E]."""
        cfg = self.cfg
        attn = self.attention_fn(q, kv_pages, layer, md, sm_scale=cfg.sm_scale)
        if fp8:
            attn = (attn.astype(jnp.float32) * scale[1]).astype(attn.dtype)
        if rot is not None:
            attn = kv_quant.rotate(attn, rot, transpose=True)
        o = linear(attn.reshape(q.shape[0], -1), w["wo"])
        if cfg.o_bias:
            o = o + w["bo"]
        return o

    def _mlp(self, h: jax.Array, w: dict[str, jax.Array], md: AttentionMetadata) -> jax.Array:
        if "w_gu" in w and not isinstance(w["w_gu"], jax.Array):  # fp8 W8A8 [gate; up]: one matmul
            return act.silu_mul(h @ w["w_gu"], None, w["w_down"]) @ w["w_down"]
        if "w_gu" in w:  # fused gate/up [E, S, 2, F/S]: one matmul
            gu = linear(h, w["w_gu"], "te,esgf->tsgf")
            gate, up = (gu[:, :, i].reshape(h.shape[0], -1) for i in (0, 1))
            return linear(jax.nn.silu(gate) * up, w["w_down"])
        return linear(act.silu_mul(linear(h, w["w_gate"]), linear(h, w["w_up"]), w["w_down"]), w["w_down"])

    def _layer(self, x: jax.Array, w: dict[str, jax.Array], kv_pages: jax.Array,
               layer: jax.Array, md: AttentionMetadata, inv_freq: np.ndarray):
        x, kv_pages, scale = self._attention(x, w, kv_pages, layer, md, inv_freq)
        h = act.norm(x, w["ln_mlp"], self.cfg.rms_norm_eps, consumers(w, "w_gate", "w_up", "w_gu"))
        return x + self._mlp(h, w, md), kv_pages, scale

    # Hidden states the step also returns, [T, n * E] (EAGLE heads, jaxllm/spec/eagle.py): the
    # input of each listed layer, or the final normed hidden state for -1. Set on an instance.
    capture: tuple[int, ...] = ()

    def _layers(self, x: jax.Array, kv_pages: jax.Array, md: AttentionMetadata,
                inv_freq: np.ndarray, layer_weights: list[dict[str, jax.Array]] | None):
        """Every decoder layer: unrolled over `layer_weights`, else a scan over the stack."""
        ids = [i for i in self.capture if i >= 0]

        def body(carry, xs):
            x, kv, caught = carry
            w, layer = xs
            caught = tuple(jnp.where(layer == i, x, c) for i, c in zip(ids, caught))
            x, kv, scale = self._layer(x, w, kv, layer, md, inv_freq)
            return (x, kv, caught), scale

        caught = tuple(jnp.zeros_like(x) for _ in ids)
        kv_scale = value(self.kv_scale)
        if layer_weights is not None:
            layer_fn = per_layer(self._layer, inv_freq)
            caught, used = list(caught), []
            for i, w in enumerate(layer_weights):
                for j in (j for j, c in enumerate(ids) if c == i):  # (a layer may be listed twice)
                    caught[j] = x
                x, kv_pages, scale = layer_fn(x, self._with_kv_scale(w, kv_scale[i]), kv_pages,
                                              jnp.int32(i), md)
                used.append(scale)
            used = jnp.stack(used)
        else:
            xs = (self._with_kv_scale(self.layers.weights(), kv_scale),
                  jnp.arange(self.cfg.num_layers, dtype=jnp.int32))
            (x, kv_pages, caught), used = jax.lax.scan(body, (x, kv_pages, caught), xs)
        self._set_kv_scale(used)
        if not self.capture:
            return x, kv_pages
        caught = iter(caught)
        final = lambda: rms_norm(x, value(self.norm), self.cfg.rms_norm_eps)
        return x, kv_pages, jnp.concatenate([final() if i < 0 else next(caught) for i in self.capture], -1)

    def __call__(self, kv_pages: jax.Array, tokens: jax.Array, md: AttentionMetadata,
                 logits_indices: jax.Array,
                 layer_weights: list[dict[str, jax.Array]] | None = None) -> tuple[jax.Array, jax.Array]:
        """tokens [T], logits_indices [R] -> (kv_pages, float32 logits [R, V]).

        `layer_weights`, one dict of separate arrays per layer, unrolls the layers
        instead of scanning the stacked weights: on GPUs, slicing a layer out of a
        stacked array inside the scan copies it, doubling the weight bytes a decode
        step moves (measured: batch-1 Llama-3-8B step at 3.2x its bandwidth floor).
        """
        cfg = self.cfg
        inv_freq = rope_inv_freq(cfg)
        embed = value(self.embed)
        x = embed[tokens] if self.embed_fn is None else self.embed_fn(embed, tokens)
        # A subclass's `_layers` may return extra outputs after (x, kv_pages): they follow the
        # logits (MoE: per-expert loads for EPLB).
        x, kv_pages, *aux = self._layers(x, kv_pages, md, inv_freq, layer_weights)
        h = rms_norm(x[logits_indices], value(self.norm), cfg.rms_norm_eps)
        head = embed.T if cfg.tie_word_embeddings else value(self.lm_head)
        logits = jnp.dot(h, head, preferred_element_type=jnp.float32)
        return (kv_pages, logits, *aux)


def per_layer(layer_fn: Callable, inv_freq: np.ndarray) -> Callable:
    """`layer_fn(x, w, kv_pages, layer, md, inv_freq)` as one jitted function that the unrolled
    loop calls once per layer: JAX traces and lowers it once per distinct weight structure instead
    of once per layer (lowering an unrolled 32-layer 8B step took 7 s per bucket on an H200 host,
    most of it the attention kernels' lowering, repeated per layer). XLA inlines the calls, so the
    compiled program is the one the inline loop gave."""
    return jax.jit(lambda x, w, kv_pages, layer, md: layer_fn(x, w, kv_pages, layer, md, inv_freq))
