"""Responses input items: read and checked into their stored shape, and a
conversation of them turned into the chat template's messages."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from sluice.http.errors import ApiError
from sluice.http.protocol.fields import Fields, show, type_error

Item = dict[str, Any]
MAX_INPUT_ITEMS = 2048
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_ONLY = "the model takes text only"


# ---------------------------------------------------------------------------- input


def read_input(fields: Fields, *, required: bool = True) -> tuple[Item, ...]:
    """``input``: a string (one user message) or input items; absent reads as none when
    not ``required``."""
    value = fields.take("input")
    if value is None:
        if not required:
            return ()
        raise fields.error("input", "Missing required parameter: 'input'.")
    if isinstance(value, str):
        return (_message("user", [_text_part("input_text", value)]),)
    if not isinstance(value, list):
        raise type_error("input", "a string or an array of input items", value)
    if not value:
        raise fields.error("input", "input cannot be an empty array")
    if len(value) > MAX_INPUT_ITEMS:
        raise fields.error(
            "input", f"input must have at most {MAX_INPUT_ITEMS} items, got {len(value)}"
        )
    return tuple(read_item(item, f"input[{i}]") for i, item in enumerate(value))


def _text_part(kind: str, text: str) -> Item:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}


def _message(role: str, content: list[Item], item_id: str | None = None) -> Item:
    item: Item = {"type": "message", "role": role, "content": content, "status": "completed"}
    if item_id is not None:
        item["id"] = item_id
    return item


def read_item(value: object, param: str) -> Item:
    """One input item in its stored shape (``id`` only when the client gave one)."""
    if not isinstance(value, dict):
        raise type_error(param, "an object", value)
    item = Fields(value, param)
    kind = item.string("type")
    if kind is None:
        kind = "message" if "role" in value else "item_reference"
    reader = _ITEM_READERS.get(kind)
    if reader is None:
        if kind in ("input_image", "input_file", "input_audio"):
            raise item.error("type", f"{kind} is not supported: {_TEXT_ONLY}")
        raise item.error("type", f"input items of type {show(kind)} are not supported")
    result = reader(item)
    item.finish()
    return result


def _read_message_item(item: Fields) -> Item:
    role = item.required_string("role")
    if role not in MESSAGE_ROLES:
        raise item.error(
            "role", f"{item.param('role')} must be one of {', '.join(MESSAGE_ROLES)}, got "
            f"{show(role)}"
        )  # fmt: skip
    item_id = item.string("id")
    item.string("status")
    item.take("phase")  # commentary/final_answer: a label, the text is what the model reads
    content = item.take("content")
    part_kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return _message(role, [_text_part(part_kind, content)], item_id)
    if not isinstance(content, list):
        raise type_error(item.param("content"), "a string or an array of content parts", content)
    parts: list[Item] = []
    for index, raw in enumerate(content):
        param = f"{item.param('content')}[{index}]"
        if not isinstance(raw, dict):
            raise type_error(param, "an object", raw)
        part = Fields(raw, param)
        kind = part.required_string("type")
        if kind in ("input_text", "output_text"):
            text = part.required_string("text")
            if kind == "output_text" and role != "assistant":
                raise part.error("type", "output_text parts are only allowed in assistant messages")
            part.take("annotations")
            part.take("logprobs")
            parts.append(_text_part(part_kind, text))
        elif kind == "refusal" and role == "assistant":
            parts.append({"type": "refusal", "refusal": part.required_string("refusal")})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise part.error("type", f"{kind} is not supported: {_TEXT_ONLY}")
        else:
            raise part.error("type", f"content parts of type {show(kind)} are not supported")
        part.finish()
    return _message(role, parts, item_id)


def _read_function_call(item: Fields) -> Item:
    result: Item = {"type": "function_call"}
    item_id = item.string("id")
    if item_id is not None:
        result["id"] = item_id
    result["call_id"] = item.required_string("call_id")
    result["name"] = item.required_string("name")
    arguments = item.required_string("arguments")
    parse_arguments(arguments, item.param("arguments"))
    result["arguments"] = arguments
    item.string("status")
    item.string("namespace")
    result["status"] = "completed"
    return result


def parse_arguments(arguments: str, param: str) -> dict[str, Any]:
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError.bad_request(f"'{param}' must be a JSON object string", param)
    return parsed


def _read_function_call_output(item: Fields) -> Item:
    result: Item = {"type": "function_call_output"}
    item_id = item.string("id")
    if item_id is not None:
        result["id"] = item_id
    result["call_id"] = item.required_string("call_id")
    output = item.take("output")
    if isinstance(output, list):
        texts = []
        for index, raw in enumerate(output):
            param = f"{item.param('output')}[{index}]"
            if not isinstance(raw, dict):
                raise type_error(param, "an object", raw)
            part = Fields(raw, param)
            kind = part.required_string("type")
            if kind != "input_text":
                raise part.error("type", f"{kind} is not supported: {_TEXT_ONLY}")
            texts.append(part.required_string("text"))
            part.finish()
        output = "".join(texts)
    if not isinstance(output, str):
        raise type_error(item.param("output"), "a string or an array of input_text parts", output)
    result["output"] = output
    item.string("status")
    result["status"] = "completed"
    return result


def _read_reasoning_item(item: Fields) -> Item:
    result: Item = {"type": "reasoning"}
    item_id = item.string("id")
    if item_id is not None:
        result["id"] = item_id
    if item.string("encrypted_content") is not None:
        raise item.error("encrypted_content", "encrypted reasoning content is not supported")
    result["summary"] = _typed_texts(item, "summary", "summary_text")
    content = _typed_texts(item, "content", "reasoning_text")
    if content:
        result["content"] = content
    item.string("status")
    result["status"] = "completed"
    return result


def _typed_texts(item: Fields, name: str, kind: str) -> list[Item]:
    value = item.take(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise type_error(item.param(name), f"an array of {kind} parts", value)
    parts = []
    for index, raw in enumerate(value):
        param = f"{item.param(name)}[{index}]"
        if not isinstance(raw, dict):
            raise type_error(param, "an object", raw)
        part = Fields(raw, param)
        if part.required_string("type") != kind:
            raise part.error("type", f"{param}.type must be {kind!r}")
        parts.append({"type": kind, "text": part.required_string("text")})
        part.finish()
    return parts


def _read_item_reference(item: Fields) -> Item:
    return {"type": "item_reference", "id": item.required_string("id")}


def _read_compaction_item(item: Fields) -> Item:
    """A compaction item given back: checked against the server's key by the route
    (``routes.responses.compaction_item``), which can tell a tampered one."""
    result: Item = {"type": "compaction"}
    item_id = item.string("id")
    if item_id is not None:
        result["id"] = item_id
    result["encrypted_content"] = item.required_string("encrypted_content")
    item.string("created_by")  # ours carry none; one echoed back is harmless
    return result


_ITEM_READERS: dict[str, Callable[[Fields], Item]] = {
    "message": _read_message_item,
    "function_call": _read_function_call,
    "function_call_output": _read_function_call_output,
    "reasoning": _read_reasoning_item,
    "item_reference": _read_item_reference,
    "compaction": _read_compaction_item,
}


# ------------------------------------------------------------- tool outputs


def check_tool_outputs(conversation: Sequence[Item]) -> None:
    """Every ``function_call_output`` answers a ``function_call`` before it in the
    conversation (the previous response's or the same input's), as OpenAI requires; a
    ``compaction`` item may have sealed the call, so outputs after one are taken."""
    calls: set[str] = set()
    for item in conversation:
        kind = item["type"]
        if kind == "function_call":
            calls.add(item["call_id"])
        elif kind == "compaction":
            return
        elif kind == "function_call_output" and item["call_id"] not in calls:
            raise ApiError.bad_request(
                f"No tool call found for function call output with call_id {item['call_id'][:64]}.",
                "input",
            )


# ------------------------------------------------------------- items → chat messages


def _text_of(parts: Sequence[Item]) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in parts)


def to_chat_messages(
    items: Sequence[Item], summaries: Mapping[str, str] | None = None
) -> list[dict[str, object]]:
    """The conversation as the chat template's messages.

    ``developer`` reads ``system``; ``function_call`` items join the assistant message
    they follow (or start one) as ``tool_calls`` with parsed arguments;
    ``function_call_output`` is a ``tool`` message; ``reasoning`` becomes the next
    assistant message's ``reasoning_content``; a ``compaction`` item is the assistant
    message of its summary (``summaries``: by ``encrypted_content``, as the route
    unsealed them).
    """
    messages: list[dict[str, object]] = []
    reasoning: list[str] = []

    def assistant() -> dict[str, object]:
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and not reasoning:
            return last
        message: dict[str, object] = {"role": "assistant", "content": ""}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        messages.append(message)
        return message

    for item in items:
        kind = item["type"]
        if kind == "message":
            role = item["role"]
            text = _text_of(item["content"])
            if role == "assistant":
                message = assistant()
                if message.get("tool_calls"):  # text after a call: a new turn
                    message = {"role": "assistant", "content": ""}
                    messages.append(message)
                message["content"] = str(message["content"]) + text
            else:
                messages.append({"role": "system" if role == "developer" else role,
                                 "content": text})  # fmt: skip
        elif kind == "function_call":
            message = assistant()
            calls = message.setdefault("tool_calls", [])
            assert isinstance(calls, list)
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item)},
                }
            )
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text_of(parts)
            if text:
                reasoning.append(text)
        elif kind == "compaction":
            summary = (summaries or {})[item["encrypted_content"]]
            messages.append({"role": "assistant", "content": summary})
    return messages


def _arguments(item: Item) -> object:
    """A call's arguments as a mapping for the template. Input items were checked to
    be a JSON object; a stored call cut short by ``max_output_tokens`` may not be one,
    and goes back as the text the model wrote."""
    try:
        parsed = orjson.loads(item["arguments"])
    except orjson.JSONDecodeError:
        return item["arguments"]
    return parsed if isinstance(parsed, dict) else item["arguments"]


def item_text(item: Mapping[str, Any]) -> str:
    """The readable text of an item (traces)."""
    kind = item.get("type")
    if kind == "message":
        return _text_of(item.get("content") or [])
    if kind == "function_call":
        return f"{item.get('name')}({item.get('arguments')})"
    if kind == "function_call_output":
        return str(item.get("output"))
    return _text_of(item.get("content") or item.get("summary") or [])
