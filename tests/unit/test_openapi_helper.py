"""The OpenAPI test helper accepts what the spec allows and rejects what it does not."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.support.openapi import CACHE_DIR, load_spec, spec_path, validate, validator

pytestmark = pytest.mark.skipif(not spec_path().is_file(), reason="OpenAPI spec not available")


def completion() -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "Hello",
                "logprobs": None,
                "finish_reason": "length",
                "matched_stop": None,  # SGLang's extra field: the spec allows extras
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18},
    }


def model() -> dict[str, Any]:
    return {"id": "m", "object": "model", "created": 1_700_000_000, "owned_by": "sluice"}


def error_envelope() -> dict[str, Any]:
    return {
        "error": {
            "message": "temperature must be between 0 and 2, got 3",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }


def test_spec_is_cached_as_json_keyed_by_hash() -> None:
    spec = load_spec()
    assert spec["openapi"].startswith("3.1")
    assert list(CACHE_DIR.glob("openai-openapi-*.json"))


def test_valid_bodies_pass() -> None:
    validate("CreateCompletionResponse", completion())
    validate("Model", model())
    validate("ListModelsResponse", {"object": "list", "data": [model(), model()]})
    validate("ListModelsResponse", {"object": "list", "data": []})
    validate("ErrorResponse", error_envelope())


def test_completion_logprobs_object_passes() -> None:
    body = completion()
    body["choices"][0]["logprobs"] = {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hel": -0.5}, {"lo": -0.25}],
        "text_offset": [0, 3],
    }
    validate("CreateCompletionResponse", body)


def test_nullable_keyword_is_honoured() -> None:
    # The chat stream chunk marks finish_reason `nullable: true` next to an enum.
    chunk: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
    }
    validate("CreateChatCompletionStreamResponse", chunk)
    chunk["choices"][0]["finish_reason"] = "bogus"
    with pytest.raises(AssertionError, match="finish_reason"):
        validate("CreateChatCompletionStreamResponse", chunk)


def _without(body: dict[str, Any], *path: str | int) -> dict[str, Any]:
    body = copy.deepcopy(body)
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return body


def _with(body: dict[str, Any], value: object, *path: str | int) -> dict[str, Any]:
    body = copy.deepcopy(body)
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


@pytest.mark.parametrize(
    ("schema", "body", "fragment"),
    [
        ("CreateCompletionResponse", _without(completion(), "choices"), "'choices'"),
        (
            "CreateCompletionResponse",
            _with(completion(), "bogus", "choices", 0, "finish_reason"),
            "'bogus'",
        ),
        ("CreateCompletionResponse", _without(completion(), "choices", 0, "text"), "'text'"),
        ("CreateCompletionResponse", _with(completion(), "1", "created"), "$.created"),
        (
            "CreateCompletionResponse",
            _with(completion(), {"tokens": [1]}, "choices", 0, "logprobs"),
            "closest branch",
        ),
        ("Model", _without(model(), "owned_by"), "'owned_by'"),
        ("Model", _with(model(), "models", "object"), "'models'"),
        ("ListModelsResponse", {"object": "list"}, "'data'"),
        ("ListModelsResponse", {"object": "list", "data": [_without(model(), "id")]}, "$.data[0]"),
        ("ErrorResponse", {"message": "flat, SGLang-style"}, "'error'"),
        ("ErrorResponse", _without(error_envelope(), "error", "param"), "'param'"),
        ("ErrorResponse", _with(error_envelope(), 400, "error", "code"), "$.error.code"),
    ],
)
def test_invalid_bodies_fail_readably(schema: str, body: object, fragment: str) -> None:
    with pytest.raises(AssertionError) as raised:
        validate(schema, body)
    message = str(raised.value)
    assert f"components.schemas.{schema}" in message
    assert fragment in message


def test_all_errors_are_listed() -> None:
    body = _with(_without(completion(), "id"), "bogus", "choices", 0, "finish_reason")
    with pytest.raises(AssertionError, match=r"^2 error\(s\)"):
        validate("CreateCompletionResponse", body)


def test_validators_are_cached_and_unknown_names_fail() -> None:
    assert validator("Model") is validator("Model")
    with pytest.raises(KeyError, match="NoSuchSchema"):
        validator("NoSuchSchema")
