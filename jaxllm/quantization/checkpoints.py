"""Pre-quantized checkpoints loaded as stored: HF FP8 folders and GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K /
Q5_K / Q6_K.

`load_prequantized(model, method)` is the engine's hook before the usual (float) loader:
it returns `(hf_config, weights, tokenizer)` with the decoder linears as `QArray`s, or
None when the checkpoint is a float one and nothing asks to keep it quantized. It never
goes through the converted-checkpoint cache (which holds float32 arrays): the quantized
files are the fast form already.

HF FP8 (`quantization_config.quant_method == "fp8"`, e4m3): `*.weight` float8 [out, in]
with `*.weight_scale_inv` block scales ([out/128, in/128] for `weight_block_size` 128x128,
as the Qwen3/DeepSeek FP8 releases) or a per-tensor `*.weight_scale`; w = q * scale.
Activation scales and k/v scales in the file are not used (activations are not quantized
for block-scaled weights: W8A16). Other `quant_method`s (awq, gptq, ...) are refused.

GGUF with `quantization="gguf"` (vLLM's name): Q8_0 -> int8 groups of 32, Q4_0 / Q4_1 ->
int4 groups of 32 (w = d * (q - 8), w = d * q + m); their nibble order is QArray's. Q4_K ->
int4 with float32 scale / offset per 32 (d * sc, -dmin * m) and nibble runs of 64.
Q6_K (6-bit, int8 scale per 16) -> int8 values q - 32 with a float32 scale per 16; Q5_K (5-bit,
6-bit scales and mins per 32) -> int8 values with float32 scale / offset per 32: both exact, at
8 bits a value (the files' 6.56 / 5.5), so the K-quant mixes (Q4_K_M and Q5_K_M: Q4_K or Q5_K
linears with some Q6_K ones) load kept quantized. Any other type on a linear (Q2_K, Q3_K,
Q5_0, IQ*, ...) is refused, naming it. Without
`quantization="gguf"` GGUF files load dequantized to float (the default path).
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from jaxllm.quantization.methods import check_checkpoint_method
from jaxllm.quantization.qarray import QArray
from jaxllm.quantization.quantize import is_linear

GGUF_KEPT = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
_ST_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one file with its stored dtype (float8 included, which safetensors'
    numpy backend cannot return), as read-only views of a memory map."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, np.uint8, "r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[name] = data[start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def hf_fp8_weights(tensors: dict[str, np.ndarray]) -> dict:
    """HF-named tensors of an FP8 checkpoint -> linears as QArrays, the rest float32."""
    out = {}
    for name, arr in tensors.items():
        # k_scale / v_scale (per-tensor fp8 KV scales) pass through as float32: `hf_to_state`
        # reads them into the model's kv_scale.
        if name.endswith((".weight_scale_inv", ".weight_scale", ".input_scale")):
            continue
        if is_linear(name) and arr.dtype == ml_dtypes.float8_e4m3fn:
            stem = name[: -len(".weight")]
            scale = tensors.get(stem + ".weight_scale_inv", tensors.get(stem + ".weight_scale"))
            if scale is None:
                raise ValueError(f"FP8 checkpoint: {name} has no weight_scale_inv / weight_scale")
            scale = np.asarray(scale, np.float32).reshape(
                (1, 1) if np.size(scale) == 1 else np.shape(scale))
            out[name] = QArray(np.array(arr), scale, None, kind="fp8", act="none")
        elif arr.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
            raise ValueError(f"FP8 checkpoint: fp8 tensor {name} is not a decoder linear")
        else:
            out[name] = np.asarray(arr, np.float32)
    return out


def load_hf_fp8(path: str) -> tuple[dict, dict]:
    from jaxllm.models.hf_files import load_hf_config, safetensors_files

    config = load_hf_config(path)
    qc = config["quantization_config"]
    if str(qc.get("fmt", "e4m3")) != "e4m3":
        raise ValueError(f"FP8 checkpoint format {qc.get('fmt')!r} is not supported (e4m3 only)")
    tensors = {}
    for file in safetensors_files(path):
        tensors.update(read_safetensors(file))
    return config, hf_fp8_weights(tensors)


def gguf_linear(data: np.ndarray, qtype_name: str, name: str) -> QArray:
    """One GGUF linear's raw blocks uint8 [out, bytes per row] -> QArray of float shape [in, out]."""
    rows = data.shape[0]
    if qtype_name == "Q8_0":
        blocks = data.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]  # [out, in/32]
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)  # [out, in]
        return QArray(np.ascontiguousarray(q.T), np.ascontiguousarray(d.T), None, kind="int8")
    if qtype_name in ("Q4_0", "Q4_1"):
        size = 18 if qtype_name == "Q4_0" else 20
        blocks = data.reshape(rows, -1, size)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        if qtype_name == "Q4_0":
            m = -8.0 * d
        else:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., size - 16:].reshape(rows, -1)  # [out, in/2]; block j: rows j, j + 16
        return QArray(np.ascontiguousarray(qs.T), np.ascontiguousarray(d.T.astype(np.float16)),
                      np.ascontiguousarray(m.T.astype(np.float16)), kind="int4")
    if qtype_name == "Q4_K":  # 256-value super-blocks: 8 sub-blocks of 32 with 6-bit scales/mins
        from gguf.quants import Q4_K
        blocks = data.reshape(rows, -1, 144)
        nb = blocks.shape[1]
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [out, nb, 1]
        dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        scale = (d * sc.reshape(rows, nb, 8).astype(np.float32)).reshape(rows, nb * 8)
        offset = -(dmin * mn.reshape(rows, nb, 8).astype(np.float32)).reshape(rows, nb * 8)
        qs = blocks[..., 16:].reshape(rows, -1)  # [out, in/2]: 32-byte runs of rows j, j + 32
        return QArray(np.ascontiguousarray(qs.T), np.ascontiguousarray(scale.T),
                      np.ascontiguousarray(offset.T), kind="int4", pack=64)
    if qtype_name in ("Q6_K", "Q5_K"):
        q, scale, offset = _k_quant_ints(data, qtype_name)
        return QArray(np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T),
                      None if offset is None else np.ascontiguousarray(offset.T), kind="int8")
    raise ValueError(f"GGUF tensor {name} is {qtype_name}: no quantized kernel for it "
                     f"(kept quantized: {GGUF_KEPT}); load without quantization='gguf' to "
                     f"dequantize it to float")


