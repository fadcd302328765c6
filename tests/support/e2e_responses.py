"""The greedy conversations the end-to-end Responses tests share, and one turn over
the SDK's WebSocket connection."""

from __future__ import annotations

from typing import Any

from sluice.http.projections.responses import TERMINAL_EVENTS
from tests.support.greedy_pins import FRANCE_ANSWER, ITALY, ITALY_FOLLOW_UP
from tests.support.greedy_pins import FRANCE_QUESTION as FRANCE

__all__ = ["FRANCE", "FRANCE_ANSWER", "ITALY", "ITALY_FOLLOW_UP", "sdk_turn"]


def sdk_turn(connection: Any, **params: Any) -> tuple[list[str], Any]:
    """One response over the SDK's connection: its event types and final response."""
    connection.response.create(**params)
    kinds: list[str] = []
    for event in connection:
        kinds.append(event.type)
        if event.type == "error":
            raise AssertionError(event)
        if event.type in TERMINAL_EVENTS:
            return kinds, event.response
    raise AssertionError(f"the socket closed after {kinds}")
