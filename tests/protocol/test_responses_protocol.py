"""``parse_responses_request`` and the items → chat messages conversion, no server:
every body either validates or is a 400 naming a parameter (never another exception),
valid bodies are valid ``CreateResponse`` requests, and conversations convert as the
chat template expects them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.http.errors import ApiError
from sluice.http.protocol.response_items import to_chat_messages
from sluice.http.protocol.responses import parse_responses_request
from tests.support.openapi import validate

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)

FIELDS = {
    "input": st.one_of(
        st.text(max_size=20),
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system", "developer", "x"]),
                    "content": st.text(max_size=10) | json_values,
                },
                optional={
                    "type": st.sampled_from(
                        [
                            "message",
                            "function_call",
                            "reasoning",
                            "item_reference",
                            "web_search_call",
                        ]
                    )
                },
            ),
            max_size=3,
        ),
        json_values,
    ),
    "instructions": st.none() | st.text(max_size=10) | json_values,
    "max_output_tokens": st.none() | st.integers(-5, 100) | json_values,
    "temperature": st.none() | st.floats(-1, 3) | json_values,
    "top_p": st.none() | st.floats(-1, 2),
    "top_logprobs": st.none() | st.integers(-1, 25),
    "include": st.none() | st.lists(st.sampled_from(["message.output_text.logprobs", "x"])),
    "store": st.none() | st.booleans() | json_values,
    "background": st.none() | st.booleans(),
    "stream": st.none() | st.booleans(),
    "truncation": st.none() | st.sampled_from(["auto", "disabled", "x"]),
    "metadata": st.none()
    | st.dictionaries(st.text(max_size=70), st.text(max_size=5), max_size=18)
    | json_values,
    "previous_response_id": st.none() | st.sampled_from(["resp_1", "x"]),
    "tools": st.none()
    | st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["function", "web_search", "mcp"]),
                "name": st.sampled_from(["f", "g", "bad name"]),
                # The spec requires both of a function tool; the server takes either
                # absent (a function with no arguments, not strict), which the spec
                # would then call invalid.
                "parameters": st.just({"type": "object", "properties": {}}),
                "strict": st.booleans(),
            }
        ),
        max_size=2,
    )
    | json_values,
    "tool_choice": st.none() | st.sampled_from(["auto", "none", "required", "x"]) | json_values,
    "text": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])}
            )
        },
    ),
    "reasoning": st.none()
    | st.fixed_dictionaries(
        {}, optional={"effort": st.sampled_from(["low", "x"]), "summary": st.just("auto")}
    ),
}
bodies = st.fixed_dictionaries({"model": st.just("m")}, optional={**FIELDS, "extra": json_values})


@FUZZ
@given(bodies)
def test_any_body_validates_or_is_a_400_naming_the_field(body: dict[str, Any]) -> None:
    try:
        request = parse_responses_request(body)
    except ApiError as exc:
        assert exc.status == 400 and exc.param, exc.message
        return
    # What validated is a valid request by OpenAI's spec (nulls read as absent).
    validate("CreateResponse", {k: v for k, v in body.items() if v is not None})
    assert request.input


def test_developer_reads_system_and_calls_join_their_assistant_turn() -> None:
    items = parse_responses_request(
        {
            "model": "m",
            "input": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Need the tool."}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "w",
                    "arguments": '{"c": 1}',
                },
                {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Mixed.", "annotations": []}],
                },
            ],
        }
    ).input
    assert to_chat_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": {"c": 1}},
                },
                {"id": "call_2", "type": "function", "function": {"name": "w", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Mixed."},
    ]


def test_stored_call_with_cut_arguments_goes_back_as_text() -> None:
    item = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "w",
        "arguments": '{"city": "Par',
        "status": "incomplete",
    }
    [message] = to_chat_messages([item])
    assert message["tool_calls"] == [  # type: ignore[comparison-overlap]
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "w", "arguments": '{"city": "Par'},
        }
    ]


@pytest.mark.parametrize(
    ("input_item", "param"),
    [
        ({"role": "tool", "content": "x"}, "input[0].role"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
        ({"type": "function_call_output", "call_id": "c", "output": 3}, "input[0].output"),
        (
            {"type": "reasoning", "summary": [], "encrypted_content": "zz"},
            "input[0].encrypted_content",
        ),
        (
            {"role": "user", "content": [{"type": "output_text", "text": "x"}]},
            "input[0].content[0].type",
        ),
        ({"role": "user", "content": "x", "colour": 1}, "input[0].colour"),
        ({"type": "computer_call_output", "call_id": "c"}, "input[0].type"),
    ],
)
def test_bad_items_name_the_field(input_item: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_responses_request({"model": "m", "input": [input_item]})
    assert caught.value.param == param