def _k_quant_ints(data: np.ndarray, qtype_name: str):
    """Q6_K / Q5_K rows uint8 [out, bytes] -> (q int8 [out, in], scale float32 [out, in/g],
    offset float32 [out, in/g] or None), w = q * scale + offset exactly (g = 16 for Q6_K's
    int8 sub-block scales, 32 for Q5_K's 6-bit ones). Bit layouts as llama.cpp's (and gguf-py's
    dequantizers): 256-value super-blocks, 4 low bits in nibble runs of 64 (Q6_K) or 32 (Q5_K)
    values, the high bits in a separate plane."""
    rows = data.shape[0]
    if qtype_name == "Q6_K":  # ql[128] qh[64] scales int8[16] d f16: w = d * sc * (q - 32)
        b = data.reshape(rows, -1, 210)
        nb = b.shape[1]
        ql = (b[..., :128].reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
        qh = (b[..., 128:192].reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = (ql.reshape(rows, nb, 8, 32) | (qh.reshape(rows, nb, 8, 32) << 4)).astype(np.int16) - 32
        sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [out, nb, 16]
        d = b[..., 208:210].copy().view(np.float16).astype(np.float32)  # [out, nb, 1]
        return q.reshape(rows, -1).astype(np.int8), (d * sc).reshape(rows, nb * 16), None
    # Q5_K: d f16, dmin f16, 12 bytes of 6-bit scales/mins, qh[32], qs[128]: w = d*sc*q - dmin*m
    from gguf.quants import Q4_K
    b = data.reshape(rows, -1, 176)
    nb = b.shape[1]
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    qh = (b[..., 16:48].reshape(rows, nb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    ql = (b[..., 48:176].reshape(rows, nb, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]) & 15
    q = ql.reshape(rows, nb, 8, 32) | (qh << 4)
    scale = (d * sc.reshape(rows, nb, 8).astype(np.float32)).reshape(rows, nb * 8)
    offset = -(dmin * mn.reshape(rows, nb, 8).astype(np.float32)).reshape(rows, nb * 8)
    return q.reshape(rows, -1).astype(np.int8), scale, offset


def load_prequantized(model: str | None, method: str | None):
    """(hf_config, weights, tokenizer) kept quantized, or None for the float loader."""
    from jaxllm.models.loader import is_converted, resolve_model
    from jaxllm.models.tokenizer import Tokenizer

    src = resolve_model(model)
    if os.path.isfile(src) and src.endswith(".gguf"):
        if method != "gguf":
            return None
        from jaxllm.models.gguf_file import load_gguf
        config, weights, meta = load_gguf(src, linear_fn=gguf_linear)
        return config, weights, Tokenizer.from_gguf_metadata(meta)
    if method == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf model file, got {src}")
    cfg_path = os.path.join(src, "config.json")
    if is_converted(src) or not os.path.isfile(cfg_path):
        return None
    with open(cfg_path, encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    if qc is None:
        return None
    kind = check_checkpoint_method(qc)
    if method is not None and method != kind:
        raise ValueError(f"quantization={method!r}, but {src} is already quantized ({kind}); "
                         f"leave quantization unset to load it as stored")
    config, weights = load_hf_fp8(src)
    return config, weights, Tokenizer.from_dir(src)
