"""`load_format="dummy"` (vLLM's name): a model's shape without its weights.

The engine reads only `config.json` (from a folder, or a named shape of
`jaxllm.models.shapes`) and draws the weights on the device (`ModelRunner`), so
nothing weight-sized ever exists in host memory. The tokenizer is the folder's own
when it has one; otherwise a byte-level fallback that spells every id, good enough
for benchmarks: ids 0-255 are bytes, every other id decodes as " t<id>".
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from jaxllm.models.shapes import get_shape
from jaxllm.models.tokenizer import Tokenizer, _byte_alphabet

log = logging.getLogger("jaxllm")

FALLBACK_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant: {% endif %}")


def byte_tokenizer(vocab_size: int) -> Tokenizer | None:
    """A tokenizer over `vocab_size` ids: bytes first, the rest spelled " t<id>" (None if < 256)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    if vocab_size < 256:
        return None
    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab.update({"".join(alphabet[b] for b in f" t{i}".encode()): i for i in range(256, vocab_size)})
    backend = Backend(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, chat_template=FALLBACK_TEMPLATE)


def dummy_model(model: str | None, random_shape: str | None) -> tuple[dict[str, Any], Tokenizer | None]:
    """(HF config, tokenizer or None) for a config-only folder or a named shape."""
    if random_shape is not None:
        cfg, folder = get_shape(random_shape), None
    else:
        if model is None:
            raise ValueError("load_format='dummy' needs a model folder holding config.json, "
                             "or random_shape (a named shape)")
        folder = os.path.abspath(os.path.expanduser(model))
        path = os.path.join(folder, "config.json")
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"load_format='dummy': model folder not found: {model!r}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"load_format='dummy': {folder} has no config.json "
                                    f"(the model's shape is read from it)")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    tok = None
    if folder is not None and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        tok = Tokenizer.from_dir(folder)
    else:
        tok = byte_tokenizer(int(cfg["vocab_size"]))
        log.info("dummy weights: no tokenizer.json, using a byte-level fallback tokenizer%s",
                 "" if tok else " -- none: the vocabulary has < 256 ids, so prompts must be token ids")
    return cfg, tok
