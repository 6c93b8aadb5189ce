"""Quantization names and start-up checks (pure Python: the config imports this)."""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
# --quantization: quantize a float checkpoint at load (vLLM's online "fp8"; int8/int4 weight-only).
# "gguf": keep a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K linears quantized (vLLM's name).
METHODS = ("fp8", "int8", "int4", "gguf")
ONLINE_METHODS = ("fp8", "int8", "int4")
# Checkpoint formats loaded as stored (quantization_config.quant_method / GGUF tensor types).
CHECKPOINT_METHODS = ("fp8",)
# Known to exist, not implemented: named in the error so the user knows it is not a typo.
UNSUPPORTED = ("awq", "gptq", "bitsandbytes", "compressed-tensors", "marlin", "gptq_marlin",
               "awq_marlin", "squeezellm", "aqlm", "hqq", "eetq", "experts_int8", "modelopt",
               "fbgemm_fp8", "mxfp4", "torchao")


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not supported; choose from {KV_CACHE_DTYPES}")


def check_method(name: str | None) -> None:
    """`quantization` as given to the engine (None = none, or what the checkpoint says)."""
    if name is None:
        return
    if name in UNSUPPORTED:
        raise ValueError(f"quantization {name!r} is not supported by jaxllm; supported: {METHODS}")
    if name not in METHODS:
        raise ValueError(f"unknown quantization {name!r}; choose from {METHODS}")


def check_checkpoint_method(quant_config: dict) -> str:
    """The `quant_method` of an HF `quantization_config`, if jaxllm loads it; else ValueError."""
    method = str(quant_config.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint quantization_config.quant_method {method!r} is not supported "
                         f"(jaxllm loads {CHECKPOINT_METHODS} checkpoints as stored, and quantizes "
                         f"float checkpoints with quantization={METHODS})")
    return method


def check_fp8_device(what: str, device=None) -> None:
    """fp8 needs an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper) or the CPU (emulated)."""
    import jax

    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return
    cap = getattr(device, "compute_capability", None)
    try:
        ok = cap is not None and tuple(int(x) for x in str(cap).split(".")[:2]) >= (8, 9)
    except ValueError:
        ok = False
    if device.platform != "gpu" or not ok:
        raise ValueError(f"{what} needs fp8 support (NVIDIA compute capability >= 8.9); "
                         f"{device.device_kind} ({device.platform}, capability {cap}) has none")


def check_weights_device(method: str | None, state: dict | None = None) -> None:
    """Start-up check: fp8 weights (online or from an FP8 checkpoint) need fp8 hardware."""
    fp8 = method == "fp8"
    if state is not None and not fp8:
        from jaxllm.quantization.qarray import QArray
        layers = state.get("layers", {})
        fp8 = any(isinstance(v, QArray) and v.kind == "fp8" for v in layers.values())
    if fp8:
        check_fp8_device("fp8 weights (quantization='fp8' or an FP8 checkpoint)")
