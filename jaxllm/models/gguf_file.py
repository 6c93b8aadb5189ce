"""Read a Llama-family ``.gguf`` file into an HF-style config and HF-named float32 numpy weights.

Why this exists: the embedded default model ships only as a GGUF, while the rest of jaxllm speaks
the Hugging Face vocabulary (``LlamaConfig`` keys, ``model.layers.{i}.self_attn.q_proj.weight``
in ``[out, in]`` layout). Doing the translation here keeps every other module GGUF-agnostic.

No torch: metadata and tensor layout come from ``gguf.GGUFReader`` and dequantization from
``gguf.quants.dequantize`` (pure numpy).
"""

from __future__ import annotations

import logging
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from jaxllm.models import gguf_moe

logger = logging.getLogger(__name__)

# llama.cpp architectures we can express as an HF config; "permute" says whether its converter
# reordered q/k rows (only LlamaModel and subclasses do, to suit llama.cpp's rope layout).
_ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "arch": "LlamaForCausalLM", "permute": True},
    "mistral": {"model_type": "mistral", "arch": "MistralForCausalLM", "permute": True},
    "qwen2": {"model_type": "qwen2", "arch": "Qwen2ForCausalLM", "permute": False},
    "qwen3": {"model_type": "qwen3", "arch": "Qwen3ForCausalLM", "permute": False},
} | gguf_moe.ARCHS

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
} | gguf_moe.BLOCK_NAMES
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# gguf.quants' per-type classes (Q4_1, Q8_0, ...). ``dequantize`` runs them over groups of 16 rows,
# whose per-call overhead triples the cost on small tensors; we feed them bigger row chunks.
_ROW_DEQUANTIZERS: dict[GGMLQuantizationType, Any] = {
    cls.qtype: cls
    for cls in vars(gguf.quants).values()
    if isinstance(cls, type) and isinstance(getattr(cls, "qtype", None), GGMLQuantizationType)
    and hasattr(cls, "dequantize_rows")
}
_CHUNK_ROWS = 1024


class _FastGGUFReader(GGUFReader):
    """``GGUFReader`` that parses metadata arrays in bulk.

    Why: the stock reader makes two numpy views per string of an array (about 200k for a 49k-token
    vocabulary plus its merges), which costs ~5 s. Here arrays of scalars become one view and
    arrays of strings are decoded with ``struct`` into ``string_arrays`` (keyed by the offset of
    the array's value), so opening the embedded model takes a fraction of a second.
    """

    def __init__(self, path: str) -> None:
        self.string_arrays: dict[int, list[str]] = {}
        super().__init__(path, "r")

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count, sub = int(alen[0]), GGUFValueType(int(raw_itype[0]))
        start = orig_offs + 12
        types = [GGUFValueType.ARRAY, sub]
        if sub == GGUFValueType.STRING:
            strings, end = self._read_strings(start, count)
            self.string_arrays[orig_offs] = strings
            return end - orig_offs, [raw_itype, alen, self.data[start:end]], [], types
        nptype = self.gguf_scalar_to_np.get(sub)
        if nptype is None:  # nested arrays: rare, let the stock (slow) path handle them
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(start, nptype, count)
        return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types

    def _read_strings(self, offs: int, count: int) -> tuple[list[str], int]:
        """Decode ``count`` length-prefixed UTF-8 strings starting at ``offs``; return them and the end."""
        view = memoryview(self.data)
        u64 = struct.Struct(">Q" if self.byte_order == "S" else "<Q")
        out: list[str] = []
        for _ in range(count):
            (n,) = u64.unpack_from(view, offs)
            offs += 8
            out.append(str(view[offs:offs + n], "utf-8"))
            offs += n
        return out, offs


