"""Chat request bodies for protocol tests: messages, tool calls and tools, and parsing
one body the way the route does."""

from __future__ import annotations

from sluice.http.protocol.chat import ChatRequest, parse_chat_request

DROP = object()  # an override value that removes the key from the base body


USER = {"role": "user", "content": "Hi"}


ASSISTANT = {"role": "assistant", "content": "Hello"}


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def body(**overrides: object) -> dict[str, object]:
    result: dict[str, object] = {"model": "m", "messages": [USER]}
    for key, value in overrides.items():
        if value is DROP:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def parse(**overrides: object) -> ChatRequest:
    return parse_chat_request(body(**overrides))


def tool(**changes: object) -> dict[str, object]:
    """A function tool ``f`` with ``changes`` applied to its function object."""
    function: dict[str, object] = {"name": "f", "parameters": {"type": "object"}, **changes}
    return {"type": "function", "function": function}
