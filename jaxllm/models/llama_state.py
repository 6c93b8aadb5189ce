"""The Llama family's weights outside the module: HF-named checkpoint tensors stacked into the
module's state (`hf_to_state`, with the checkpoint's fp8 KV scales), that state copied into the
module (`load_state`), and the unrolled per-layer layout used on accelerators (`split_layers`,
q/k/v and gate/up fused per layer by `fuse_layer`). `models/moe_model.py` builds on the same."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.config import ModelConfig
from jaxllm.models.params import set_value, value
from jaxllm.quantization import act
from jaxllm.quantization.qarray import concat_out

log = logging.getLogger("jaxllm")


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
        for i, layer in enumerate(unstack(stacked[name], range(num_layers))):
            out[i][name] = layer
    return [fuse_layer(w, shards) for w in out] if fuse else out


HEADROOM = 1 << 30  # bytes kept free beside a stacked array's per-layer copies


def unstack(var: nnx.Variable, rows) -> list:
    """`value(var)[j]` for j in `rows`; the variable is left an empty placeholder and its
    stacked array released.

    Slicing on the device holds the stack and its slices at once: with the other weights already
    resident, a model whose largest stack is a large share of the card's memory does not fit
    (Qwen3-30B-A3B: 57 GiB of weights, `e_gate` alone [48, 128, 2048, 768] 18 GiB, on an 80 GB
    H100). Where the device lacks room for a second copy (`memory_stats`; one device), the stack
    goes through host memory instead: copied out, released, and each layer put back alone.
    """
    arr = value(var)
    dtype = arr.dtype
    rows = list(rows)
    if isinstance(arr, jax.Array) and _short_of(arr):
        device = next(iter(arr.devices()))
        log.info("unrolled layout: a %s %s stack (%.2f GiB) split through host memory (no room for a "
                 "second copy on %s)", arr.dtype, arr.shape, arr.nbytes / 2**30, device)
        host = np.asarray(jax.device_get(arr))
        set_value(var, jnp.zeros((0,), dtype))
        arr.delete()
        return [jax.device_put(host[j], device) for j in rows]
    layers = [arr[j] for j in rows]
    set_value(var, jnp.zeros((0,), dtype))
    return layers


def _short_of(arr: jax.Array) -> bool:
    """Whether `arr`'s one accelerator device lacks room for a second copy of it (never while
    traced: `jax.eval_shape` of a split, scripts/aot_kernels.py)."""
    try:
        devices = arr.devices()
    except jax.errors.ConcretizationTypeError:  # a tracer
        return False
    if len(devices) != 1:
        return False
    device = next(iter(devices))
    if device.platform == "cpu":
        return False
    jax.block_until_ready(arr)  # what was dispatched before is counted as in use
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return False
    return stats["bytes_limit"] - stats["bytes_in_use"] < arr.nbytes + HEADROOM


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


def load_state(model: nnx.Module, state: dict) -> None:
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
