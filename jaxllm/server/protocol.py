"""OpenAI request models (plus vLLM's extra sampling fields) and OpenAI-shaped errors.

The field bounds are part of the published OpenAPI schema, so clients (and the
schemathesis run in the tests) learn the limits from the schema, and anything
outside them is a 400 before it reaches the engine. Every field of OpenAI's request
schemas is declared; those the server cannot honour accept only null (see
`fields.py`). Unknown fields are ignored and logged, as vLLM does, so clients that
send newer parameters keep working. The chat request lives in `chat_protocol.py`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxllm.server.constraints import ConstraintFields
from jaxllm.server.fields import RESTRICTED, unsupported

MAX_N = 128  # choices per request; each choice is a sequence in the engine
# The largest integer bound a client comparing JSON numbers as doubles reads the same way as the
# server: above 2 ** 53, integers just past a bound round down onto it (2 ** 63 - 1000 reads as the
# bound 2 ** 63 - 1024 in a double), so a schema-valid request could be refused (schemathesis found it).
INT64 = 2 ** 53 - 1
# Bounds that depend on the model or the server's flags carry a tag; `openapi.py` writes the
# running server's value into the published schema (the vocabulary, --max-num-seqs, ...).


def _integral(value: Any) -> Any:
    """1.0 is an integer in JSON Schema; "1" is not (models are strict: no string-to-number coercion)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(ge: int | None = None, le: int | None = None) -> Any:
    """An int field type: strings are refused, integral floats taken (as JSON Schema's integer); the bounds
    sit before the conversion so that the published schema states them."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


TokenId = Annotated[Int(0), Field(json_schema_extra={"x-bound": "vocab"})]
Text = Annotated[str, Field(min_length=1)]


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
    """Request models: unknown fields are kept (and logged as ignored); values are taken as the schema
    types them (strict: "1" is not a number, "true" is not a boolean)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Req):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(ConstraintFields, _Req):
    """Fields shared by completions and chat; names and defaults as OpenAI and vLLM."""

    model: str | None = None
    n: Int(1, MAX_N) = Field(1, json_schema_extra={"x-bound": "max_num_seqs"})
    best_of: Int(1, MAX_N) | None = Field(None, json_schema_extra={"x-bound": "max_num_seqs"})
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int(-1, INT64) | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    seed: Int(-INT64 - 1, INT64) | None = None
    stop: Text | list[Text] | None = None  # "" stops nothing: refused, as SamplingParams does
    stop_token_ids: list[TokenId] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Int(0, INT64) = Field(0, json_schema_extra={"x-bound": "max_model_len"})
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description=f"Not supported: "
                                                f"{RESTRICTED['logit_bias']}; only null or {{}}.")
    user: str | None = Field(None, description="end-user identifier; accepted, no effect on generation")
    priority: Int(-INT64 - 1, INT64) = Field(0, json_schema_extra={"x-bound": "priority"})
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="vLLM's P/D field: {\"do_remote_decode\": true} on a prefill server; the "
                          "returned parameters on a decode server (needs --kv-transfer-config)")

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

    prompt: (Text | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]) = Field(
        ..., description="text, token ids, or a batch of either")
    max_tokens: Int(0, INT64) | None = Field(16, json_schema_extra={"x-bound": "max_model_len"})
    logprobs: Int(0, MAX_LOGPROBS) | None = None
    echo: bool = False
    suffix: None = unsupported("suffix")


class TokenizeCompletionRequest(_Req):
    """POST /tokenize with a prompt (the chat form is `TokenizeChatRequest`; unknown fields are a 400,
    so a body is one form or the other)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Req):
    model: str | None = None
    tokens: list[TokenId]


def _structured_kw(structured: Any) -> dict:
    """`structured_outputs=` for SamplingParams only when a constraint is set (older builds lack the field)."""
    return {} if structured is None else {"structured_outputs": structured}
