"""Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

Text outside the blocks is content (whitespace alone between calls, or in front of them, is dropped); a block
whose body is not a call stays in the content as written. An unclosed last block is
parsed at the end of the output, as vLLM does.
"""

from __future__ import annotations

import json

from jaxllm.server.tool_parsers.base import Parsed, ToolCall, ToolParser, before_call, call_from, register, undecided


def _call(body: str) -> ToolCall | None:
    try:
        return call_from(json.loads(body))
    except ValueError:
        return None


@register
class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        out, pos = Parsed(), 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                if out.calls:  # after the calls: decided at the end, without the layout in front
                    tail = tail.lstrip() if final else ""
                out.content += undecided(tail, self.start, final)
                return out
            out.content += before_call(text[pos:i])
            j = text.find(self.end, i + len(self.start))
            if j < 0 and not final:
                return out
            stop = len(text) if j < 0 else j + len(self.end)
            call = _call(text[i + len(self.start):len(text) if j < 0 else j])
            if call is not None:
                out.calls.append(call)
            else:
                out.content += text[i:stop]
            if j < 0:
                return out
            pos = stop
