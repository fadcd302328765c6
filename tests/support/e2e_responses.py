"""The greedy conversations the end-to-end Responses tests share, and one turn over
the SDK's WebSocket connection."""

from __future__ import annotations

from typing import Any

from sluice.http.projections.responses import TERMINAL_EVENTS

FRANCE = "What is the capital of France?"


FRANCE_ANSWER = "The capital of France is Paris."  # greedy: 7 tokens, then EOS


ITALY = "And of Italy?"


ITALY_FOLLOW_UP = "The capital of Italy is Rome."  # greedy, after FRANCE_ANSWER


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
