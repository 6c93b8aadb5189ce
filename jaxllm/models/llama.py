"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) as one Flax NNX module.

Layer weights are stacked along a leading layer axis and the forward pass is a
`lax.scan` over layers: XLA compiles one layer body instead of L copies, which
keeps start-up compiles short (they dominate on CPU) and lets the KV page array
ride through the scan carry, updated in place.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.kernels import act_quant, kv_quant
from jaxllm.kernels.ref import write_kv
from jaxllm.models.config import ModelConfig
from jaxllm.quantization import act
from jaxllm.quantization.qarray import concat_out

AttentionFn = Callable[..., jax.Array]


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2], with Llama-3.1 or linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_llama3 is not None:
        factor, low, high, orig = cfg.rope_llama3
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / low, orig / high
        smooth = (orig / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    if cfg.rope_linear_factor is not None:
        inv = inv / cfg.rope_linear_factor
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (the HF convention) on x [T, H, D]."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


rms_norm = act_quant.rms_norm_ref  # float32 statistics, cast back before the weight (as HF does)


def value(p: nnx.Variable) -> jax.Array:
    """A variable's array (flax >= 0.12 deprecates `.value`)."""
    return p.get_value() if hasattr(p, "get_value") else p.value


def set_value(p: nnx.Variable, v) -> None:
    """Give a variable a new array (flax >= 0.12 deprecates assigning `.value`)."""
    if hasattr(p, "set_value"):
        p.set_value(v)
    else:
        p.value = v


def _consumers(w: dict, *names: str) -> list:
    """The linears of `w` a normed input feeds (fp8 W8A8 ones take it quantized: `act.norm`)."""
    return [w[n] for n in names if n in w]


# Multiply-adds of a one-row matmul below which XLA's GPU compiler rewrites it as multiply-then-
# reduce (its threshold is 10M, `IsMatrixMultiplicationTooSmallForRewriting`), with a margin; larger
# ones stay GEMMs unpadded (Llama-3-8B's at batch 1: 1.07x the step's floor on an H100, session 25).
GEMV_REWRITE_BELOW = 12_000_000


def linear(x: jax.Array, w, spec: str | None = None, out_dtype=None) -> jax.Array:
    """x [T, ...] @ w (or `jnp.einsum(spec, x, w)`); a quantized weight (QArray) takes its own
    matmul (`x @ w`). `out_dtype`: the result's (default x's), summed in it.

    On a GPU a one-token product is computed on x padded to two rows: for a single row XLA's GPU
    compiler rewrites a vector-matrix product below ~10M multiply-adds as multiply-then-reduce,
    and inside a model step it kept the two apart, writing the weight-sized products to memory
    and summing them in a second kernel (3x the weight's bytes, the products rounded to bf16
    first): Qwen3-30B-A3B's q/k/v/o projections at batch 1, every layer, and Llama-3.2-1B's
    o projection (`scripts/aot_kernels.py`). Two rows stay a GEMM that reads the weight once;
    row 0 is the same product. Larger weights are left alone (`GEMV_REWRITE_BELOW`)."""
    if not isinstance(w, jax.Array):
        return x @ w
    pad = x.shape[0] == 1 and w.size < GEMV_REWRITE_BELOW and jax.default_backend() == "gpu"
    if pad:
        x = jnp.pad(x, ((0, 1),) + ((0, 0),) * (x.ndim - 1))
    kw = {} if out_dtype is None else dict(preferred_element_type=out_dtype)
    y = jnp.dot(x, w, **kw) if spec is None else jnp.einsum(spec, x, w, **kw)
    return y[:1] if pad else y


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
                 embed_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None):
        from jaxllm.kernels.ref import ragged_paged_attention

        self.cfg = cfg
        self.attention_fn = attention_fn or ragged_paged_attention
        self.embed_fn = embed_fn  # None: a plain gather (tensor parallel: parallel/embedding.py)
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
        h = act.norm(x, w["ln_attn"], cfg.rms_norm_eps, _consumers(w, "wq", "wk", "wv", "wqkv"))
        if "wqkv" in w:  # fused (the unrolled layout, `fuse_layer`): one matmul, shard-major columns
            wqkv = w["wqkv"]
            qkv = linear(h, wqkv, "te,esp->tsp") if isinstance(wqkv, jax.Array) else (h @ wqkv)[:, None]
            if cfg.qkv_bias:
                qkv = qkv + w["bqkv"]
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
        scale = w.get("kv_scale", jnp.ones((2,), jnp.float32))
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
        attn = self.attention_fn(q, kv_pages, layer, md, sm_scale=cfg.sm_scale)
        if fp8:
            attn = (attn.astype(jnp.float32) * scale[1]).astype(attn.dtype)
        if rot is not None:
            attn = kv_quant.rotate(attn, rot, transpose=True)
        o = linear(attn.reshape(T, H * D), w["wo"])
        if cfg.o_bias:
            o = o + w["bo"]
        return x + o, kv_pages, scale

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
        h = act.norm(x, w["ln_mlp"], self.cfg.rms_norm_eps, _consumers(w, "w_gate", "w_up", "w_gu"))
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


