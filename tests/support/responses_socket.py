"""WebSocket-mode helpers: a spec-valid ``response.create``, and receiving one
response's events with each validated against ``ResponsesServerEvent`` /
``ResponseWsError``."""

from __future__ import annotations

import copy
from typing import Any

import orjson
from aiohttp import ClientWebSocketResponse, WSMsgType

from sluice.http.projections.responses import TERMINAL_EVENTS
from tests.support.fake_engine import MODEL
from tests.support.openapi import validate
from tests.support.responses_spec import check_event, check_stream

WS = ClientWebSocketResponse


def create(input_text: str = "Hi", **fields: Any) -> dict[str, Any]:
    event = {"type": "response.create", "model": MODEL, "input": input_text,
             "max_output_tokens": 16, **fields}  # fmt: skip
    validate("ResponsesClientEventResponseCreate", event)
    return event


async def receive(ws: WS) -> dict[str, Any]:
    message = await ws.receive()
    assert message.type is WSMsgType.TEXT, message
    event: dict[str, Any] = orjson.loads(message.data)
    if event["type"] == "error":
        validate("ResponseWsError", event)
    else:
        validate("ResponsesServerEvent", _without_nulls(event))
        check_event(_plain(event))
    return event


def _plain(event: dict[str, Any]) -> dict[str, Any]:
    """The event as the SSE stream carries it (without the lane)."""
    return {k: v for k, v in event.items() if k != "stream_id"}


def _without_nulls(event: dict[str, Any]) -> dict[str, Any]:
    """As ``responses_spec`` does: ``user`` / ``usage`` may be null (see there)."""
    view = copy.deepcopy(event)
    response = view.get("response")
    if response is not None:
        for key in ("user", "usage"):
            if response.get(key) is None:
                response.pop(key, None)
    return view


async def one_response(ws: WS) -> list[dict[str, Any]]:
    """The events of one response, from ``response.created`` to its terminal event."""
    events = [await receive(ws)]
    assert events[0]["type"] == "response.created", events[0]
    while events[-1]["type"] not in TERMINAL_EVENTS:
        events.append(await receive(ws))
    check_stream([_plain(e) for e in events])
    return events


def final(events: list[dict[str, Any]]) -> dict[str, Any]:
    response: dict[str, Any] = events[-1]["response"]
    return response


async def error_of(ws: WS) -> dict[str, Any]:
    event = await receive(ws)
    assert event["type"] == "error", event
    return event