def _metadata(reader: _FastGGUFReader) -> dict[str, Any]:
    """Every key/value field as plain Python values (lists for arrays)."""
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            value_offs = field.offset + sum(int(p.nbytes) for p in field.parts[:3])
            meta[name] = reader.string_arrays.get(value_offs, [])
        elif field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) <= 1:
            meta[name] = field.parts[field.data[0]].tolist() if field.data else []
        else:
            meta[name] = field.contents()
    return meta


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All metadata of a GGUF file as a dict (no tensor data is touched)."""
    return _metadata(_FastGGUFReader(path))


def gguf_to_hf_config(meta: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """An HF ``LlamaConfig``-style dict from GGUF metadata and the file's tensor names."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHS)}")
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    moe = gguf_moe.is_moe_file(arch, get)
    info = gguf_moe.arch_info(arch) if moe else _ARCHS[arch]
    if arch == "llama" and not moe and "mistral" in str(meta.get("general.name", "")).lower():
        info = _ARCHS["mistral"]  # llama.cpp files Mistral under "llama"

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: only uniform ones map onto an HF config
        if len(set(kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts {sorted(set(kv_heads))} are not supported")
        kv_heads = kv_heads[0]
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF stores llama3-style rope frequencies (rope_freqs.weight); these cannot be "
                         "mapped to an HF rope_scaling dict -- load the original HF folder instead")
    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        original = get("rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    has_bias = any(n.endswith(".attn_q.bias") for n in tensor_names)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    experts = gguf_moe.hf_keys(arch, get, tensor_names) if moe else {}
    return experts | {
        "model_type": info["model_type"],
        "architectures": [info["arch"]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or get("expert_feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "attention_bias": has_bias,
        "hidden_act": "silu",
    }


def _hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None when it has no HF counterpart."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return gguf_moe.legacy_name(gguf_name)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter regroups each head's rows from HF's "first half / second half" rotary
    layout to interleaved pairs. Viewing rows as [head, pair, 2] and swapping the last two row
    axes restores HF order (the same reshape transformers' GGUF loader applies).
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return np.ascontiguousarray(w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 copy of one tensor (never aliasing the file's read-only memory map)."""
    rows_fn = _ROW_DEQUANTIZERS.get(qtype)
    if rows_fn is None or data.ndim < 2:
        return np.array(dequantize(data, qtype), dtype=np.float32)
    plain = data.view(np.ndarray).reshape(-1, data.shape[-1])  # 3-D expert stacks: rows of rows
    chunks = [rows_fn.dequantize_rows(plain[i:i + _CHUNK_ROWS]) for i in range(0, plain.shape[0], _CHUNK_ROWS)]
    out = np.concatenate(chunks, axis=0).astype(np.float32, copy=False)
    return out.reshape(*data.shape[:-1], out.shape[-1])


def load_gguf(path: str, linear_fn: Any = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Read a GGUF: ``(hf_config, hf_named_float32_weights, raw_metadata)``.

    The metadata is returned too so the caller can build the tokenizer without reopening the file.
    ``linear_fn(raw_rows, type_name, name)``, if given, takes each quantized decoder linear's raw
    block rows (q/k rows already unpermuted) instead of dequantizing it
    (``jaxllm.quantization.checkpoints.gguf_linear``).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = _FastGGUFReader(path)
    meta = _metadata(reader)
    names = [t.name for t in reader.tensors]
    config = gguf_to_hf_config(meta, names)
    permute = _ARCHS[meta["general.architecture"]]["permute"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def convert(tensor: Any) -> tuple[str, np.ndarray] | None:
        hf = _hf_name(tensor.name)
        if hf is None:
            logger.warning("ignoring GGUF tensor %s (no HF counterpart)", tensor.name)
            return None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        quantized = tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                               GGMLQuantizationType.BF16)
        if linear_fn is not None and quantized and hf.endswith("_proj.weight") \
                and not gguf_moe.is_expert_tensor(tensor.name):  # expert stacks: dequantized
            rows = np.asarray(tensor.data).reshape(shape[0], -1)
            if permute and ".attn_q." in tensor.name:
                rows = unpermute_rows(rows, heads)
            elif permute and ".attn_k." in tensor.name:
                rows = unpermute_rows(rows, kv_heads)
            return hf, linear_fn(rows, tensor.tensor_type.name, tensor.name)
        w = _dequantize(tensor.data, tensor.tensor_type)
        w = w.reshape(shape)
        if hf.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # [1, H] in HF; written as 1-D by some converters
        if permute and ".attn_q." in tensor.name:
            w = unpermute_rows(w, heads)
        elif permute and ".attn_k." in tensor.name:
            w = unpermute_rows(w, kv_heads)
        return hf, w

    # numpy's dequantization kernels release the GIL, so threads overlap the big tensors.
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        pairs = [p for p in pool.map(convert, reader.tensors) if p is not None]
    weights = dict(pairs)
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    return config, weights, meta
