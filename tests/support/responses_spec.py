"""Checking ``/v1/responses`` bodies and stream events against OpenAI's published spec.

One substitution, documented here: the Open Responses schema requires every echoed
configuration field and ``usage``, and allows ``null`` for them; OpenAI's spec types
``user`` as a plain string and ``usage`` as an object (OpenAI itself sends
``usage: null`` until a response ends). A ``null`` there is dropped before validating
(the key's presence is asserted instead).
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

from tests.support.openapi import validate


def _spec_view(response: dict[str, Any]) -> dict[str, Any]:
    view = copy.deepcopy(response)
    assert "user" in view, "the Response must echo user (null when unset)"
    for key in ("user", "usage"):
        if view[key] is None:
            del view[key]
    return view


def check_response(body: dict[str, Any]) -> dict[str, Any]:
    validate("Response", _spec_view(body))
    assert body["object"] == "response" and body["id"].startswith("resp_")
    for key in (
        "status", "background", "completed_at", "error", "incomplete_details", "instructions",
        "max_output_tokens", "max_tool_calls", "model", "output", "parallel_tool_calls",
        "previous_response_id", "reasoning", "service_tier", "store", "temperature", "text",
        "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "usage", "user",
        "metadata", "presence_penalty", "frequency_penalty", "safety_identifier",
        "prompt_cache_key",
    ):  # fmt: skip
        assert key in body, f"Response lacks {key}"
    return body


def check_event(event: dict[str, Any]) -> dict[str, Any]:
    view = copy.deepcopy(event)
    if "response" in view:
        check_response(view["response"])
        view["response"] = _spec_view(view["response"])
    validate("ResponseStreamEvent", view)
    return event


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """Every frame is ``event: <type>`` + ``data: <json>``, the names agree, no ``[DONE]``."""
    events = []
    for chunk in raw.split(b"\n\n"):
        if not chunk:
            continue
        head, _, data = chunk.partition(b"\n")
        assert head.startswith(b"event: ") and data.startswith(b"data: "), chunk[:200]
        event = orjson.loads(data[len(b"data: ") :])
        assert event["type"] == head[len(b"event: ") :].decode()
        events.append(event)
    return events


def check_stream(events: list[dict[str, Any]]) -> None:
    """Spec-valid events numbered from 0, ``response.created`` first, and the SDK
    helpers' invariants: append-only indexes, matching item ids, unique ids."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    items: list[dict[str, Any]] = []
    parts: dict[int, int] = {}
    ids: set[str] = set()
    call_ids: set[str] = set()
    for event in events:
        check_event(event)
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == len(items)
            item = event["item"]
            assert item["id"] and item["id"] not in ids
            ids.add(item["id"])
            if item["type"] == "function_call":
                assert item["arguments"] == ""
                assert item["call_id"] and item["call_id"] not in call_ids
                call_ids.add(item["call_id"])
            items.append(item)
            parts[event["output_index"]] = 0
        elif kind == "response.content_part.added":
            assert event["content_index"] == parts[event["output_index"]]
            parts[event["output_index"]] += 1
        elif kind == "response.output_item.done":
            added = items[event["output_index"]]
            done = event["item"]
            assert (done["type"], done["id"], done.get("call_id")) == (
                added["type"], added["id"], added.get("call_id"),
            )  # fmt: skip
        if "item_id" in event:
            item = items[event["output_index"]]
            assert event["item_id"] == item["id"]
            family = kind.split(".")[1]
            expected = {"output_text": "message", "function_call_arguments": "function_call",
                        "reasoning_text": "reasoning"}.get(family)  # fmt: skip
            if expected is not None:
                assert item["type"] == expected, (kind, item["type"])
