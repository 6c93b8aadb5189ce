"""Start-up checks of a draft model or EAGLE head named by `speculative_config.model`.

Only the configs are read (a folder's config.json, a GGUF's metadata): a missing path, a
vocabulary that differs from the target's, or an EAGLE head whose hidden size is not the
target's fail at start-up with a ValueError naming `speculative_config.model`; so does a
draft or head whose heads the target's tensor-parallel mesh cannot split (`split_layout`).
"""

from __future__ import annotations

import json
import os

from jaxllm.spec.config import SpeculativeConfig


def draft_hf_config(path: str) -> dict:
    from jaxllm.models.loader import resolve_model
    try:
        src = resolve_model(path)
    except FileNotFoundError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if os.path.isdir(src):
        cfg_path = os.path.join(src, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"speculative_config.model: {src} has no config.json")
        with open(cfg_path) as f:
            return json.load(f)
    from jaxllm.models.gguf_file import _FastGGUFReader, _metadata, gguf_to_hf_config
    reader = _FastGGUFReader(src)
    return gguf_to_hf_config(_metadata(reader), [t.name for t in reader.tensors])


def check_draft(cfg: SpeculativeConfig, target_vocab: int, target_hidden: int) -> dict:
    """The draft's HF config, after the checks above."""
    hf = draft_hf_config(cfg.model)
    vocab = hf.get("vocab_size")
    if vocab is not None and int(vocab) != target_vocab:
        raise ValueError(f"speculative_config.model: the draft's vocabulary ({vocab} tokens) differs from "
                         f"the target's ({target_vocab}); a draft must share the target's tokenizer")
    if cfg.method in ("eagle", "eagle3"):
        hidden = hf.get("hidden_size")
        if hidden is not None and int(hidden) != target_hidden:
            raise ValueError(f"speculative_config.model: the EAGLE head's hidden_size {hidden} does not "
                             f"match the target's {target_hidden}")
    return hf


def split_layout(m, tp: int, what: str):
    """How `m`'s heads split over the target's `tp` devices (`parallel.mesh.head_layout`), for
    a draft model or an EAGLE head (`what`); a ValueError naming speculative_config.model."""
    from jaxllm.parallel.mesh import head_layout
    try:
        return head_layout(m, tp)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: the {what} cannot be split like the target: {e}") from None


def kv_heads_per_device(m, tp: int, what: str) -> int:
    """KV heads of the draft's (or head's) pages on each device."""
    return m.num_kv_heads if tp == 1 else split_layout(m, tp, what).kv_heads_per_device
