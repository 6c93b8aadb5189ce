"""The llguidance backend (Earley parser, numpy bitmasks, no torch): the one vLLM and SGLang use."""

from __future__ import annotations

import json
import os

import llguidance as llg
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured.backend import Backend, Grammar, Matcher

# Grammar size cap (symbols in productions): llguidance's default is 500k; a request schema
# that needs more is rejected at validation rather than slowing every step.
MAX_GRAMMAR_SIZE = 200_000


def _lark_of_structural_tag(text: str) -> str:
    """vLLM's structural tag JSON -> a Lark grammar (llguidance's ``StructTag`` lowering).

    The shape is ``{"structures": [{"begin": str, "schema": {...}, "end": str}, ...],
    "triggers": [str, ...]}``. Anything else is a ValueError saying what is wrong, never the
    KeyError, TypeError or AssertionError the lowering would raise (the server's up-front check
    turns only ValueError into a 400; the others were 500s).
    """
    where = "structured_outputs.structural_tag"
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(spec, dict) or "structures" not in spec or "triggers" not in spec:
        raise ValueError(f'{where} must be an object {{"structures": [...], "triggers": [...]}}')
    structures, triggers = spec["structures"], spec["triggers"]
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{where}.structures must be a non-empty list")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f'{where}.structures[{i}] must be an object with "begin" and "end" strings')
        schema = s.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.structures[{i}].schema must be a JSON schema object")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"{where}: no trigger is a prefix of {s['begin']!r}")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return llg.StructTag.to_grammar(tags)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar definition of a constraint (not yet checked)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {exc}") from exc
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(params.choice))
    if kind == "grammar":
        try:
            return llg.grammar_from("grammar", params.grammar)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.grammar is not valid: {exc}") from exc
    return llg.LLMatcher.grammar_from_lark(_lark_of_structural_tag(params.structural_tag))


class LLGuidanceMatcher(Matcher):
    def __init__(self, inner: llg.LLMatcher):
        self.inner = inner

    def accept(self, token: int) -> bool:
        return self.inner.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.inner.rollback(num_tokens)

    def reset(self) -> None:
        self.inner.reset()

    def is_terminated(self) -> bool:
        return self.inner.is_stopped()

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def error(self) -> str:
        return self.inner.get_error()


class LLGuidanceGrammar(Grammar):
    def __init__(self, template: llg.LLMatcher):
        self.template = template  # never advanced; matchers are deep copies of it

    def matcher(self) -> Matcher:
        return LLGuidanceMatcher(self.template.deep_copy())


class LLGuidanceBackend(Backend):
    name = "guidance"

    def __init__(self, backend_tokenizer_json: str, eos_ids: list[int], vocab_size: int):
        self.tokenizer = llg.LLTokenizer(backend_tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids or None)
        self.vocab_size = self.tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.limits = llg.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE)
        # Mask threads: a few, not all cores (the step loop and the dispatch thread need theirs).
        self.executor = llg.LLExecutor(num_threads=max(2, min(8, (os.cpu_count() or 2) // 2)))
        self._scratch = np.zeros((0, self.words), np.int32)

    @classmethod
    def for_tokenizer(cls, tokenizer, eos_ids: tuple[int, ...] = ()) -> "LLGuidanceBackend":
        """From a ``jaxllm.models.tokenizer.Tokenizer`` (its Rust ``tokenizers`` backend)."""
        ids = sorted(set(eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
        return cls(tokenizer.backend.to_str(), ids, tokenizer.vocab_size)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        text = grammar_text(params)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer, limits=self.limits)
        if is_error:
            raise ValueError(f"invalid structured_outputs.{params.kind}: {messages[0]}")
        template = llg.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if template.is_error():
            raise ValueError(f"invalid structured_outputs.{params.kind}: {template.get_error()}")
        return LLGuidanceGrammar(template)

    def fill_bitmask(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Masks are computed in parallel (the GIL is dropped) into an exact-width scratch array,
        then copied into ``bitmask``, whose extra words (model padding ids) stay as they are."""
        if not matchers:
            return
        n = len(matchers)
        if self._scratch.shape[0] < n:
            self._scratch = np.zeros((max(n, 2 * self._scratch.shape[0]), self.words), np.int32)
        scratch = self._scratch[:n]
        fill_next_token_bitmask_par(self.executor, [(m.inner, i) for i, (m, _) in enumerate(matchers)], scratch)
        rows = np.fromiter((r for _, r in matchers), np.int64, n)
        w = min(self.words, bitmask.shape[1])  # a model vocab smaller than the tokenizer's drops ids
        bitmask[rows, :w] = scratch[:, :w]

    def bitmask_job(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray):
        """When the mask is exactly the tokenizer's width, the rows are computed in place by one
        call that drops the GIL (no scratch copy, no Python after it); else ``fill_bitmask``."""
        if not matchers or bitmask.shape[1] != self.words or not bitmask.flags["C_CONTIGUOUS"]:
            return super().bitmask_job(matchers, bitmask)
        pairs = [(m.inner, row) for m, row in matchers]
        return lambda: fill_next_token_bitmask_par(self.executor, pairs, bitmask)
