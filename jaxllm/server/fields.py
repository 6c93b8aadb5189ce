"""No silent drops: OpenAI request fields the server does not implement, and fields it does not know.

Every field of OpenAI's chat/completions request schema is declared on the request
models. The ones this server cannot honour are declared as `null`-only (so the
published schema says so) and a request that sets one is a 400 naming the field and
why. Fields outside the schema are ignored, as vLLM does, and logged by name.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, Field

log = logging.getLogger("jaxllm")

# field -> why it is refused (the 400's message); the field must be null or absent.
UNSUPPORTED: dict[str, str] = {
    "audio": "audio output is not supported",
    "functions": "deprecated by OpenAI and not supported; use tools",
    "function_call": "deprecated by OpenAI and not supported; use tool_choice",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderated completions are not supported",
    "verbosity": "verbosity is not supported; bound the output with max_completion_tokens",
    "suffix": "suffix (insertion) is not supported",
}

# Fields limited to some of OpenAI's values; the schema lists what is accepted.
RESTRICTED: dict[str, str] = {
    "store": "stored completions are not offered; store must be false",
    "service_tier": "one service tier: 'auto' or 'default'",
    "modalities": "text output only: modalities must be ['text']",
    "logit_bias": "logit_bias is not supported",
}


def unsupported(name: str) -> Any:
    """A `null`-only field whose description gives the reason."""
    return Field(None, description=f"Not supported: {UNSUPPORTED[name]}. Must be null or absent.")


def reason_for(loc: tuple) -> str | None:
    """The 400 message for a validation error at `loc` on a refused field, or None."""
    top = next((str(x) for x in loc if x != "body"), None)
    if top in UNSUPPORTED:
        return f"{top} is not supported: {UNSUPPORTED[top]}"
    if top in RESTRICTED:
        return f"{top}: {RESTRICTED[top]}"
    return None


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields a request carried that no model declares."""
    out = [prefix + k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name, None)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                out.extend(ignored_fields(item, where))
    return out


def log_ignored(model: BaseModel) -> list[str]:
    """vLLM's behaviour: unknown fields are accepted and logged as ignored."""
    names = ignored_fields(model)
    if names:
        log.warning("The following fields were present in the request but ignored: %s", sorted(names))
    return names
