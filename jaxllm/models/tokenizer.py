"""Tokenizer for jaxllm: a thin layer over a ``tokenizers.Tokenizer`` plus a chat template.

Why not transformers' tokenizer classes: loading one from a GGUF pulls in torch and takes seconds,
and the engine only needs encode/decode/special ids/chat rendering. The Rust ``tokenizers``
backend gives identical ids; the chat template is rendered with jinja2 configured like
transformers (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

logger = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp pre-tokenizer names whose split is "each digit alone, then the GPT-2 regex".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_SPLIT_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
              "falcon3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE spells tokens in it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pre: str | None) -> Any:
    """The pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` name."""
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("unknown GGUF pre-tokenizer %r; using the GPT-2 split", pre)
    return byte_level


def backend_from_gguf_metadata(meta: dict[str, Any]) -> _Backend:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from GGUF ``tokenizer.ggml.*`` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
                                  "load the model's HF folder instead")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens written with characters outside the byte alphabet are respelled byte by byte.
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole and are special; a "control" token spelled outside the byte
    # alphabet is a llama.cpp mislabel and adding it would grow the vocabulary, so skip it.
    special = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= spelled]
    backend.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)
    single, specials = "$A", []
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        single = f"{tokens[bos_id]} {single}"
        specials.append((tokens[bos_id], int(bos_id)))
    if meta.get("tokenizer.ggml.add_eos_token") and eos_id is not None:
        single = f"{single} {tokens[eos_id]}"
        specials.append((tokens[eos_id], int(eos_id)))
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return backend


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens either as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's built-in tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    """Compile a chat template in a sandbox configured like transformers does."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """Accept ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) as a no-op."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(self, backend: _Backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 chat_template: str | None = None) -> None:
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.chat_template = chat_template
        self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Tokenizer described by a GGUF's metadata (see ``gguf_file.read_gguf_metadata``)."""
        tokens = meta["tokenizer.ggml.tokens"]

        def tok(key: str) -> str | None:
            idx = meta.get(f"tokenizer.ggml.{key}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        return cls(backend_from_gguf_metadata(meta), bos_token=tok("bos_token_id"), eos_token=tok("eos_token_id"),
                   pad_token=tok("padding_token_id"), unk_token=tok("unknown_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        """Tokenizer embedded in a GGUF file (reads metadata only)."""
        from jaxllm.models.gguf_file import read_gguf_metadata
        return cls.from_gguf_metadata(read_gguf_metadata(path))

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """Tokenizer of an HF folder (tokenizer.json + tokenizer_config.json [+ chat_template.jinja])."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        cfg: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
            p = os.path.join(path, name)
            if os.path.isfile(p):
                with open(p, encoding="utf-8") as f:
                    cfg.update(json.load(f))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        return cls(_Backend.from_file(tj), bos_token=_token_text(cfg.get("bos_token")),
                   eos_token=_token_text(cfg.get("eos_token")), pad_token=_token_text(cfg.get("pad_token")),
                   unk_token=_token_text(cfg.get("unk_token")), chat_template=template)

    def save(self, path: str) -> None:
        """Write tokenizer.json + tokenizer_config.json so ``from_dir`` (or transformers) can reload it."""
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
               "eos_token": self.eos_token, "pad_token": self.pad_token, "unk_token": self.unk_token,
               "chat_template": self.chat_template}
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=1)

    # ---- ids ------------------------------------------------------------------------------------
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> set[int]:
        return set(self._special_ids)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    # ---- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, chat_template: str | None = None,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the chat template, as transformers' ``apply_chat_template`` does."""
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
                    "unk_token": self.unk_token}
        # Unset tokens stay undefined (render as ""), like transformers' special_tokens_map.
        variables = {**{k: v for k, v in specials.items() if v is not None}, **kwargs}
        text = _compile_template(source).render(messages=messages, tools=tools, documents=documents,
                                                add_generation_prompt=add_generation_prompt, **variables)
        # The template already writes any BOS it wants, so no special tokens are added here.
        return self.encode(text, add_special_tokens=False) if tokenize else text
