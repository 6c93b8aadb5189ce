"""StructuredOutputsParams validation and up-front grammar compilation (no model, no JAX)."""

from __future__ import annotations

import pytest

from jaxllm.models.loader import embedded_model_path
from jaxllm.models.tokenizer import Tokenizer
from jaxllm.sampling_params import SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams as S
from jaxllm.structured import compiler_for, validate


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(embedded_model_path())


@pytest.mark.parametrize("kwargs", [{}, {"choice": []}, {"regex": "a", "json": {}},
                                    {"json_object": True, "choice": ["a"]}, {"regex": ""},
                                    {"regex": "a", "reasoning_end_ids": []}])
def test_exactly_one_kind(kwargs) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        S(**kwargs)


def test_kind_and_key() -> None:
    assert S(json={"b": 1, "a": 2}).kind == "json"
    assert S(json={"b": 1, "a": 2}).key() == S(json={"a": 2, "b": 1}).key()
    assert S(regex="a+").key() != S(regex="a*").key()
    assert S(regex="a", reasoning_end_ids=[5]).key() == S(regex="a").key()
    assert SamplingParams(structured_outputs=S(choice=["x"])).structured_outputs.choice == ["x"]
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


@pytest.mark.parametrize("params", [
    S(json={"type": "object", "properties": {"a": {"type": "integer"}}}), S(json='{"type": "string"}'),
    S(regex="[a-z]{1,5}"), S(choice=["yes", "no"]), S(grammar='start: "a" | "b"'),
    S(grammar='root ::= "x" | "y"'), S(json_object=True),
    S(structural_tag='{"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}],'
                     ' "triggers": ["<f="]}'),
])
def test_valid_constraints_compile(tok, params) -> None:
    validate(params, tok)


@pytest.mark.parametrize(("params", "reason"), [
    (S(json={"type": "foo"}), "Invalid type"), (S(json="{bad"), "JSON"),
    (S(regex="a[b"), "unclosed character class"), (S(grammar="start: foo"), "unknown name"),
    (S(structural_tag="{}"), "structures"),
    # malformed structural tags are ValueErrors (a 400), never the lowering's KeyError / TypeError /
    # AssertionError (a 500)
    (S(structural_tag='{"structures": [{"end": "</a>"}], "triggers": ["<a"]}'), "begin"),
    (S(structural_tag='{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'), "end"),
    (S(structural_tag='{"structures": [], "triggers": ["<a"]}'), "structures must be a non-empty list"),
    (S(structural_tag='{"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": [1]}'), "triggers"),
    (S(structural_tag='{"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": "<a"}'), "triggers"),
    (S(structural_tag='{"structures": [{"begin": "<a>", "end": "</a>", "schema": []}], "triggers": ["<a"]}'),
     "schema"),
])
def test_invalid_constraints_give_the_reason(tok, params, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        validate(params, tok)


def test_grammar_size_limits(tok) -> None:
    with pytest.raises(ValueError, match="character limit"):
        validate(S(choice=[f"option number {i} with some words" for i in range(40_000)]), tok)
    # Deeply nested rules: compiled on a large-stack thread (a default stack would segfault).
    n = 6000
    nested = "start: a0\n" + "".join(f'a{i}: "x" a{i + 1} | "y"\n' for i in range(n)) + f'a{n}: "z"\n'
    validate(S(grammar=nested), tok)


def test_compile_is_cached(tok) -> None:
    compiler = compiler_for(tok)
    first = compiler.submit(S(regex="[0-9]{3}"))
    assert compiler.submit(S(regex="[0-9]{3}")) is first
    assert first.result() is compiler.compile_now(S(regex="[0-9]{3}"))
