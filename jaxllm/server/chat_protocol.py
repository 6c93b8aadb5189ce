"""The chat request: messages (with tool calls and tool results), tools, tool_choice.

Assistant messages may carry `tool_calls` and tool results come back as `role: "tool"`
messages with their `tool_call_id`; both reach the chat template as the HF templates
expect them (a tool call's `arguments` as a parsed object when it is JSON, as vLLM does).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field

from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.server.constraints import NAME_PATTERN
from jaxllm.server.fields import unsupported
from jaxllm.server.protocol import INT64, Int, SamplingFields, _Req


class TextPart(_Req):
    type: Literal["text"]
    text: str


class FunctionCall(_Req):
    name: str
    arguments: str = Field(..., description="the arguments, as JSON text")


class ToolCallParam(_Req):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers")
    reasoning_content: str | None = Field(None, description="assistant: its reasoning, for templates that "
                                                            "show it")
    refusal: str | None = None
    audio: None = Field(None, description="Not supported: audio. Must be null or absent.")
    function_call: None = Field(None, description="Not supported (deprecated); use tool_calls.")

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        return d


def _arguments(text: str) -> Any:
    """HF chat templates render `arguments` with tojson, so they take the parsed object."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDef(_Req):
    name: str = Field(..., min_length=1, max_length=64, pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(_Req):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Req):
    name: str


class NamedToolChoice(_Req):
    type: Literal["function"]
    function: NamedFunction


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Int(1, INT64) | None = Field(None, description="deprecated: max_completion_tokens",
                                   json_schema_extra={"x-bound": "max_model_len"})
    max_completion_tokens: Int(1, INT64) | None = Field(None, json_schema_extra={"x-bound": "max_model_len"})
    logprobs: bool | None = False
    top_logprobs: Int(0, MAX_LOGPROBS) | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: 'auto' when tools are given (needs --enable-auto-tool-choice), else 'none'")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="passed to the chat template; a 400 when the model's template does not take it",
        json_schema_extra={"x-bound": "reasoning_effort"})
    # OpenAI fields with no effect on what is generated (identifiers, cache and routing hints).
    metadata: dict[str, str] | None = Field(None, description="accepted; nothing is stored")
    safety_identifier: str | None = Field(None, description="accepted; no effect on generation")
    prompt_cache_key: str | None = Field(None, description="accepted; prefix caching is automatic")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description="accepted; in memory")
    prompt_cache_options: dict[str, Any] | None = Field(None, description="accepted; prefix caching is "
                                                                         "automatic")
    store: Literal[False] | None = Field(None, description="stored completions are not offered: false only")
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = Field(None, description="text output only")
    # OpenAI fields this server refuses when set.
    audio: None = unsupported("audio")
    functions: None = unsupported("functions")
    function_call: None = unsupported("function_call")
    prediction: None = unsupported("prediction")
    web_search_options: None = unsupported("web_search_options")
    moderation: None = unsupported("moderation")
    verbosity: None = unsupported("verbosity")
    # vLLM's extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="continue the last (assistant) message instead of "
                                                            "starting a new one")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the tokenizer's chat template."""
        return [m.for_template() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template takes them (None when the request has none)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class TokenizeChatRequest(_Req):
    """POST /tokenize with chat messages (rendered by the chat template)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
