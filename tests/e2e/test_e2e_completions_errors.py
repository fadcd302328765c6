"""Completions errors end to end: what the pinned ``openai`` SDK sees for an unknown model,
out-of-range values, empty prompts, context overflows, refused fields, malformed JSON
and unknown routes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.e2e_completions import bad_request, http
from tests.support.greedy_pins import PARIS
from tests.support.openapi import validate

if TYPE_CHECKING:
    from tests.conftest import Server

pytestmark = pytest.mark.model


# ------------------------------------------------------------------------- errors


def test_unknown_model(client: openai.OpenAI) -> None:
    error = bad_request(client, model="no-such-model", prompt=PARIS, max_tokens=1)
    assert "The model `no-such-model` does not exist" in error.message
    assert error.code == "model_not_found"
    assert error.param == "model"


def test_temperature_out_of_range(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt=PARIS, max_tokens=1, temperature=5)
    assert error.param == "temperature"
    assert "temperature" in error.body["message"]  # type: ignore[index]


@pytest.mark.parametrize("prompt", ["", [], [[]]], ids=["string", "list", "id-list"])
def test_empty_prompt(client: openai.OpenAI, model: str, prompt: Any) -> None:
    error = bad_request(client, model=model, prompt=prompt, max_tokens=1)
    assert error.param == "prompt"
    assert "empty" in error.body["message"]  # type: ignore[index]


def test_prompt_plus_max_tokens_beyond_the_context(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt="hello " * 8000, max_tokens=500)
    message: str = error.body["message"]  # type: ignore[index]
    assert error.code == "context_length_exceeded"
    for count in ("8192", "8501", "8001", "500"):  # context, total, prompt, max_tokens
        assert count in message


def test_prompt_alone_beyond_the_context(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt="hello " * 9000, max_tokens=1)
    message: str = error.body["message"]  # type: ignore[index]
    assert error.param == "prompt"
    assert "9001 tokens" in message and "8192" in message


def test_suffix_is_refused(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt=PARIS, suffix="!", max_tokens=1)
    assert error.param == "suffix"


def test_errors_before_a_stream_are_plain_http_errors(client: openai.OpenAI, model: str) -> None:
    # The SDK raises from create() itself: the server answered with a JSON error, not SSE.
    error = bad_request(client, model="no-such-model", prompt=PARIS, stream=True)
    assert error.response.headers["content-type"].startswith("application/json")
    error = bad_request(client, model=model, prompt=PARIS, temperature=5, stream=True)
    assert error.param == "temperature"


def test_malformed_json(server: Server) -> None:
    response = http("POST", f"{server.v1}/completions", b'{"model": "x", "prompt": ')
    assert response.status == 400
    assert response.content_type.startswith("application/json")
    validate("ErrorResponse", response.body)
    assert response.body["error"]["type"] == "invalid_request_error"
    assert "JSON" in response.body["error"]["message"]


def test_unknown_route(server: Server) -> None:
    response = http("GET", f"{server.v1}/no-such-route")
    assert response.status == 404
    validate("ErrorResponse", response.body)
    assert "/v1/no-such-route" in response.body["error"]["message"]
