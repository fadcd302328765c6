"""WebSocket mode end to end: the pinned ``openai`` SDK's ``responses.connect()`` (and a
raw ``websockets`` client) against the shared test server and the real default model.
Greedy outputs are exact and the same as over HTTP (``test_e2e_responses``): the
socket carries the same pipeline's events."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import openai
import pytest
from websockets.sync.client import connect

from sluice.http.projections.responses import TERMINAL_EVENTS
from tests.support.e2e_responses import (
    FRANCE,
    FRANCE_ANSWER,
    ITALY,
    ITALY_FOLLOW_UP,
    sdk_turn,
)
from tests.support.openapi import validate

if TYPE_CHECKING:
    from tests.conftest import Server

pytestmark = pytest.mark.model


def test_sdk_connection_continues_a_store_false_response(client: openai.OpenAI, model: str) -> None:
    with client.responses.connect() as connection:
        kinds, first = sdk_turn(connection, model=model, input=FRANCE, temperature=0, store=False)
        assert first.output_text == FRANCE_ANSWER and first.status == "completed"
        assert kinds[0] == "response.created" and kinds.count("response.output_text.delta") >= 7
        # Only the new input: the connection remembers the unstored first turn.
        _, second = sdk_turn(
            connection, model=model, input=ITALY, previous_response_id=first.id,
            temperature=0, max_output_tokens=24, store=False,
        )  # fmt: skip
        assert second.output_text == ITALY_FOLLOW_UP
        assert second.previous_response_id == first.id
    # Never stored: HTTP cannot continue it.
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=model, input=ITALY, previous_response_id=first.id)
    assert missing.value.code == "previous_response_not_found"


def _events_until_terminal(ws: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in (*TERMINAL_EVENTS, "error"):
        events.append(json.loads(ws.recv(timeout=300)))
    return events


def test_reconnect_forgets_unstored_responses(server: Server, model: str) -> None:
    url = server.base_url.replace("http://", "ws://") + "/v1/responses"
    turn = {"type": "response.create", "model": model, "input": FRANCE, "temperature": 0,
            "store": False, "stream_id": "main"}  # fmt: skip
    with connect(url) as ws:
        ws.send(json.dumps(turn))
        events = _events_until_terminal(ws)
        assert {e["stream_id"] for e in events} == {"main"}
        first = events[-1]["response"]
        assert first["output"][0]["content"][0]["text"] == FRANCE_ANSWER
    with connect(url) as ws:
        ws.send(json.dumps({**turn, "input": ITALY, "previous_response_id": first["id"]}))
        (error,) = _events_until_terminal(ws)
        validate("ResponseWsError", error)
        assert error["status"] == 404 and error["stream_id"] == "main"
        assert error["error"]["code"] == "previous_response_not_found"
        ws.send(json.dumps(turn))  # a clean new response still works
        assert _events_until_terminal(ws)[-1]["response"]["status"] == "completed"
