"""What every tool-call parser shares: the parse contract, JSON scanning, hold-back of markers.

A parser turns the model's text into (content, tool calls). It is a pure function
of the text so far: `parse(text, final)` for a prefix of the output gives content and
calls that are prefixes of what any longer text gives, so streaming is the difference
between two parses and the streamed deltas reassemble to exactly the non-streamed answer
(which is `parse(full_text, final=True)`). Text that might still turn into a marker is
held back until it is decided.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


TOOL_PARSERS: dict[str, type["ToolParser"]] = {}


def register(cls: type["ToolParser"]) -> type["ToolParser"]:
    """Class decorator: make a parser available to `--tool-call-parser NAME` (vLLM's ToolParserManager)."""
    TOOL_PARSERS[cls.name] = cls
    return cls


class ToolParser:
    """Base of the `--tool-call-parser` classes; subclasses set `name` and implement `parse`."""

    name: ClassVar[str]
    # False when the markers are special tokens, so they must stay in the detokenized text.
    skip_special_tokens: ClassVar[bool] = True

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def new_id(self) -> str:
        return f"chatcmpl-tool-{secrets.token_hex(16)}"


def held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def undecided(text: str, marker: str, final: bool) -> str:
    """The part of content text that is decided: all of it at the end; before that, not a suffix that
    may become `marker`, nor trailing whitespace (which is layout if a call follows)."""
    if final:
        return text
    return text[:len(text) - held(text, marker)].rstrip()


def before_call(text: str) -> str:
    """Content in front of a call: whitespace alone is layout, not content."""
    return text if text.strip() else ""


def decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """(JSON value, end) decoded at text[pos:], or None when there is none (yet)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def call_from(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from {"name": str, "arguments"|"parameters": object}; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as JSON text
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    return ToolCall(obj["name"], "{}")


def skip_space(text: str, pos: int, also: str = "") -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in also):
        pos += 1
    return pos


_ALNUM = string.ascii_letters + string.digits


def alnum_id(n: int = 9) -> str:
    """Mistral's tool-call ids: nine letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(n))
