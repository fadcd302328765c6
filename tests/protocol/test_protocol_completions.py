"""Parsing ``POST /v1/completions`` bodies: what is refused (and why), what is normalised."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine.params import SamplingParams
from sluice.http.errors import ApiError
from sluice.http.protocol.completions import CompletionRequest, parse_completion_request

DROP = object()  # an override value that removes the key from the base body


def body(**overrides: object) -> dict[str, object]:
    result: dict[str, object] = {"model": "m", "prompt": "Hello"}
    for key, value in overrides.items():
        if value is DROP:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def parse(**overrides: object) -> CompletionRequest:
    return parse_completion_request(body(**overrides))


def refusal(raw: object) -> ApiError:
    with pytest.raises(ApiError) as raised:
        parse_completion_request(raw)
    assert raised.value.status == 400
    assert raised.value.type == "invalid_request_error"
    return raised.value


# ----------------------------------------------------------------------------- refusals

BAD: list[tuple[dict[str, Any], str, str]] = [
    # (overrides, param, a fragment of the message)
    ({"model": DROP}, "model", "Missing required parameter: 'model'"),
    ({"model": None}, "model", "Missing required parameter"),
    ({"model": 3}, "model", "'model' must be a string, got integer"),
    ({"prompt": DROP}, "prompt", "Missing required parameter: 'prompt'"),
    ({"prompt": ""}, "prompt", "Prompt cannot be empty"),
    ({"prompt": []}, "prompt", "Prompt cannot be empty"),
    ({"prompt": ["", ""]}, "prompt", "Prompt cannot be empty"),
    ({"prompt": ["a", ""]}, "prompt", "Prompt cannot be empty"),
    ({"prompt": [[1], []]}, "prompt", "Prompt cannot be empty"),
    ({"prompt": ["a", 1]}, "prompt", "token ids must be integers, got string"),
    ({"prompt": [1, [2]]}, "prompt", "token ids must be integers, got array"),
    ({"prompt": [[1, 2], 3]}, "prompt", "token ids must be integers, got array"),
    ({"prompt": [[1, "a"]]}, "prompt", "token ids must be integers, got string"),
    ({"prompt": [1, True]}, "prompt", "got boolean"),
    ({"prompt": [1.0]}, "prompt", "got number"),
    ({"prompt": [-1]}, "prompt", "token ids must be at least 0, got -1"),
    ({"prompt": 5}, "prompt", "'prompt' must be a string, an array of strings"),
    ({"prompt": {"text": "x"}}, "prompt", "got object"),
    ({"suffix": "tail"}, "suffix", "suffix is not supported by this model"),
    ({"suffix": 1}, "suffix", "'suffix' must be a string"),
    ({"max_tokens": True}, "max_tokens", "'max_tokens' must be an integer, got boolean"),
    ({"max_tokens": 16.5}, "max_tokens", "'max_tokens' must be an integer, got number"),
    ({"max_tokens": "16"}, "max_tokens", "got string"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens must be at least 0, got -1"),
    ({"max_tokens": 0}, "max_tokens", "unless echo is true"),
    ({"temperature": 3}, "temperature", "temperature must be between 0 and 2, got 3"),
    ({"temperature": -0.5}, "temperature", "between 0 and 2, got -0.5"),
    ({"temperature": "1"}, "temperature", "'temperature' must be a number, got string"),
    ({"temperature": True}, "temperature", "got boolean"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"temperature": 10**400}, "temperature", "between 0 and 2"),
    ({"top_p": 0}, "top_p", "top_p must be greater than 0 and at most 1, got 0"),
    ({"top_p": 1.5}, "top_p", "at most 1"),
    ({"n": 0}, "n", "n must be between 1 and 128, got 0"),
    ({"n": 129}, "n", "between 1 and 128"),
    ({"n": 1.5}, "n", "must be an integer"),
    ({"best_of": 0}, "best_of", "between 1 and 20"),
    ({"best_of": 21}, "best_of", "between 1 and 20"),
    ({"best_of": 1, "n": 2}, "best_of", "best_of must be at least n (2), got 1"),
    ({"best_of": 3, "stream": True}, "best_of", "best_of cannot be used with stream"),
    ({"stream": "yes"}, "stream", "'stream' must be a boolean, got string"),
    ({"stream": 1}, "stream", "got integer"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"stream": True, "stream_options": []}, "stream_options", "must be an object"),
    (
        {"stream": True, "stream_options": {"include_usage": "true"}},
        "stream_options.include_usage",
        "'stream_options.include_usage' must be a boolean",
    ),
    (
        {"stream": True, "stream_options": {"include_obfuscation": True}},
        "stream_options.include_obfuscation",
        "not supported",
    ),
    (
        {"stream": True, "stream_options": {"chunk_size": 1}},
        "stream_options.chunk_size",
        "Unrecognized request argument supplied: stream_options.chunk_size",
    ),
    ({"logprobs": True}, "logprobs", "'logprobs' must be an integer, got boolean"),
    ({"logprobs": 6}, "logprobs", "logprobs must be between 0 and 5, got 6"),
    ({"logprobs": -1}, "logprobs", "between 0 and 5"),
    ({"echo": "true"}, "echo", "must be a boolean"),
    ({"stop": 1}, "stop", "'stop' must be a string or an array of strings, got integer"),
    ({"stop": ["a", 1]}, "stop", "a string or an array of strings"),
    ({"stop": []}, "stop", "between 1 and 4 entries, got 0"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "got 5"),
    ({"stop": ""}, "stop", "must not be empty"),
    ({"stop": ["a", ""]}, "stop", "must not be empty"),
    ({"presence_penalty": 2.5}, "presence_penalty", "between -2 and 2, got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty", "between -2 and 2, got -3"),
    ({"logit_bias": [1]}, "logit_bias", "'logit_bias' must be an object, got array"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "got '-1'"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {" 1": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"١": 1}}, "logit_bias", "keys must be token ids"),  # Arabic-Indic 1
    ({"logit_bias": {"1" * 11: 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100, got 101 for token 5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "got '1' for token 5"),
    ({"logit_bias": {"5": True}}, "logit_bias", "between -100 and 100"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias", "between -100 and 100"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024 entries"),
    ({"seed": 2**63}, "seed", "seed must be between"),
    ({"seed": -(2**63) - 1}, "seed", "seed must be between"),
    ({"seed": 1.5}, "seed", "must be an integer"),
    ({"user": 7}, "user", "'user' must be a string"),
    ({"top_k": 0}, "top_k", "top_k must be -1 (disabled) or at least 1, got 0"),
    # Whole-number floats past 32 bits: the engine's tensors cannot hold them.
    ({"top_k": 1e19}, "top_k", "top_k must be between -2147483648 and 2147483647, got 1"),
    ({"min_tokens": 2**31}, "min_tokens", "min_tokens must be at most 2147483647"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids", "stop_token_ids must be at most 2147483647"),
    ({"top_k": -2}, "top_k", "got -2"),
    ({"top_k": 1.5}, "top_k", "must be an integer"),
    ({"min_p": 1.5}, "min_p", "min_p must be between 0 and 1, got 1.5"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0 and at most 2, got 0"),
    ({"repetition_penalty": 2.5}, "repetition_penalty", "at most 2"),
    ({"min_tokens": -1}, "min_tokens", "at least 0"),
    ({"min_tokens": 17}, "min_tokens", "min_tokens must be at most max_tokens (16), got 17"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "max_tokens (4)"),
    ({"stop_token_ids": 2}, "stop_token_ids", "must be an array of integers, got integer"),
    ({"stop_token_ids": [2, "3"]}, "stop_token_ids", "must be an integer, got string"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "at least 0, got -1"),
    ({"ignore_eos": 0}, "ignore_eos", "must be a boolean"),
    ({"no_stop_trim": "no"}, "no_stop_trim", "must be a boolean"),
    ({"skip_special_tokens": 1}, "skip_special_tokens", "must be a boolean"),
    (
        {"spaces_between_special_tokens": False},
        "spaces_between_special_tokens",
        "spaces_between_special_tokens=false is not supported",
    ),
    ({"regex": "a("}, "regex", "Invalid regex"),
    ({"regex": 1}, "regex", "'regex' must be a string"),
    ({"ebnf": "root ::= 'a'"}, "ebnf", "Invalid EBNF grammar"),
    ({"json_schema": '{"type": "objec"}'}, "json_schema", "Invalid JSON schema"),
    ({"json_schema": {"type": "object"}}, "json_schema", "'json_schema' must be a string"),
    ({"stop_regex": ["a+"]}, "stop_regex", "stop_regex is not supported yet"),
    ({"stop_regex": 1}, "stop_regex", "a string or an array of strings"),
    ({"return_token_ids": True}, "return_token_ids", "Unrecognized request argument supplied"),
    ({"messages": []}, "messages", "Unrecognized request argument supplied: messages"),
]


@pytest.mark.parametrize(
    ("overrides", "param", "fragment"), BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)]
)
def test_bad_fields_are_refused_naming_the_param(
    overrides: dict[str, Any], param: str, fragment: str
) -> None:
    error = refusal(body(**overrides))
    assert error.param == param
    assert fragment in error.message


@pytest.mark.parametrize("raw", [[], "text", 1, None, True])
def test_the_body_must_be_an_object(raw: object) -> None:
    error = refusal(raw)
    assert error.param is None
    assert "must be a JSON object" in error.message


def test_the_first_unknown_field_is_reported() -> None:
    error = refusal(body(zeta=1, alpha=2))
    assert error.message == "Unrecognized request argument supplied: zeta"


def test_errors_serialise_to_the_openai_envelope() -> None:
    assert refusal(body(temperature=3)).body() == {
        "error": {
            "message": "temperature must be between 0 and 2, got 3",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }


def test_long_values_are_not_echoed_in_full() -> None:
    error = refusal(body(logit_bias={"x" * 10_000: 1}))
    assert len(error.message) < 200


# ------------------------------------------------------------------------ normalisation


def test_defaults() -> None:
    request = parse()
    assert request == CompletionRequest(model="m", prompts=("Hello",), sampling=SamplingParams())
    assert request.sampling.max_tokens == 16
    assert request.skip_special_tokens is True
    assert request.sampling.constraint is None


def test_nulls_mean_defaults() -> None:
    nulls = dict.fromkeys(
        [
            "suffix", "max_tokens", "temperature", "top_p", "n", "best_of", "stream",
            "stream_options", "logprobs", "echo", "stop", "presence_penalty",
            "frequency_penalty", "logit_bias", "seed", "user", "top_k", "min_p",
            "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "no_stop_trim",
            "skip_special_tokens", "spaces_between_special_tokens", "regex", "ebnf",
            "json_schema", "stop_regex",
        ]
    )  # fmt: skip
    assert parse(**nulls) == parse()


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("Hi", ("Hi",)),
        (["Hi", "there"], ("Hi", "there")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1, 2], [3]], ((1, 2), (3,))),
        ([0], ((0,),)),
    ],
)
def test_prompt_shapes(prompt: object, prompts: tuple[object, ...]) -> None:
    assert parse(prompt=prompt).prompts == prompts


@pytest.mark.parametrize(
    ("temperature", "expected"), [(0, 0.0), (1e-7, 0.0), (1e-6, 1e-6), (2, 2.0)]
)
def test_tiny_temperatures_are_greedy(temperature: float, expected: float) -> None:
    sampling = parse(temperature=temperature).sampling
    assert sampling.temperature == expected
    assert isinstance(sampling.temperature, float)
    assert sampling.greedy is (expected == 0.0)


def test_every_field_reaches_the_request() -> None:
    request = parse(
        prompt=["a", "b"],
        suffix="",
        max_tokens=32,
        temperature=0.5,
        top_p=0.9,
        n=2,
        best_of=3,
        logprobs=0,
        echo=False,
        stop="\n",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"50": 100, "07": -100.0, "3": 0.5},
        seed=-(2**63),
        user="u",
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=4,
        stop_token_ids=[2, 2, 7],
        ignore_eos=True,
        no_stop_trim=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=True,
    )
    assert request == CompletionRequest(
        model="m",
        prompts=("a", "b"),
        sampling=SamplingParams(
            max_tokens=32,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logit_bias=((3, 0.5), (7, -100.0), (50, 100.0)),
            seed=-(2**63),
            min_tokens=4,
            stop_token_ids=frozenset({2, 7}),
            ignore_eos=True,
            logprobs=0,
        ),
        n=2,
        best_of=3,
        logprobs=0,
        stop=("\n",),
        no_stop_trim=True,
        skip_special_tokens=False,
        user="u",
    )


def test_stream_options() -> None:
    request = parse(
        stream=True,
        stream_options={
            "include_usage": True,
            "continuous_usage_stats": True,
            "include_obfuscation": False,
        },
    )
    assert (request.stream, request.include_usage, request.continuous_usage_stats) == (
        True,
        True,
        True,
    )
    assert parse(stream=True, stream_options={}).include_usage is False
    assert parse(stream=False, stream_options=None).stream is False


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    request = parse(echo=True, logprobs=3, max_tokens=0)
    assert request.echo is True
    assert request.logprobs == 3
    assert (request.sampling.logprobs, request.sampling.prompt_logprobs) == (3, 3)
    assert request.sampling.max_tokens == 0
    assert parse(echo=True).sampling.prompt_logprobs is None
    assert parse(logprobs=3).sampling.prompt_logprobs is None


@pytest.mark.parametrize(("n", "best_of"), [(1, 1), (3, 3)])
def test_best_of_equal_to_n_is_dropped_even_when_streaming(n: int, best_of: int) -> None:
    request = parse(n=n, best_of=best_of, stream=True)
    assert (request.n, request.best_of) == (n, None)


def test_max_tokens_may_exceed_min_tokens_and_large_ints_pass() -> None:
    request = parse(max_tokens=100_000, min_tokens=100_000, stop_token_ids=[], seed=2**63 - 1)
    assert request.sampling.min_tokens == 100_000
    assert request.sampling.stop_token_ids == frozenset()
    assert request.sampling.seed == 2**63 - 1


def test_the_request_is_frozen() -> None:
    request = parse()
    with pytest.raises(AttributeError):
        request.n = 2  # type: ignore[misc]


def test_integral_floats_count_as_integers() -> None:
    """As SGLang's validation does: ``2.0`` is 2, ``2.5`` is refused (above)."""
    req = parse(n=2.0, max_tokens=8.0, seed=3.0)
    assert (req.n, req.sampling.max_tokens, req.sampling.seed) == (2, 8, 3)
    assert isinstance(req.n, int)
