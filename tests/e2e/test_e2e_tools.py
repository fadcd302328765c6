"""Tool calling end to end with the real default model and the official ``openai`` SDK.

SmolLM2's chat template has no tool support, so the server describes the tools and the
generic JSON call format in a system message and, for ``required`` / named / strict
tools, the grammar forces the calls: whatever the small model would rather say, the
output is a call to an allowed function with schema-valid arguments. These are SGLang's
function-calling test ideas (required, named, strict streamed arguments that join into
valid JSON, n=2 streaming with one finish per choice, ``none`` producing no calls).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import orjson
import pytest
from pydantic import BaseModel

from tests.support.openapi import validate

pytestmark = pytest.mark.model

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}


def tool(name: str, *, strict: bool = False) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": {"get_weather": "Current weather", "add": "Add two integers"}[name],
            "parameters": SCHEMAS[name],
            "strict": strict,
        },
    }


TOOLS = [tool("get_weather"), tool("add")]
WEATHER_Q = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ADD_Q = [{"role": "user", "content": "What is 5 plus 7? Use the add function."}]
SHORT = 48  # tokens: enough for one compact call


def valid_calls(calls: list[Any], allowed: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, checked: an allowed function, arguments a JSON
    object valid against its schema, a ``call_`` id."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    return out


def test_required_returns_valid_calls(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(
        model=model,
        messages=WEATHER_Q,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_completion_tokens=SHORT * 2,
        temperature=0,
    )
    validate("CreateChatCompletionResponse", orjson.loads(completion.to_json()))
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = valid_calls(choice.message.tool_calls or [], {"get_weather", "add"})
    # Greedy, so exact: read off the server once.
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert choice.message.content == ""


def test_named_tool_is_the_call(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(
        model=model,
        messages=ADD_Q,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_completion_tokens=SHORT,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = valid_calls(choice.message.tool_calls or [], {"get_weather"})
    # The question is about adding, so the forced weather call is a poor one; what
    # matters is that it is one, and valid.
    assert calls == [("get_weather", {"city": "", "unit": "celsius"})]


def test_parallel_calls_off_gives_exactly_one_call(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(
        model=model,
        messages=ADD_Q,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_completion_tokens=SHORT,
        temperature=0,
    )
    calls = completion.choices[0].message.tool_calls or []
    assert len(valid_calls(calls, {"get_weather", "add"})) == 1


def test_strict_streamed_arguments_join_into_valid_json(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=ADD_Q,  # type: ignore[arg-type]
        tools=[tool("add", strict=True)],  # type: ignore[arg-type]
        tool_choice="required",
        max_completion_tokens=SHORT,
        temperature=0,
        stream=True,
    )
    arguments: dict[int, str] = {}
    names: dict[int, str] = {}
    finishes = []
    for chunk in stream:
        validate("CreateChatCompletionStreamResponse", orjson.loads(chunk.to_json()))
        for choice in chunk.choices:
            for entry in choice.delta.tool_calls or []:
                if entry.id is not None:
                    assert entry.index not in names and entry.function is not None
                    names[entry.index] = entry.function.name or ""
                    assert entry.function.arguments == ""
                else:
                    assert entry.function is not None and entry.function.name is None
                arguments[entry.index] = arguments.get(entry.index, "") + (
                    entry.function.arguments or ""
                )
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"]
    assert names and set(names.values()) == {"add"}
    for text in arguments.values():
        jsonschema.validate(json.loads(text), ADD_PARAMS)


def test_n2_streaming_gives_each_choice_one_tool_calls_finish(
    client: openai.OpenAI, model: str
) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=WEATHER_Q,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        n=2,
        max_completion_tokens=SHORT,
        temperature=0.8,
        seed=7,
        stream=True,
    )
    finishes: dict[int, list[str]] = {0: [], 1: []}
    calls: dict[int, int] = {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            calls[choice.index] += sum(1 for e in choice.delta.tool_calls or [] if e.id)
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert finishes == {0: ["tool_calls"], 1: ["tool_calls"]}
    assert calls[0] >= 1 and calls[1] >= 1


def test_strict_tools_under_auto_let_the_model_answer_in_text(
    client: openai.OpenAI, model: str
) -> None:
    completion = client.chat.completions.create(
        model=model,
        messages=ADD_Q,  # type: ignore[arg-type]
        tools=[tool("add", strict=True)],  # type: ignore[arg-type]
        max_completion_tokens=SHORT,
        temperature=0,
    )
    choice = completion.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == ("5 + 7 = 12", None)
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_produces_no_calls(
    client: openai.OpenAI, model: str, stream: bool
) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": WEATHER_Q,
        "tools": TOOLS,
        "tool_choice": "none",
        "max_completion_tokens": 16,
        "temperature": 0,
    }
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length") and choice.message.content
        return
    finishes = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")


class AddArgs(BaseModel):
    a: int
    b: int


def test_sdk_stream_helper_accumulates_and_parses_calls(client: openai.OpenAI, model: str) -> None:
    add = openai.pydantic_function_tool(AddArgs, name="add", description="Add two integers")
    with client.chat.completions.stream(
        model=model,
        messages=ADD_Q,  # type: ignore[arg-type]
        tools=[add],
        tool_choice="required",
        max_completion_tokens=SHORT,
        temperature=0,
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "add" for c in calls)
    assert all(isinstance(c.function.parsed_arguments, AddArgs) for c in calls)
    assert [e.name for e in done] == ["add"] * len(calls)
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_tool_result_leads_to_an_answer(client: openai.OpenAI, model: str) -> None:
    """The call history (an assistant call, the tool's result) goes back through the
    template; ``auto`` then lets the model answer in text."""
    first = client.chat.completions.create(
        model=model,
        messages=ADD_Q,  # type: ignore[arg-type]
        tools=[tool("add")],  # type: ignore[arg-type]
        tool_choice="required",
        max_completion_tokens=SHORT,
        temperature=0,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history: list[Any] = [
        *ADD_Q,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12"},
    ]
    second = client.chat.completions.create(
        model=model,
        messages=history,
        tools=[tool("add")],  # type: ignore[arg-type]
        max_completion_tokens=24,
        temperature=0,
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_tool_validation_errors_use_sglang_messages(client: openai.OpenAI, model: str) -> None:
    cases = [
        ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "Tool 'nope' not found in tools list.",
        ),
        (
            {"tools": [{"type": "custom", "custom": {"name": "grep"}}]},
            "is not supported: only 'function' tools",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=model, messages=WEATHER_Q, **extra)  # type: ignore[arg-type]
        assert message in str(raised.value)
