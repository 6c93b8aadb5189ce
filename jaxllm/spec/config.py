"""`speculative_config`: vLLM's keys, validated into one frozen dataclass.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "path/to/small-model", "num_speculative_tokens": 4}
    {"method": "eagle3", "model": "path/to/eagle3-head", "num_speculative_tokens": 3}

Bad input raises ValueError naming the key (`speculative_config.<key>`). Checks that need
the models (a draft's vocabulary, a missing path) run when the engine loads the draft.
"""

from __future__ import annotations

import dataclasses
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MAX_SPEC_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: longest suffix n-gram looked up
    prompt_lookup_min: int | None = None  # ngram: shortest
    model: str | None = None  # draft_model / eagle: HF folder, GGUF file or converted folder

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPEC_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) > "
                                 f"prompt_lookup_max ({hi})")
        elif not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots kept past the verified tokens, for a draft that writes its own K/V."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(names)}")
        if "method" not in d:  # vLLM: a model alone means a draft model
            d["method"] = "draft_model" if d.get("model") else None
        if d["method"] is None:
            raise ValueError("speculative_config.method is required (one of "
                             f"{list(METHODS)})")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if d["method"] == "ngram":  # vLLM's defaults: each bound defaults to the other, else 5
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            d["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else 5)
            d["prompt_lookup_max"] = hi if hi is not None else d["prompt_lookup_min"]
        return cls(**d)


def as_spec_config(value: "SpeculativeConfig | dict | None") -> SpeculativeConfig | None:
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_dict(value)
