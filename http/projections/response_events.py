"""The Responses stream's event and item shapes, one builder each (OpenAI's
``ResponseStreamEvent`` members, keys in the order OpenAI sends them). The projection
adds ``sequence_number`` as it emits each."""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]
Item = dict[str, Any]


# -------------------------------------------------------------------------- items


def message_item(item_id: str) -> Item:
    return {
        "id": item_id,
        "type": "message",
        "status": "in_progress",
        "content": [],
        "role": "assistant",
    }


def reasoning_item(item_id: str) -> Item:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [],
        "status": "in_progress",
    }


def function_call_item(item_id: str, call_id: str, name: str) -> Item:
    return {
        "id": item_id,
        "type": "function_call",
        "status": "in_progress",
        "arguments": "",
        "call_id": call_id,
        "name": name,
    }


def output_text_part() -> Item:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}


def reasoning_text_part() -> Item:
    return {"type": "reasoning_text", "text": ""}


# ------------------------------------------------------------------------- events


def lifecycle(kind: str, response: dict[str, Any]) -> Event:
    """``response.created`` / ``.queued`` / ``.in_progress`` / a terminal event."""
    return {"type": kind, "response": response}


def output_item_added(output_index: int, item: Item) -> Event:
    return {"type": "response.output_item.added", "output_index": output_index, "item": item}


def output_item_done(output_index: int, item: Item) -> Event:
    return {"type": "response.output_item.done", "output_index": output_index, "item": item}


def content_part_added(item_id: str, output_index: int, part: Item) -> Event:
    return {
        "type": "response.content_part.added",
        "item_id": item_id,
        "output_index": output_index,
        "content_index": 0,
        "part": part,
    }


def content_part_done(item_id: str, output_index: int, part: Item) -> Event:
    return {
        "type": "response.content_part.done",
        "item_id": item_id,
        "output_index": output_index,
        "content_index": 0,
        "part": part,
    }


def output_text_delta(
    item_id: str, output_index: int, delta: str, logprobs: list[dict[str, Any]]
) -> Event:
    return {
        "type": "response.output_text.delta",
        "item_id": item_id,
        "output_index": output_index,
        "content_index": 0,
        "delta": delta,
        "logprobs": logprobs,
    }


def output_text_done(
    item_id: str, output_index: int, text: str, logprobs: list[dict[str, Any]]
) -> Event:
    return {
        "type": "response.output_text.done",
        "item_id": item_id,
        "output_index": output_index,
        "content_index": 0,
        "text": text,
        "logprobs": logprobs,
    }


def reasoning_text_delta(item_id: str, output_index: int, delta: str) -> Event:
    return {
        "type": "response.reasoning_text.delta",
        "item_id": item_id,
        "output_index": output_index,
        "content_index": 0,
        "delta": delta,
    }


def reasoning_text_done(item_id: str, output_index: int, text: str) -> Event:
    return {
        "type": "response.reasoning_text.done",
        "item_id": item_id,
        "output_index": output_index,
        "content_index": 0,
        "text": text,
    }


def function_call_arguments_delta(item_id: str, output_index: int, delta: str) -> Event:
    return {
        "type": "response.function_call_arguments.delta",
        "item_id": item_id,
        "output_index": output_index,
        "delta": delta,
    }


def function_call_arguments_done(
    item_id: str, output_index: int, name: str, arguments: str
) -> Event:
    return {
        "type": "response.function_call_arguments.done",
        "item_id": item_id,
        "output_index": output_index,
        "name": name,
        "arguments": arguments,
    }


def error(code: str, message: str, param: str | None) -> Event:
    return {"type": "error", "code": code, "message": message, "param": param}
