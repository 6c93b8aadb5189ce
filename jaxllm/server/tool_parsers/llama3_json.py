"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, several separated by `;`.

The output is a tool call when it starts (after optional `<|python_tag|>`) with a JSON
object naming a function; otherwise all of it is content. Calls are read one JSON object
at a time; whatever follows the last call that is not another call is content.
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import Parsed, ToolParser, call_from, decode_at, register, skip_space

PYTHON_TAG = "<|python_tag|>"


@register
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    skip_special_tokens = False  # <|python_tag|> is a special token

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(text[pos:]) and not final:
            return Parsed()  # empty, or a tag still arriving
        if pos >= len(text) and not final:
            return Parsed()
        if not text.startswith("{", pos):
            return Parsed(content=text)
        out = Parsed()
        while True:
            got = decode_at(text, pos)
            call = call_from(got[0]) if got else None
            if call is None:
                if got is None and not final:
                    return out  # an object still arriving
                rest = text if not out.calls else text[pos:]
                if out.calls and not rest.strip(";").strip():
                    rest = ""
                out.content = rest if (final or got is not None) else ""
                return out
            out.calls.append(call)
            pos = skip_space(text, got[1], ";")
            if pos >= len(text):
                return out
            if not text.startswith("{", pos):
                out.content = text[pos:] if final else ""
                return out
