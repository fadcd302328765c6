"""Two real Node clients of ``/v1/responses`` against the shared test server
(``tests/node/responses.mjs``): the official OpenAI Node SDK (``responses.create``,
``responses.stream()`` whose accumulator throws on a broken event stream, retrieve,
delete) and the AI SDK's ``@ai-sdk/open-responses`` provider (``generateText``,
``streamText``). Their view of the same greedy request must be the Python SDK's.

Skipped when ``node`` is not installed or ``tests/node/node_modules`` is missing
(``make test`` runs ``npm ci`` there first, through ``make node``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.e2e_responses import FRANCE, FRANCE_ANSWER
from tests.support.node import PINNED, needs_node, run_script

if TYPE_CHECKING:
    from tests.conftest import Server

pytestmark = [pytest.mark.model, *needs_node("openai", "ai", "@ai-sdk/open-responses", "zod")]


@pytest.fixture(scope="module")
def results(server: Server) -> dict[str, Any]:
    return run_script("responses.mjs", server, "--tools")


@pytest.fixture(scope="module")
def python_answer(server: Server) -> str:
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        response = client.responses.create(
            model=server.model, input=FRANCE, temperature=0, max_output_tokens=24
        )
    return response.output_text


def test_pinned_sdk_version(results: dict[str, Any]) -> None:
    assert results["sdk_version"] == PINNED["openai"]


def test_node_sdk_create_retrieve_delete(results: dict[str, Any], python_answer: str) -> None:
    create = results["create"]
    assert create["output_text"] == python_answer == FRANCE_ANSWER
    assert create["id"].startswith("resp_") and create["status"] == "completed"
    assert create["items"] == ["message"]
    usage = create["usage"]
    assert usage["output_tokens"] == 8
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert create["retrieved_text"] == FRANCE_ANSWER
    assert create["after_delete"] == 404


def test_node_sdk_stream_helper(results: dict[str, Any]) -> None:
    stream = results["stream"]
    # finalResponse() returned: the accumulator accepted every event.
    assert stream["final_text"] == stream["delta_text"] == FRANCE_ANSWER
    assert stream["status"] == "completed"
    types = stream["types"]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_ai_sdk_generates_and_streams_text(results: dict[str, Any]) -> None:
    ai = results["ai_sdk"]
    assert ai["text"] == ai["stream_text"] == FRANCE_ANSWER
    assert ai["finish_reason"] == ai["stream_finish_reason"] == "stop"
    assert ai["usage"]["outputTokens"] == 8


def test_ai_sdk_makes_a_tool_call(results: dict[str, Any]) -> None:
    ai = results["ai_sdk"]
    assert ai["tool_finish_reason"] == "tool-calls"
    [call] = ai["tool_calls"][:1]
    assert call["name"] == "get_weather" and isinstance(call["input"]["city"], str)
    assert call["id"].startswith("call_")
