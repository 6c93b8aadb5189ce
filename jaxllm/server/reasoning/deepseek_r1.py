"""DeepSeek-R1: the output is reasoning until `</think>` (its template opens `<think>` in the
prompt; a leading `<think>` in the output is dropped). No `</think>` at all: all of it is
reasoning, as vLLM does."""

from __future__ import annotations

from jaxllm.server.reasoning.base import ReasoningParser, register


@register
class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_open(self, prompt: str) -> bool:
        return not self.closed_in(prompt)
