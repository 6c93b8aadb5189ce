"""Start-up checks of a draft model or EAGLE head named by `speculative_config.model`.

Only the configs are read (a folder's config.json, a GGUF's metadata): a missing path, a
vocabulary that differs from the target's, or an EAGLE head whose hidden size is not the
target's fail at start-up with a ValueError naming `speculative_config.model`.
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
