"""SamplingParams: vLLM defaults, normalisation and per-field validation."""

from __future__ import annotations

import pytest

from jaxllm.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.detokenize and p.skip_special_tokens
    assert p.spaces_between_special_tokens and not p.include_stop_str_in_output
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_values_raise_naming_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    message = str(exc.value)
    assert field in message
    assert str(list(kwargs.values())[-1]) in message or field == "seed"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"min_p": 1.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 16},
        {"logprobs": 0},
        {"logprobs": 20},
        {"prompt_logprobs": 0},
        {"seed": -5},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"temperature": 0.0},
        {"n": 2, "best_of": 3},
    ],
)
def test_valid_edge_values_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_greedy_and_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).is_greedy  # tiny temperatures are greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY


def test_stop_ids_include_eos_unless_ignored() -> None:
    assert SamplingParams(stop_token_ids=[5]).all_stop_token_ids(2) == [5, 2]
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids(2) == [5]
    assert SamplingParams().all_stop_token_ids(None) == []


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=4)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
