"""The official OpenAI Node SDK against the shared test server (``tests/node/smoke.mjs``).

The Node SDK's ``ChatCompletionStream`` is stricter than the Python one: its
``finalChatCompletion()`` throws when a choice never got a ``role`` or a
``finish_reason``. The script prints one JSON line of what it saw; this test checks it
against the Python SDK's view of the same greedy requests.

Skipped when ``node`` is not installed or ``tests/node/node_modules`` is missing
(``make test`` runs ``npm ci`` there first, through ``make node``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.greedy_pins import FRANCE_ANSWER, PARIS_8
from tests.support.node import PINNED as PINNED_PACKAGES
from tests.support.node import needs_node, run_script

if TYPE_CHECKING:
    from tests.conftest import Server

# Checked before any fixture runs, so a skip never starts the model server.
pytestmark = [pytest.mark.model, *needs_node("openai")]
PINNED = PINNED_PACKAGES["openai"]

# The same greedy requests as smoke.mjs makes, and their exact answers.
FRANCE: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
FRANCE_COMPLETION_TOKENS = 8


@pytest.fixture(scope="module")
def results(server: Server) -> dict[str, Any]:
    return run_script("smoke.mjs", server)


@pytest.fixture(scope="module")
def python_answer(server: Server) -> str:
    """What the Python SDK gets for the same greedy chat request."""
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        completion = client.chat.completions.create(
            model=server.model, messages=FRANCE, temperature=0, max_completion_tokens=24
        )
    content = completion.choices[0].message.content
    assert content is not None
    return content


def test_pinned_sdk_version(results: dict[str, Any]) -> None:
    assert results["sdk_version"] == PINNED


def test_chat_unary_matches_the_python_sdk(results: dict[str, Any], python_answer: str) -> None:
    chat = results["chat"]
    assert chat["content"] == python_answer == FRANCE_ANSWER
    assert chat["id"].startswith("chatcmpl-")
    assert (chat["object"], chat["choices"], chat["role"]) == ("chat.completion", 1, "assistant")
    assert chat["refusal"] is None
    assert chat["finish_reason"] == "stop"
    usage = chat["usage"]
    assert usage["completion_tokens"] == FRANCE_COMPLETION_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_stream_helper_final_completion(results: dict[str, Any], python_answer: str) -> None:
    stream = results["stream"]
    final = stream["final"]
    # finalChatCompletion() returned, so no choice lacked its role or finish_reason.
    assert [c["index"] for c in final["choices"]] == [0, 1]
    for choice in final["choices"]:
        assert choice["role"] == "assistant"
        assert choice["content"] == python_answer
        assert choice["finish_reason"] == "stop"
    assert final["id"] == results["stream"]["ids"][0]
    assert final["usage"]["completion_tokens"] == 2 * FRANCE_COMPLETION_TOKENS
    assert final["usage"]["prompt_tokens"] == results["chat"]["usage"]["prompt_tokens"]


def test_stream_chunks_as_the_node_sdk_saw_them(
    results: dict[str, Any], python_answer: str
) -> None:
    stream = results["stream"]
    assert len(stream["ids"]) == 1 and stream["ids"][0].startswith("chatcmpl-")
    assert stream["role_chunks"] == [1, 1]  # role exactly once per choice
    assert stream["finish_chunks"] == [1, 1]  # exactly one finish_reason per choice
    assert stream["usage_chunks"] == 1  # include_usage: one choices-less usage chunk
    assert stream["delta_text"] == [python_answer, python_answer]
    assert stream["chunks"] > 4  # really streamed, token by token
    # The helper's 'content' events (both choices interleaved) end on a full answer.
    assert stream["content_events"] >= 2
    assert stream["last_content_snapshot"] == python_answer


def test_completions_and_models(results: dict[str, Any], server: Server) -> None:
    completion = results["completion"]
    assert completion["object"] == "text_completion"
    assert completion["text"] == PARIS_8
    assert completion["finish_reason"] == "length"
    assert (completion["usage"]["prompt_tokens"], completion["usage"]["completion_tokens"]) == (
        5,
        8,
    )
    assert results["models"] == [server.model]
