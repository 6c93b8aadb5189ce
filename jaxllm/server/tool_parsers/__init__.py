"""Tool-call parsers for `tool_choice="auto"`, chosen by `--tool-call-parser NAME` (names as vLLM's)."""

from __future__ import annotations

from jaxllm.server.tool_parsers import hermes, llama3_json, mistral  # noqa: F401  (they register)
from jaxllm.server.tool_parsers.base import TOOL_PARSERS, Parsed, ToolCall, ToolParser


def get_tool_parser(name: str) -> ToolParser:
    """A parser by name; ValueError naming the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "Parsed", "ToolCall", "ToolParser", "get_tool_parser"]
