"""Request fields that constrain the output -> one `StructuredOutputsParams`.

Three spellings reach the same constraint, as in vLLM: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs` object, and the older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields. A request
may use one of them; two at once is a 400 naming both, never a silent pick. A
`structured_outputs` object with only `whitespace_pattern` / `disable_any_whitespace`
shapes the JSON that `response_format` (or `tool_choice`) asks for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[a-zA-Z0-9_-]+$"  # OpenAI's rule for function and schema names


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class JsonSchemaSpec(_Model):
    name: str = Field(..., min_length=1, max_length=64, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


class ResponseFormatText(_Model):
    type: Literal["text"]


class ResponseFormatJsonObject(_Model):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Model):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class StructuredOutputsField(_Model):
    """vLLM's `structured_outputs` request object: exactly one of the constraint kinds."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


class ConstraintFields(BaseModel):
    """Mixed into the completions and chat requests."""

    model_config = ConfigDict(strict=True)

    response_format: ResponseFormat | None = Field(None, discriminator="type")
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM alias of structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM alias of structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="vLLM alias of structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM alias of structured_outputs.grammar")
    guided_whitespace_pattern: str | None = Field(
        None, description="vLLM alias of structured_outputs.whitespace_pattern")

    def constraint_kwargs(self) -> tuple[str, dict[str, Any]] | None:
        """(the field it came from, StructuredOutputsParams keyword arguments), or None when unconstrained.

        ValueError naming the fields when more than one source is set.
        """
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if isinstance(rf, ResponseFormatJsonObject):
            found.append(("response_format", {"json_object": True}))
        elif isinstance(rf, ResponseFormatJsonSchema):
            schema = rf.json_schema.schema_
            found.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
        so = self.structured_outputs
        if so is not None:
            kw = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": bool(so.json_object), "structural_tag": so.structural_tag}
            if any(v not in (None, False) for v in kw.values()):
                found.append(("structured_outputs", kw))
            # else: only whitespace options, for the JSON of response_format (or of the tools)
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        for kind, value in guided.items():
            if value is not None:
                found.append((f"guided_{kind}", {kind: value}))
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"give one output constraint, not several: {', '.join(n for n, _ in found)}")
        source, kw = found[0]
        kw = {k: v for k, v in kw.items() if v not in (None, False)}
        if kw.get("structural_tag") is not None and not isinstance(kw["structural_tag"], str):
            import json
            kw["structural_tag"] = json.dumps(kw["structural_tag"])
        ws = self.whitespace()
        if ws and not ({"json", "json_object"} & set(kw)):
            raise ValueError(f"whitespace options apply to JSON constraints, not to {source}'s {next(iter(kw))}")
        return source, {**kw, **ws}

    def whitespace(self) -> dict[str, Any]:
        """The whitespace options for JSON constraints (structured_outputs' or guided_whitespace_pattern)."""
        so, out = self.structured_outputs, {}
        pattern = so.whitespace_pattern if so is not None and so.whitespace_pattern else self.guided_whitespace_pattern
        if pattern is not None:
            out["whitespace_pattern"] = pattern
        if so is not None and so.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out
