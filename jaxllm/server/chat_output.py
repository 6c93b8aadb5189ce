"""One chat choice's text -> its message: reasoning, content and tool calls, whole or as deltas.

The pipeline per choice: the reasoning parser (if any) splits `<think>...</think>` off,
then the tool mode reads the rest: "none" keeps it as content, "auto" runs the tool
parser, "named" makes the whole text the arguments of the one call, "required" reads a
JSON array of `{"name", "parameters"}` calls. Every stage is a pure function of the text
so far, so a streamed choice's deltas are the differences between successive views, and
they reassemble to the non-streamed message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxllm.server.reasoning import ReasoningParser
from jaxllm.server.tool_calls import ToolMode
from jaxllm.server.tool_parsers import Parsed, ToolCall, ToolParser
from jaxllm.server.tool_parsers.base import call_from, decode_at, skip_space


@dataclass
class View:
    reasoning: str | None = None
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _required_calls(text: str, final: bool) -> Parsed:
    """The complete elements of a JSON array of {"name", "parameters"} (tool_choice "required")."""
    out, pos = Parsed(), skip_space(text, 0)
    if not text.startswith("[", pos):
        return Parsed(content=text if final else "")
    pos += 1
    while True:
        pos = skip_space(text, pos, ",")
        got = decode_at(text, pos)
        call = call_from(got[0], ("parameters", "arguments")) if got else None
        if call is None:
            break
        out.calls.append(call)
        pos = got[1]
    if final and not out.calls:  # cut short (length) before one call was complete
        out.content = text
    return out


class ChoiceText:
    """Reads one choice's generated text; `view(text, final)` is its message so far."""

    def __init__(self, mode: ToolMode, tool_parser: ToolParser | None, reasoning: ReasoningParser | None,
                 starts_open: bool, eos_text: str | None = None) -> None:
        """`eos_text`: the end-of-sequence token's text, when special tokens stay in the text (the tool
        parser's markers are special): it ends the output, it is not part of the message."""
        self.mode, self.tool_parser, self.reasoning, self.open = mode, tool_parser, reasoning, starts_open
        self.eos_text = eos_text
        self.ids: list[str] = []
        self.sent = View(reasoning="", content="")
        self.sent_args: list[str] = []

    def view(self, text: str, final: bool) -> View:
        if final and self.eos_text and text.endswith(self.eos_text):
            text = text[:-len(self.eos_text)]
        reasoning, rest = None, text
        if self.reasoning is not None:
            reasoning, rest = self.reasoning.split(text, final, self.open)
        kind = self.mode.kind
        if kind == "auto":
            parsed = self.tool_parser.parse(rest, final)
        elif kind == "required":
            parsed = _required_calls(rest, final)
        elif kind == "named":
            rest = rest.lstrip()
            parsed = Parsed(calls=[ToolCall(self.mode.name, rest)] if rest or final else [])
        else:
            parsed = Parsed(content=rest)
        calls = parsed.calls if self.mode.parallel else parsed.calls[:1]
        while len(self.ids) < len(calls):
            self.ids.append(self.tool_parser.new_id() if self.tool_parser else ToolParser().new_id())
        return View(reasoning, parsed.content, calls)

    def tools_called(self, view: View) -> bool:
        """finish_reason "tool_calls": the model chose to call (auto) or had to (required); not for a named one."""
        return bool(view.calls) and self.mode.kind in ("auto", "required")

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed assistant message."""
        v = self.view(text, final=True)
        msg: dict[str, Any] = {"role": "assistant", "content": v.content if (v.content or not v.calls) else None}
        if self.reasoning is not None:
            msg["reasoning_content"] = v.reasoning
        if v.calls:
            msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for i, c in zip(self.ids, v.calls)]
        return msg

    def delta(self, text: str, final: bool) -> tuple[dict[str, Any], View]:
        """The delta since the last call (for the accumulated `text`), and the view it came from."""
        v = self.view(text, final)
        d: dict[str, Any] = {}
        if v.reasoning and len(v.reasoning) > len(self.sent.reasoning):
            d["reasoning_content"] = v.reasoning[len(self.sent.reasoning):]
            self.sent.reasoning = v.reasoning
        if len(v.content) > len(self.sent.content):
            d["content"] = v.content[len(self.sent.content):]
            self.sent.content = v.content
        calls = []
        for k, c in enumerate(v.calls):
            if k >= len(self.sent_args):
                self.sent_args.append(c.arguments)
                calls.append({"index": k, "id": self.ids[k], "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})
            elif len(c.arguments) > len(self.sent_args[k]):
                calls.append({"index": k, "function": {"arguments": c.arguments[len(self.sent_args[k]):]}})
                self.sent_args[k] = c.arguments
        if calls:
            d["tool_calls"] = calls
        return d, v

