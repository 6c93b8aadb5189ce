"""Reasoning parsers, chosen by `--reasoning-parser NAME` (names as vLLM's)."""

from __future__ import annotations

from jaxllm.server.reasoning import deepseek_r1, qwen3  # noqa: F401  (they register)
from jaxllm.server.reasoning.base import REASONING_PARSERS, ReasoningParser


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A parser by name; ValueError naming the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()


__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser"]
