"""The JAXLLM_* environment variables that tune the engine (as vLLM's ``vllm/envs.py``): each read
through one typed parser that names the variable when its value is bad. Pure Python."""

from __future__ import annotations

import os


def _env_number(name: str, default, cast, what: str, minimum):
    raw = os.environ.get(name, str(default))
    try:
        value = cast(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    return _env_number(name, default, int, "an integer", minimum)


def env_float(name: str, default: float, minimum: float | None = None) -> float:
    return _env_number(name, default, float, "a number", minimum)


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value
