"""OpenAI request models (plus vLLM's extra sampling fields) and OpenAI-shaped errors.

The field bounds are part of the published OpenAPI schema, so clients (and the
schemathesis run in the tests) learn the limits from the schema, and anything
outside them is a 400 before it reaches the engine. Every field of OpenAI's request
schemas is declared; those the server cannot honour accept only null (see
`fields.py`). Unknown fields are ignored and logged, as vLLM does, so clients that
send newer parameters keep working. The chat request lives in `chat_protocol.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxllm.server.constraints import ConstraintFields
from jaxllm.server.fields import RESTRICTED, unsupported

MAX_N = 128  # choices per request; each choice is a sequence in the engine
INT64 = 2 ** 63 - 1


class APIError(Exception):
    """An error with an HTTP status, rendered as OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_body(status: int, message: str) -> dict:
    """OpenAI error body for a plain status + message."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "server_overloaded"}
    return APIError(status, message, kinds.get(status, "server_error")).body()


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail


class _Req(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Req):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(ConstraintFields, _Req):
    """Fields shared by completions and chat; names and defaults as OpenAI and vLLM."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description=f"Not supported: "
                                                f"{RESTRICTED['logit_bias']}; only null or {{}}.")
    user: str | None = Field(None, description="end-user identifier; accepted, no effect on generation")
    priority: int = Field(0, ge=-INT64 - 1, le=INT64)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None, structured: Any = None) -> SamplingParams:
        """SamplingParams for this request; ValueError (-> 400) on an invalid combination."""
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported")
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, **_structured_kw(structured))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `max_tokens=0` is allowed with `echo` (score the prompt only)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, token ids, or a batch of either")
    max_tokens: int | None = Field(16, ge=0, le=INT64)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: None = unsupported("suffix")


class TokenizeCompletionRequest(_Req):
    """POST /tokenize with a prompt (the chat form is `TokenizeChatRequest`; unknown fields are a 400,
    so a body is one form or the other)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Req):
    model: str | None = None
    tokens: list[int]


def _structured_kw(structured: Any) -> dict:
    """`structured_outputs=` for SamplingParams only when a constraint is set (older builds lack the field)."""
    return {} if structured is None else {"structured_outputs": structured}
