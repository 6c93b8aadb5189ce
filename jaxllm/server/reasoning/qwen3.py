"""Qwen3: the model writes `<think>...</think>` itself, or (Qwen3 thinking templates) the
prompt opens `<think>` and the output only closes it. With `enable_thinking=False` the
template writes an empty, closed block, and the output is all content."""

from __future__ import annotations

from jaxllm.server.reasoning.base import ReasoningParser, register


@register
class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def starts_open(self, prompt: str) -> bool:
        return prompt.rfind(self.start) > prompt.rfind(self.end)
