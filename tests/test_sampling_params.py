from __future__ import annotations

import dataclasses

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol.sampling_params import SamplingParams


def test_defaults_follow_openai_conventions() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        16,
        0,
        1.0,
        1.0,
        -1,
        0.0,
    )
    assert p.seed is None and p.logprobs is None
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not p.greedy and not p.has_penalties


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be between 0 and max_tokens (16), got -1"),
        ({"min_tokens": 17}, "min_tokens must be between 0 and max_tokens (16), got 17"),
        ({"temperature": -0.5}, "temperature must be at least 0, got -0.5"),
        ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be -1 (disabled), 0 (disabled) or positive, got -2"),
        ({"min_p": 1.5}, "min_p must be between 0.0 and 1.0, got 1.5"),
        ({"min_p": -0.1}, "min_p must be between 0.0 and 1.0, got -0.1"),
        ({"logprobs": 21}, "logprobs must be between 0 and 20, got 21"),
        ({"logprobs": -1}, "logprobs must be between 0 and 20, got -1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than 0, got 0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be between -2.0 and 2.0, got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be between -2.0 and 2.0, got -3.0"),
        ({"stop": ["ok", ""]}, "stop strings must not be empty"),
        ({"stop": ""}, "stop strings must not be empty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative, got -1"),
        (
            {"seed": 2**64},
            "seed must be between -9223372036854775808 and 18446744073709551615, "
            "got 18446744073709551616",
        ),
    ],
)
def test_out_of_range_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    (param,) = kwargs
    assert exc.value.param == param
    assert exc.value.message == message
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": "1"}, "temperature must be a number, got str"),
        ({"top_p": True}, "top_p must be a number, got bool"),
        ({"max_tokens": True}, "max_tokens must be an integer, got bool"),
        ({"max_tokens": 16.0}, "max_tokens must be an integer, got float"),
        ({"top_k": "5"}, "top_k must be an integer, got str"),
        ({"seed": 1.5}, "seed must be an integer, got float"),
        ({"logprobs": False}, "logprobs must be an integer, got bool"),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean, got int"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be a boolean, got str"),
        ({"stop": 5}, "stop must be a string or a list of strings, got int"),
        ({"stop": ["a", 5]}, "stop must be a string or a list of strings, got an item of type int"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers, got int"),
        (
            {"stop_token_ids": [1, True]},
            "stop_token_ids must be a list of integers, got an item of type bool",
        ),
    ],
)
def test_wrong_types_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    (param,) = kwargs
    assert (exc.value.param, exc.value.message) == (param, message)


def test_invalid_request_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=-3)


def test_lists_become_tuples_and_single_stop_string_is_accepted() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop="###").stop == ("###",)  # type: ignore[arg-type]
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4)))


def test_int_values_for_float_fields_are_stored_as_float() -> None:
    p = SamplingParams(temperature=0, top_p=1, repetition_penalty=2)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert isinstance(p.top_p, float) and isinstance(p.repetition_penalty, float)
    assert p.greedy


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        max_tokens=1,
        min_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        logprobs=20,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        seed=-(2**63),
    )
    assert p.logprobs == 20 and p.has_penalties
    assert SamplingParams(logprobs=0, seed=2**64 - 1).logprobs == 0


def test_is_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_from_dict_builds_and_refuses_unknown_fields() -> None:
    p = SamplingParams.from_dict({"max_tokens": 5, "temperature": 0, "stop": ["\n"]})
    assert p == SamplingParams(max_tokens=5, temperature=0.0, stop=("\n",))
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.from_dict({"max_tokens": 5, "foo": 1})
    assert (exc.value.param, exc.value.message) == ("foo", "unknown sampling parameter 'foo'")


def test_from_dict_treats_null_as_not_given() -> None:
    p = SamplingParams.from_dict({"temperature": None, "stop": None, "seed": None})
    assert p == SamplingParams()


def test_from_dict_validates_values() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.from_dict({"top_p": 0})
    assert exc.value.param == "top_p"


def test_with_max_tokens_replaces_and_revalidates() -> None:
    p = SamplingParams(max_tokens=100, min_tokens=10, temperature=0.5, stop=("x",))
    q = p.with_max_tokens(50)
    assert q == dataclasses.replace(p, max_tokens=50)
    assert p.max_tokens == 100
    # min_tokens cannot exceed the new cap.
    assert p.with_max_tokens(4).min_tokens == 4
    with pytest.raises(InvalidRequestError) as exc:
        p.with_max_tokens(0)
    assert exc.value.param == "max_tokens"


def test_has_penalties() -> None:
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert not SamplingParams(temperature=0.0).has_penalties
