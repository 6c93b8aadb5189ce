"""Tiny GGUF MoE files written as llama.cpp's convert_hf_to_gguf.py lays them out (no download).

From a tiny random HF model (hf_tiny.make): per-expert linears stacked into one [E, out, in]
tensor per projection and layer (`blk.{i}.ffn_{gate,up,down}_exps`), the router as
`ffn_gate_inp` (kept F32, as the converter does), Qwen2-MoE's shared expert as `ffn_*_shexp` +
`ffn_gate_inp_shexp`, Mixtral filed as arch `llama` with `llama.expert_count` and its q/k rows
permuted; tensor names from the gguf package's own HF -> GGUF name map. Linears are stored as
`qtype` (F32 / F16 / Q8_0; a tensor whose rows Q8_0 cannot block falls back to F16, as the
converter's does). `round_model` first rounds the torch model's weights to what the file will
hold, so the HF reference and the file describe the same model exactly.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

from hf_tiny import checkpoint_layout

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def store_type(name: str, shape: tuple[int, ...], qtype: str) -> GT:
    """The GGUF type a tensor is written as (same rule for HF and GGUF names)."""
    if len(shape) < 2 or "norm" in name or name.endswith(("mlp.gate.weight", "ffn_gate_inp.weight",
                                                          "shared_expert_gate.weight",
                                                          "ffn_gate_inp_shexp.weight")):
        return GT.F32
    if qtype == "Q8_0" and shape[-1] % 32:
        return GT.F16
    return GT[qtype]


def _roundtrip(w: np.ndarray, t: GT) -> np.ndarray:
    if t == GT.F32:
        return w.astype(np.float32)
    if t == GT.F16:
        return w.astype(np.float16).astype(np.float32)
    return dequantize(quantize(w.astype(np.float32), t), t).reshape(w.shape)


def round_model(model, qtype: str) -> dict[str, np.ndarray]:
    """Round the torch model's weights in place to the stored values; returns its state dict."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            w = p.detach().numpy()
            p.copy_(torch.from_numpy(_roundtrip(w, store_type(name, w.shape, qtype))))
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF rotary halves -> interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary: the 256 byte symbols, then merges of symbol pairs."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    alphabet, extra = [], 0
    for b in range(256):
        alphabet.append(chr(b) if b in keep else chr(256 + extra))
        extra += b not in keep
    pairs = [(alphabet[ord("a") + i % 26], alphabet[ord("a") + i // 26]) for i in range(vocab - 256)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(alphabet + [a + b for a, b in pairs])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)


def write(path: str, arch: str, hf: dict, sd: dict[str, np.ndarray], qtype: str,
          legacy: bool = False) -> None:
    """Write the (already rounded) weights `sd` of a tiny `arch` model as llama.cpp would.

    legacy: Mixtral as converted before expert stacking, one `blk.{i}.ffn_{gate,down,up}.{e}`
    tensor per expert (w1, w2, w3)."""
    g_arch = ARCH[arch]
    mixtral = arch == "mixtral"
    L, H = hf["num_hidden_layers"], hf["hidden_size"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or H // heads
    E = hf.get("num_experts") or hf["num_local_experts"]
    w = gguf.GGUFWriter(path, g_arch)
    w.add_name("Mixtral tiny" if mixtral else f"{arch} tiny")
    w.add_block_count(L)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_expert_count(E)
    w.add_expert_used_count(hf["num_experts_per_tok"])
    if not mixtral:
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if arch == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    _tokenizer(w, hf["vocab_size"])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[g_arch.upper()], L)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, L)
    files = checkpoint_layout(sd, mixtral)
    tensors: list[tuple[str, np.ndarray]] = []
    for i in range(L):  # the converter's expert merge: one [E, out, in] stack per projection
        if not any(n.startswith(f"model.layers.{i}.") and ".experts." in n for n in files):
            continue  # a dense layer (mlp_only_layers / decoder_sparse_step)
        if mixtral and legacy:
            for wid, ffn in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
                for e in range(E):
                    arr = files.pop(f"model.layers.{i}.block_sparse_moe.experts.{e}.{wid}.weight")
                    tensors.append((f"blk.{i}.ffn_{ffn}.{e}.weight", arr))
        elif mixtral:
            for wid in ("w1", "w2", "w3"):
                parts = [files.pop(f"model.layers.{i}.block_sparse_moe.experts.{e}.{wid}.weight")
                         for e in range(E)]
                tensors.append((f"layers.{i}.feed_forward.experts.{wid}.weight", np.stack(parts)))
        else:
            for proj in ("down_proj", "gate_proj", "up_proj"):
                parts = [files.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in range(E)]
                tensors.append((f"model.layers.{i}.mlp.experts.{proj}.weight", np.stack(parts)))
    tensors += list(files.items())
    for hf_name, arr in tensors:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        if mixtral and hf_name.endswith("q_proj.weight"):
            arr = _permute(arr, heads)
        elif mixtral and hf_name.endswith("k_proj.weight"):
            arr = _permute(arr, kv_heads)
        name = hf_name if hf_name.startswith("blk.") else names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or \
            dense.get_name(hf_name, try_suffixes=(".weight", ".bias"))  # mixed files: beyond llama.cpp
        assert name is not None, hf_name
        t = store_type(name, arr.shape, qtype)
        arr = np.ascontiguousarray(arr, np.float32)
        assert np.array_equal(_roundtrip(arr, t), arr), f"{name} is not rounded to {t.name}"
        if t == GT.F32:
            w.add_tensor(name, arr)
        elif t == GT.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
