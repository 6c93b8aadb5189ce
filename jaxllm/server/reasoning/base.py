"""What the `--reasoning-parser` classes share: splitting `<think>...</think>` off the output.

`split(text, final, open_)` is a pure function of the text so far (as the tool parsers'
`parse`): for a prefix it returns reasoning and content that are prefixes of what the
whole output gives, holding back text that may still become a marker, so streamed deltas
reassemble to the non-streamed answer. Whether the output starts inside the reasoning
section depends on the prompt (templates may open `<think>` themselves, or close it to
turn thinking off): `starts_open(prompt)`.
"""

from __future__ import annotations

from typing import ClassVar

from jaxllm.server.tool_parsers.base import held

REASONING_PARSERS: dict[str, type["ReasoningParser"]] = {}


def register(cls: type["ReasoningParser"]) -> type["ReasoningParser"]:
    """Class decorator: make a parser available to `--reasoning-parser NAME`."""
    REASONING_PARSERS[cls.name] = cls
    return cls


class ReasoningParser:
    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def starts_open(self, prompt: str) -> bool:
        """Whether the generated text begins inside the reasoning section."""
        raise NotImplementedError

    def expects_reasoning(self, prompt: str) -> bool:
        """Whether a reasoning section may still come (so constraints wait for its end)."""
        return not self.closed_in(prompt)

    def closed_in(self, prompt: str) -> bool:
        """The prompt ends with a closed think block (e.g. thinking turned off by the template)."""
        return prompt.rstrip().endswith(self.end)

    def split(self, text: str, final: bool, open_: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the text so far; reasoning is None when the output has none."""
        lead = text.lstrip()
        if lead.startswith(self.start):
            body, open_ = lead[len(self.start):], True
        elif not final and self.start.startswith(lead):
            return ("" if open_ else None), ""  # nothing yet, or a start tag arriving
        else:
            body = text
        if not open_:
            return None, text
        j = body.find(self.end)
        if j < 0:
            return (body if final else body[:len(body) - held(body, self.end)]), ""
        return body[:j], body[j + len(self.end):]
