"""Mistral: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}]` (v3 tokenizers),
or `[TOOL_CALLS]name[ARGS]{...}` / `[TOOL_CALLS]name{...}` per call (v11+).

Text before the first `[TOOL_CALLS]` is content. Tool-call ids are nine letters and digits,
as Mistral's chat templates require.
"""

from __future__ import annotations

import json

from jaxllm.server.tool_parsers.base import (Parsed, ToolCall, ToolParser, alnum_id, before_call, call_from,
                                             decode_at, register, skip_space, undecided)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


@register
class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def new_id(self) -> str:
        return alnum_id()

    def parse(self, text: str, final: bool) -> Parsed:
        i = text.find(MARKER)
        if i < 0:
            return Parsed(content=undecided(text, MARKER, final))
        out = Parsed(content=before_call(text[:i]))
        pos = i
        while text.startswith(MARKER, pos):
            mark, pos = pos, skip_space(text, pos + len(MARKER))
            got = self._calls_at(text, pos)
            if got is None:
                if final:
                    out.content += text[mark:]
                return out
            calls, pos = got
            if not calls:  # not a call after all: the rest is content
                out.content += text[mark:]
                return out
            out.calls.extend(calls)
            pos = skip_space(text, pos)
            if not final and len(text) - pos < len(MARKER) and MARKER.startswith(text[pos:]):
                return out
        tail = text[pos:].strip()
        out.content += tail if final else ""
        return out

    @staticmethod
    def _calls_at(text: str, pos: int) -> tuple[list[ToolCall], int] | None:
        """Calls starting at pos and where they end; None when not complete yet; [] when not calls."""
        if text.startswith("[", pos) and not text.startswith(ARGS, pos):
            got = decode_at(text, pos)
            if got is None:
                return None
            items = got[0] if isinstance(got[0], list) else []
            calls = [call_from(x) for x in items]
            return ([] if None in calls or not calls else calls), got[1]
        a, b = text.find(ARGS, pos), text.find("{", pos)
        cut = a if a >= 0 and (b < 0 or a < b) else b
        if cut < 0:
            return None
        name = text[pos:cut].strip()
        start = cut + len(ARGS) if cut == a else cut
        got = decode_at(text, skip_space(text, start))
        if got is None:
            return None
        if not name or not isinstance(got[0], dict):
            return [], got[1]
        return [ToolCall(name, json.dumps(got[0], ensure_ascii=False))], got[1]
