"""End-to-end chat helpers: requests through the SDK with every body and chunk checked
against the spec, a choice's streamed parts, and error details."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.openapi import validate

Body = dict[str, Any]


Message = ChatCompletionMessageParam


def user(text: str) -> list[Message]:
    return [{"role": "user", "content": text}]


def check_body(body: Body) -> Body:
    validate("CreateChatCompletionResponse", body)
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert "system_fingerprint" not in body  # SGLang's Python server sends none
    for choice in body["choices"]:
        message = choice["message"]
        assert message["role"] == "assistant"
        assert message["refusal"] is None
        assert message["reasoning_content"] is None  # the key is there, null: no reasoning
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    return body


def check_chunk(chunk: Body) -> Body:
    validate("CreateChatCompletionStreamResponse", chunk)
    assert chunk["object"] == "chat.completion.chunk"
    return chunk


def chat(client: openai.OpenAI, **params: Any) -> Body:
    """A unary chat completion as the exact JSON the server sent, validated."""
    raw = client.chat.completions.with_raw_response.create(**params)
    assert raw.headers["content-type"].startswith("application/json")
    return check_body(json.loads(raw.text))


def chat_stream(client: openai.OpenAI, **params: Any) -> list[Body]:
    """A streamed chat completion as the exact chunks the server sent, each validated.

    Checks the framing too: data-only SSE events, the same ``chatcmpl-`` id and
    ``created`` on every chunk, terminated by ``data: [DONE]``.
    """
    with client.chat.completions.with_streaming_response.create(stream=True, **params) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line and not line.startswith(":")]
    data = [line for line in lines if line.startswith("data: ")]
    assert data == lines, lines  # no event:/id: fields
    assert data[-1] == "data: [DONE]"
    assert data.count("data: [DONE]") == 1
    chunks = [check_chunk(json.loads(line[len("data: ") :])) for line in data[:-1]]
    assert chunks
    assert {(c["id"], c["created"]) for c in chunks} == {(chunks[0]["id"], chunks[0]["created"])}
    assert chunks[0]["id"].startswith("chatcmpl-")
    return chunks


def choice_parts(chunks: Sequence[Body], index: int = 0) -> list[Body]:
    return [part for chunk in chunks for part in chunk["choices"] if part["index"] == index]


def bad_request(client: openai.OpenAI, **params: Any) -> openai.BadRequestError:
    """The SDK's exception for a request the server must refuse with 400."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**params)
    error = raised.value
    assert error.status_code == 400
    assert error.response.headers["content-type"].startswith("application/json")
    assert isinstance(error.body, dict)  # the SDK unwraps the {"error": {...}} envelope
    validate("Error", error.body)
    assert error.body["type"] == "invalid_request_error"
    return error


def error_message(error: openai.BadRequestError) -> str:
    assert isinstance(error.body, dict)
    message: str = error.body["message"]
    return message
