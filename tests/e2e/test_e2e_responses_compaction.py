"""Compaction end to end: the pinned ``openai`` SDK's ``responses.compact`` against the
shared test server and the real default model, and the compacted output given back as
input over HTTP and over the SDK's WebSocket connection. Greedy outputs are exact."""

from __future__ import annotations

import base64
import json
from typing import Any

import openai
import pytest

from tests.support.e2e_responses import FRANCE, FRANCE_ANSWER, ITALY, sdk_turn
from tests.support.openapi import validate

pytestmark = pytest.mark.model

# What the 135M model makes of the France exchange (greedy, fp32), and its next turn.
SUMMARY = (
    "The conversation was a great example of how a chatbot can be used to facilitate "
    "communication, but it could be made even more effective by using a chatbot to "
    "facilitate the conversation."
)
RESUMED = (
    "The conversation was a great example of how a chatbot can be used to facilitate "
    "communication, but it could be made even"
)


def summary_of(encrypted_content: str) -> Any:
    """The sealed payload (signed, not encrypted: see ``compaction_item``)."""
    payload = encrypted_content.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_compact_then_resume_over_http_and_websocket(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input=FRANCE, temperature=0)
    assert first.output_text == FRANCE_ANSWER
    raw = client.responses.with_raw_response.compact(model=model, previous_response_id=first.id)
    body = raw.http_response.json()
    validate("CompactResource", body)
    assert body["object"] == "response.compaction"
    kept, item = body["output"]
    assert (kept["role"], kept["content"][0]["text"]) == ("user", FRANCE)
    assert item["type"] == "compaction"
    assert summary_of(item["encrypted_content"]) == {"model": model, "summary": SUMMARY}
    assert body["usage"]["output_tokens"] > 0

    resume = [*body["output"], {"role": "user", "content": ITALY}]
    resumed = client.responses.create(model=model, input=resume, temperature=0,
                                      max_output_tokens=24)  # fmt: skip
    assert resumed.output_text == RESUMED
    with client.responses.connect() as connection:
        _, over_ws = sdk_turn(connection, model=model, input=resume, temperature=0,
                              max_output_tokens=24, store=False)  # fmt: skip
    assert over_ws.output_text == RESUMED

    tampered = {**item, "encrypted_content": item["encrypted_content"][:-4] + "AAAA"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input=[kept, tampered, resume[-1]])
    assert refused.value.code == "invalid_encrypted_content"