def fuse_layer(w: dict[str, jax.Array], shards: int = 1) -> dict[str, jax.Array]:
    """One layer's q/k/v and gate/up projections as one matrix each (fewer kernel launches).

    `wqkv` [E, S, (Hq + 2K) D / S] and `w_gu` [E, S, 2, F / S]: the columns of each of
    the S tensor-parallel shards stay together (q, k, v of its heads; its gate and up
    units), so splitting axis 1 over the mesh gives every device its own heads, as the
    separate column-parallel matrices did. The biases follow (`bqkv` [S, ...]).
    """
    def cols(a: jax.Array) -> jax.Array:  # [..., N] -> [..., S, N / S]
        return a.reshape(*a.shape[:-1], shards, a.shape[-1] // shards)

    out = dict(w)
    if not all(isinstance(w[n], jax.Array) for n in ("wq", "w_gate") if n in w):
        # Quantized linears: fp8 W8A8 ones fused as one QArray [q; k; v] / [gate; up] when not
        # split over devices (`act.fuse`), int8 / int4 ones likewise (`qarray.concat_out`);
        # others (and any under tensor parallelism) stay apart.
        for name, parts in (("wqkv", ("wq", "wk", "wv")), ("w_gu", ("w_gate", "w_up"))):
            fused = act.fuse([w[n] for n in parts]) if shards == 1 and all(n in w for n in parts) else None
            if fused is None and shards == 1 and all(n in w for n in parts) and act.fuse_int():
                fused = concat_out([w[n] for n in parts])  # int8 / int4 weight-only
            if fused is not None:
                out[name] = fused
                for n in parts:
                    out.pop(n)
        if "wqkv" in out and "bq" in w:
            out["bqkv"] = jnp.concatenate([out.pop(n) for n in ("bq", "bk", "bv")], axis=-1)[None]
        return out
    if any(w[n].shape[-1] % shards for n in ("wq", "wk", "wv", "w_gate", "w_up") if n in w):
        shards = 1  # a split the mesh cannot make evenly: replicated (as param_spec does)
    if all(n in w for n in ("wq", "wk", "wv")):
        out["wqkv"] = jnp.concatenate([cols(out.pop(n)) for n in ("wq", "wk", "wv")], axis=-1)
        if "bq" in w:
            out["bqkv"] = jnp.concatenate([cols(out.pop(n)) for n in ("bq", "bk", "bv")], axis=-1)
    if "w_gate" in w and "w_up" in w:
        out["w_gu"] = jnp.stack([cols(out.pop("w_gate")), cols(out.pop("w_up"))], axis=-2)
    return out


def split_layers(params, num_layers: int, shards: int = 1, fuse: bool = True) -> list[dict[str, jax.Array]]:
    """Move the stacked layer weights of an nnx state into one dict of arrays per layer.

    The stacked arrays in `params` are replaced by empty placeholders, so the
    weights are held once. `fuse`: q/k/v and gate/up fused per layer (`fuse_layer`,
    with `shards` tensor-parallel shards).
    """
    stacked = params["layers"]
    names = list(stacked.keys())
    out = [{} for _ in range(num_layers)]
    for name in names:
        var = stacked[name]
        arr = value(var)
        for i in range(num_layers):
            out[i][name] = arr[i]
        set_value(var, jnp.zeros((0,), arr.dtype))
    return [fuse_layer(w, shards) for w in out] if fuse else out


def stack_layers(weights: dict[str, np.ndarray], layers, name: str, dtype, transpose: bool = True,
                 consume: bool = False) -> np.ndarray:
    """`model.layers.{i}.{name}` for i in `layers`, stacked (transposed: [in, out]) as `dtype`.

    `consume` pops each tensor as it is copied, so a layer's weights are never held twice.
    """
    layers = list(layers)
    first = weights[f"model.layers.{layers[0]}.{name}"]
    if not isinstance(first, np.ndarray):  # quantized linears, already [in, out] (quantization/)
        from jaxllm.quantization.qarray import stack as stack_quantized
        take = weights.pop if consume else weights.__getitem__
        return stack_quantized([take(f"model.layers.{i}.{name}") for i in layers])
    shape = first.T.shape if transpose else first.shape
    out = np.empty((len(layers), *shape), dtype)
    for j, i in enumerate(layers):
        key = f"model.layers.{i}.{name}"
        w = weights.pop(key) if consume else weights[key]
        out[j] = w.T if transpose else w
    return out


def hf_to_state(cfg: ModelConfig, weights: dict[str, np.ndarray], dtype,
                consume: bool = False, mlp_layers=None) -> dict[str, np.ndarray]:
    """Map HF-named numpy weights ([out, in] linears) to this module's stacked layout.

    `mlp_layers`: the layers with a dense MLP (default: all); `consume`: see `stack_layers`.
    """
    L = cfg.num_layers

    def stack(name: str, transpose: bool = True, layers=range(L)) -> np.ndarray:
        return stack_layers(weights, layers, name, dtype, transpose, consume)

    layers = {
        "ln_attn": stack("input_layernorm.weight", False),
        "ln_mlp": stack("post_attention_layernorm.weight", False),
        "wq": stack("self_attn.q_proj.weight"), "wk": stack("self_attn.k_proj.weight"),
        "wv": stack("self_attn.v_proj.weight"), "wo": stack("self_attn.o_proj.weight"),
    }
    mlp = list(range(L)) if mlp_layers is None else list(mlp_layers)
    if mlp:
        layers |= {"w_gate": stack("mlp.gate_proj.weight", layers=mlp),
                   "w_up": stack("mlp.up_proj.weight", layers=mlp),
                   "w_down": stack("mlp.down_proj.weight", layers=mlp)}
    if cfg.qkv_bias:
        for n in "qkv":
            layers[f"b{n}"] = stack(f"self_attn.{n}_proj.bias", False)
    if cfg.o_bias:
        layers["bo"] = stack("self_attn.o_proj.bias", False)
    if cfg.qk_norm:
        layers["q_norm"] = stack("self_attn.q_norm.weight", False)
        layers["k_norm"] = stack("self_attn.k_norm.weight", False)
    take = weights.pop if consume else weights.__getitem__
    state = {"embed": np.asarray(take("model.embed_tokens.weight"), dtype),
             "norm": np.asarray(take("model.norm.weight"), dtype), "layers": layers,
             "kv_scale": checkpoint_kv_scales(weights, L, take)}
    if not cfg.tie_word_embeddings:
        state["lm_head"] = np.ascontiguousarray(take("lm_head.weight").T, dtype)
    return state


# Where checkpoints keep layer i's per-tensor fp8 KV scales ({} = k or v): HF / compressed-tensors
# and ModelOpt (`self_attn.k_scale`), vLLM's own naming (`self_attn.attn.k_scale`) and the older
# per-projection spelling (`self_attn.k_proj.k_scale`).
KV_SCALE_NAMES = ("self_attn.{0}_scale", "self_attn.attn.{0}_scale", "self_attn.{0}_proj.{0}_scale")


def checkpoint_kv_scales(weights, num_layers: int, take=None) -> np.ndarray:
    """float32 [L, 2]: each layer's (k_scale, v_scale) from the checkpoint, 1.0 where it has none.

    A layer with one of the two but not the other is an error naming the missing tensor.
    """
    take = take or weights.__getitem__
    out = np.ones((num_layers, 2), np.float32)
    for i in range(num_layers):
        found = {}
        for j, kind in enumerate("kv"):
            for pattern in KV_SCALE_NAMES:
                name = f"model.layers.{i}.{pattern.format(kind)}"
                if name in weights:
                    found[kind] = name
                    arr = np.asarray(take(name), np.float32).reshape(-1)
                    if arr.size != 1 or not np.isfinite(arr[0]) or arr[0] <= 0:
                        raise ValueError(f"checkpoint tensor {name}: expected one positive per-tensor "
                                         f"KV scale, got shape {np.shape(arr)} values {arr[:4]}")
                    out[i, j] = arr[0]
                    break
        if len(found) == 1:
            have, missing = ("k", "v") if "k" in found else ("v", "k")
            raise ValueError(f"checkpoint has {found[have]} but no {missing} scale for layer {i} "
                             f"(expected model.layers.{i}.{KV_SCALE_NAMES[0].format(missing)} or "
                             f"...{KV_SCALE_NAMES[1].format(missing)})")
    return out


def load_state(model: Llama, state: dict) -> None:
    """Copy a nested dict of arrays (from hf_to_state) into the module's params.

    A state without `kv_scale` (built by hand) leaves the fp8 KV scales at 1.0.
    """
    if "kv_scale" not in state and hasattr(model, "kv_scale"):
        state = {**state, "kv_scale": np.ones(value(model.kv_scale).shape, np.float32)}
    def assign(mod: nnx.Module, tree: dict) -> None:
        for name, val in tree.items():
            if isinstance(val, dict):
                assign(getattr(mod, name), val)
            else:
                param = getattr(mod, name)
                if value(param).shape != val.shape:
                    raise ValueError(f"{name}: expected {value(param).shape}, got {val.shape}")
                set_value(param, jax.tree.map(jnp.asarray, val))  # arrays, or a QArray's parts
    assign(model, state)
