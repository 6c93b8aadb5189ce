"""`tool_choice` -> what the request does with its tools, and the JSON schema that forces a call.

As vLLM: "none" leaves the output alone; "auto" lets the model choose and parses its text
(needs `--enable-auto-tool-choice --tool-call-parser NAME`); "required" and a named
function constrain generation with a JSON schema built from the tools' parameters
(`_get_json_schema_from_tool` in vLLM): "required" is a non-empty array of
`{"name", "parameters"}` objects (and nothing else: other keys would not reach the call),
a named function is that function's parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from jaxllm.server.chat_protocol import ChatCompletionRequest, NamedToolChoice
from jaxllm.server.protocol import APIError

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    kind: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for "named"
    parallel: bool = True  # False: at most one call

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")


def resolve(req: ChatCompletionRequest, auto_enabled: bool) -> ToolMode:
    """The request's tool mode; 400 naming `tool_choice` when it cannot be honoured."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolMode("none", parallel=parallel)
    if not req.tools:
        raise APIError(400, f"tool_choice {_show(choice)} needs `tools`", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in req.tools]
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in "
                                f"`tools` ({', '.join(names)})", param="tool_choice")
        return ToolMode("named", choice.function.name, parallel)
    if choice == "auto" and not auto_enabled:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                            'set on the server (tools without tool_choice default to "auto"); send '
                            'tool_choice "none", "required" or a named function instead', param="tool_choice")
    return ToolMode(choice, parallel=parallel)


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.function.name)


def _parameters(fn: Any) -> dict:
    return copy.deepcopy(fn.parameters) if fn.parameters else dict(_EMPTY_OBJECT)


def json_schema(req: ChatCompletionRequest, mode: ToolMode) -> dict | None:
    """The JSON schema a constrained mode imposes on the output (None for "none" / "auto")."""
    if mode.kind == "named":
        fn = next(t.function for t in req.tools if t.function.name == mode.name)
        return _parameters(fn)
    if mode.kind != "required":
        return None
    defs: dict[str, Any] = {}
    options = []
    for t in req.tools:
        params = _parameters(t.function)
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise APIError(400, f"tools define $defs/{key} twice, differently", param="tools")
            defs[key] = value
        options.append({"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                       "parameters": params}, "required": ["name", "parameters"],
                        "additionalProperties": False})  # other keys would be dropped from the call
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not mode.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
