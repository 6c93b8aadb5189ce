"""Per-request sampling parameters, mirroring vLLM's ``SamplingParams``.

Field names, defaults and validation messages follow vLLM so that OpenAI-style
servers and user code written against vLLM work unchanged. Validation happens
eagerly in ``__post_init__`` because a bad value should fail the request at
admission time (as a 400 from the server), not deep inside a jitted step.
"""

from __future__ import annotations

import copy
import enum
import json as _json
from dataclasses import dataclass, fields

# Temperatures below this are treated as greedy: dividing logits by a
# near-zero number overflows float32 and is meaningless anyway (vLLM uses 1e-5).
_SAMPLING_EPS = 1e-5

# The largest number of top logprobs a request may ask for (vLLM's default cap).
MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    """How a request draws its next token; the scheduler/sampler branch on it."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request reports (vLLM's names): every step's cumulative output, or only
    the final one (what ``LLM.generate`` asks for: it reads nothing before the end, and building
    an output per request per step is host work). vLLM's DELTA is refused: jaxllm streams deltas
    through ``AsyncLLM.generate(delta=True)``."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The constraint kinds of ``StructuredOutputsParams``: exactly one is set per request.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams`` names).

    Exactly one kind is set: ``json`` (a JSON schema, as text or dict), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (Lark or GBNF/EBNF, as llguidance takes it),
    ``json_object`` (any JSON object) or ``structural_tag`` (vLLM's JSON text
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``).
    ``whitespace_pattern`` / ``disable_any_whitespace`` shape the whitespace JSON may use.

    ``reasoning_end_ids``: for reasoning models, the token sequence that ends the reasoning
    section (e.g. the ids of ``</think>``). When set, generated tokens are free until the output
    contains that sequence, and the constraint applies to the tokens after it.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    reasoning_end_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            self.choice = [str(c) for c in self.choice]
            if not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        if self.reasoning_end_ids is not None:
            self.reasoning_end_ids = [int(t) for t in self.reasoning_end_ids]
            if not self.reasoning_end_ids:
                raise ValueError("structured_outputs.reasoning_end_ids must not be empty when set.")
        chosen = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)}; got {chosen or 'none'}.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a str or dict, got {type(self.json).__name__}.")

    @property
    def kind(self) -> str:
        """The one constraint kind that is set (a name from ``STRUCTURED_KINDS``)."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """A hashable key naming the compiled grammar (reasoning_end_ids does not change it)."""
        parts = []
        for f in fields(self):
            if f.name == "reasoning_end_ids":
                continue
            value = getattr(self, f.name)
            parts.append(_json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value)
        return tuple(parts)


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM-compatible names and defaults).

    ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` means "generate up
    to the model's context length". ``stop`` and ``stop_token_ids`` are always
    lists after construction so downstream code never has to special-case
    ``None`` or a bare string.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else [int(t) for t in self.stop_token_ids]
        self._verify_args()

    def _verify_args(self) -> None:
        """Reject out-of-range values with vLLM-style messages naming the field."""
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise ValueError(f"output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY, got "
                             f"{self.output_kind!r} (deltas: AsyncLLM.generate(delta=True))")
        if not isinstance(self.n, int) or isinstance(self.n, bool):
            raise ValueError(f"n must be an int, got {type(self.n).__name__}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of is not None:
            if not isinstance(self.best_of, int) or isinstance(self.best_of, bool):
                raise ValueError(f"best_of must be an int, got {type(self.best_of).__name__}.")
            if self.best_of < self.n:
                raise ValueError(
                    f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
                )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int, got {self.seed!r}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature ~ 0)."""
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        """Greedy, seeded-random or unseeded-random; seeded rows need per-row RNG keys."""
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def has_penalties(self) -> bool:
        """True when any repetition/frequency/presence penalty would change logits."""
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    def all_stop_token_ids(self, eos_token_id: int | None) -> list[int]:
        """Token ids that end generation (and that ``min_tokens`` must suppress).

        EOS is included unless ``ignore_eos`` is set, matching vLLM's
        ``all_stop_token_ids``.
        """
        ids = list(self.stop_token_ids or [])
        if eos_token_id is not None and not self.ignore_eos and eos_token_id not in ids:
            ids.append(eos_token_id)
        return ids

    def clone(self) -> "SamplingParams":
        """Deep copy, so per-request mutation (e.g. derived seeds for n>1) never leaks."""
        return copy.deepcopy(self)
