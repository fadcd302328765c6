"""End-to-end completions helpers: requests through the SDK with every body and chunk
checked against the spec, streamed text, and a server metric."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.openapi import validate

if TYPE_CHECKING:
    from tests.conftest import Server

Body = dict[str, Any]


def spec_view(body: Body, *, streamed: bool = False, echo: bool = False) -> Body:
    """``body`` with exactly two documented deviations from the shared schema replaced.

    The spec's ``CreateCompletionResponse`` is shared by the unary body and the stream
    chunks, yet it allows neither of these, which OpenAI itself sends:

    * ``streamed``: a chunk's ``finish_reason`` is ``null`` until the choice's last
      chunk. Only ``null`` is replaced (by the placeholder ``"length"``); a real value is
      validated as sent.
    * ``echo``: the first token of the echoed prompt has no conditional probability,
      so its ``token_logprobs`` and ``top_logprobs`` entries are ``null`` (OpenAI's
      documented behaviour). Only position 0 of a logprobs object whose text offset is
      0 (the start of the echoed text) is replaced (by ``0.0`` and ``{}``).

    Nothing else is touched: every other field is validated exactly as the server sent it.
    """
    view = copy.deepcopy(body)
    for choice in view.get("choices", []):
        if streamed and choice.get("finish_reason", "absent") is None:
            choice["finish_reason"] = "length"
        logprobs = choice.get("logprobs")
        if echo and logprobs and logprobs.get("text_offset", [])[:1] == [0]:
            if logprobs["token_logprobs"][:1] == [None]:
                logprobs["token_logprobs"][0] = 0.0
            if logprobs["top_logprobs"][:1] == [None]:
                logprobs["top_logprobs"][0] = {}
    return view


def check_body(body: Body, *, echo: bool = False) -> Body:
    validate("CreateCompletionResponse", spec_view(body, echo=echo))
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    return body


def check_chunk(chunk: Body, *, echo: bool = False) -> Body:
    validate("CreateCompletionResponse", spec_view(chunk, streamed=True, echo=echo))
    assert chunk["object"] == "text_completion"
    return chunk


def complete(client: openai.OpenAI, **params: Any) -> Body:
    """A unary completion as the exact JSON the server sent, validated."""
    raw = client.completions.with_raw_response.create(**params)
    assert raw.headers["content-type"].startswith("application/json")
    return check_body(json.loads(raw.text), echo=bool(params.get("echo")))


def stream(client: openai.OpenAI, **params: Any) -> list[Body]:
    """A streamed completion as the exact chunks the server sent, each validated.

    Checks the framing too: data-only SSE events, every chunk with the same id and
    ``created``, terminated by ``data: [DONE]``.
    """
    chunks: list[Body] = []
    with client.completions.with_streaming_response.create(stream=True, **params) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line and not line.startswith(":")]
    # Data-only: no ``event:``/``id:`` fields (comment lines, e.g. keep-alives, are fine).
    data = [line for line in lines if line.startswith("data: ")]
    assert data == lines, lines
    assert data[-1] == "data: [DONE]"
    for line in data[:-1]:
        chunks.append(check_chunk(json.loads(line[len("data: ") :]), echo=bool(params.get("echo"))))
    assert chunks
    assert {(c["id"], c["created"]) for c in chunks} == {(chunks[0]["id"], chunks[0]["created"])}
    return chunks


def choice_chunks(chunks: list[Body], index: int = 0) -> list[Body]:
    return [part for chunk in chunks for part in chunk["choices"] if part["index"] == index]


def streamed_text(chunks: list[Body], index: int = 0) -> str:
    return "".join(part["text"] for part in choice_chunks(chunks, index))


def engine_metric(server: Server, name: str) -> float:
    """One sample from ``/metrics`` (Prometheus text)."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics:\n{text}")


@dataclass(frozen=True)
class RawResponse:
    status: int
    content_type: str
    body: Any


def http(method: str, url: str, data: bytes | None = None) -> RawResponse:
    """A plain HTTP request with no SDK in between: status, content type, decoded JSON."""
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw, status, headers = response.read(), response.status, response.headers
    except urllib.error.HTTPError as error:
        raw, status, headers = error.read(), error.code, error.headers
    return RawResponse(status, headers["Content-Type"] or "", json.loads(raw))


def bad_request(client: openai.OpenAI, **params: Any) -> openai.BadRequestError:
    """The SDK's exception for a request the server must refuse with 400."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**params)
    error = raised.value
    assert error.status_code == 400
    assert isinstance(error.body, dict)  # the SDK unwraps the {"error": {...}} envelope
    validate("Error", error.body)
    assert error.body["type"] == "invalid_request_error"
    return error
