"""Parsing ``POST /v1/chat/completions`` bodies: what is refused (and why), what is normalised."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.http.errors import ApiError
from sluice.http.protocol.chat import parse_chat_request
from tests.support.chat_bodies import CALL, DROP, USER, body, tool


def refusal(raw: object) -> ApiError:
    with pytest.raises(ApiError) as raised:
        parse_chat_request(raw)
    assert raised.value.status == 400
    assert raised.value.type == "invalid_request_error"
    return raised.value


def with_call(**changes: object) -> dict[str, object]:
    """An assistant message with one tool call, ``changes`` applied to the call."""
    call = {**CALL, **changes}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def with_function(**changes: object) -> dict[str, object]:
    function: dict[str, object] = {"name": "f", "arguments": "{}", **changes}
    return with_call(function=function)


# ----------------------------------------------------------------------------- refusals

BAD: list[tuple[dict[str, Any], str, str]] = [
    # (overrides, param, a fragment of the message)
    ({"model": DROP}, "model", "Missing required parameter: 'model'"),
    ({"model": 3}, "model", "'model' must be a string, got integer"),
    # messages
    ({"messages": DROP}, "messages", "Missing required parameter: 'messages'."),
    ({"messages": None}, "messages", "Missing required parameter: 'messages'."),
    ({"messages": []}, "messages", "Messages cannot be empty."),
    ({"messages": USER}, "messages", "'messages' must be an array, got object"),
    ({"messages": [USER, "Hi"]}, "messages[1]", "'messages[1]' must be an object, got string"),
    ({"messages": [{"content": "Hi"}]}, "messages[0].role", "Missing required parameter"),
    ({"messages": [{"role": "bot", "content": "Hi"}]}, "messages[0].role", "got 'bot'"),
    ({"messages": [{"role": "User", "content": "Hi"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": 1, "content": "Hi"}]}, "messages[0].role", "must be a string"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "Missing required parameter"),
    ({"messages": [{"role": "system", "content": None}]}, "messages[0].content", "Missing"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "got integer"),
    ({"messages": [{"role": "user", "content": {}}]}, "messages[0].content", "content parts"),
    ({"messages": [{"role": "user", "content": ["Hi"]}]}, "messages[0].content[0]", "object"),
    (
        {"messages": [{"role": "user", "content": [{"text": "Hi"}]}]},
        "messages[0].content[0].type",
        "Missing required parameter",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
        "Missing required parameter",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
        "must be a string",
    ),
    (
        {
            "messages": [
                USER,
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                    ],
                },
            ]
        },
        "messages[1].content[1].type",
        "'image_url' content parts are not supported: the model takes text only",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages[0].content[0].type",
        "the model takes text only",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
        "messages[0].content[0].type",
        "'file' content parts are not supported",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]},
        "messages[0].content[0].type",
        "the model takes text only",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
        "messages[0].content[0].type",
        "only allowed in assistant messages",
    ),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}]},
        "messages[0].content[0].refusal",
        "Missing required parameter",
    ),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id", "Missing"),
    (
        {"messages": [{"role": "tool", "content": "42", "tool_call_id": 7}]},
        "messages[0].tool_call_id",
        "must be a string",
    ),
    ({"messages": [{"role": "function", "content": "42"}]}, "messages[0].name", "Missing"),
    ({"messages": [{"role": "user", "content": "Hi", "name": 1}]}, "messages[0].name", "string"),
    (
        {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": {}}]},
        "messages[1].tool_calls",
        "'messages[1].tool_calls' must be an array, got object",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": ["call"]}]},
        "messages[0].tool_calls[0]",
        "must be an object",
    ),
    ({"messages": [with_call(id=None)]}, "messages[0].tool_calls[0].id", "Missing"),
    (
        {"messages": [with_call(type="custom")]},
        "messages[0].tool_calls[0].type",
        "only function tool calls are supported, got 'custom'",
    ),
    ({"messages": [with_call(function=None)]}, "messages[0].tool_calls[0].function", "Missing"),
    (
        {"messages": [with_call(function="f")]},
        "messages[0].tool_calls[0].function",
        "must be an object",
    ),
    (
        {"messages": [with_function(name=None)]},
        "messages[0].tool_calls[0].function.name",
        "Missing required parameter",
    ),
    (
        {"messages": [with_function(arguments=None)]},
        "messages[0].tool_calls[0].function.arguments",
        "Missing required parameter",
    ),
    (
        {"messages": [with_function(arguments={"a": 1})]},
        "messages[0].tool_calls[0].function.arguments",
        "must be a string, got object",
    ),
    *[
        (
            {"messages": [with_function(arguments=arguments)]},
            "messages[0].tool_calls[0].function.arguments",
            "must be a JSON object string",
        )
        for arguments in ["", "{", "[1]", '"x"', "null", "NaN", "[" * 5000 + "]" * 5000]
    ],
    # top-level fields
    ({"max_completion_tokens": 0}, "max_completion_tokens", "at least 1, got 0"),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens", "must be an integer"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
    ({"max_tokens": 0, "max_completion_tokens": 5}, "max_tokens", "at least 1"),
    ({"n": 0}, "n", "n must be between 1 and 128, got 0"),
    ({"n": 129}, "n", "between 1 and 128"),
    ({"temperature": 2.5}, "temperature", "between 0 and 2"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "between -2 and 2"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids"),
    ({"seed": 1.5}, "seed", "must be an integer"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "between 1 and 4 entries"),
    ({"logprobs": 1}, "logprobs", "'logprobs' must be a boolean, got integer"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs must be true when top_logprobs is given"),
    ({"top_logprobs": 0, "logprobs": False}, "top_logprobs", "logprobs must be true"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "between 0 and 20, got 21"),
    ({"top_logprobs": -1, "logprobs": True}, "top_logprobs", "between 0 and 20"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    (
        {"stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
        "must be a boolean",
    ),
    ({"user": 1}, "user", "'user' must be a string"),
    ({"metadata": []}, "metadata", "'metadata' must be an object, got array"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 pairs, got 17"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "keys must be at most 64 characters"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "at most 512 characters"),
    ({"metadata": {"k": 1}}, "metadata", "values must be strings"),
    ({"store": True}, "store", "store is not supported: chat completions are not stored"),
    ({"store": "no"}, "store", "must be a boolean"),
    (
        {"response_format": {"type": "json_object", "schema": {}}},
        "response_format.schema",
        "Unrecognized request argument supplied: response_format.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "is required for json_schema response format request",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
    ({"response_format": {}}, "response_format.type", "Missing required parameter"),
    ({"response_format": "text"}, "response_format", "must be an object"),
    (
        {"response_format": {"type": "text", "strict": True}},
        "response_format.strict",
        "Unrecognized request argument supplied: response_format.strict",
    ),
    (
        {"functions": [{"name": "f"}]},
        "functions",
        "'functions' is deprecated and not supported; use 'tools' instead",
    ),
    (
        {"function_call": "auto"},
        "function_call",
        "'function_call' is deprecated and not supported; use 'tool_choice' instead",
    ),
    # tools (SGLang's messages where it has them)
    ({"tools": {}}, "tools", "'tools' must be an array of tools, got object"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "Missing required parameter"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "'custom'"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only 'function' tools"),
    ({"tools": [tool(name="a b")]}, "tools[0].function.name", "1 to 64 characters"),
    ({"tools": [tool(name="x" * 65)]}, "tools[0].function.name", "1 to 64 characters"),
    ({"tools": [tool(parameters=[])]}, "tools[0].function.parameters", "JSON Schema object"),
    (
        {"tools": [tool(), tool(parameters={"type": "objekt"})]},
        "tools[1].function.parameters",
        "Tool 1 function has invalid 'parameters' schema: 'objekt' is not valid",
    ),
    ({"tools": [tool(), tool()]}, "tools", "'f' appears twice"),
    ({"tools": [tool(strict="yes")]}, "tools[0].function.strict", "must be a boolean"),
    ({"tools": [tool(extra=1)]}, "tools[0].function.extra", "Unrecognized request argument"),
    (
        {"tool_choice": "required"},
        "tool_choice",
        "Tools cannot be empty if tool choice is set to required.",
    ),
    (
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice",
        "Tools cannot be empty if tool choice is set to a specific tool.",
    ),
    (
        {"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
        "Tool 'g' not found in tools list.",
    ),
    ({"tools": [tool()], "tool_choice": "sometimes"}, "tool_choice", "must be one of none, auto"),
    ({"tools": [tool()], "tool_choice": {"type": "custom"}}, "tool_choice.type", "'custom'"),
    (
        {
            "tools": [tool()],
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}},
        },
        "tool_choice.allowed_tools.mode",
        "auto or required",
    ),
    (
        {
            "tools": [tool()],
            "tool_choice": {
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "auto",
                    "tools": [{"type": "function", "function": {"name": "g"}}],
                },
            },
        },
        "tool_choice",
        "Tool 'g' not found in tools list.",
    ),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "must be one of none, minimal"),
    ({"reasoning_effort": 0.5}, "reasoning_effort", "must be a string"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities", "only the text modality is supported"),
    ({"modalities": "text"}, "modalities", "'modalities' must be an array, got string"),
    ({"modalities": [1]}, "modalities", "only the text modality"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "web_search_options is not supported"),
    ({"service_tier": "flex"}, "service_tier", "service_tier 'flex' is not supported"),
    ({"service_tier": 1}, "service_tier", "must be a string"),
    ({"prompt_cache_key": ""}, "prompt_cache_key", "must be 1 to 1024 characters, got 0"),
    ({"prompt_cache_key": 3}, "prompt_cache_key", "must be a string"),
    ({"safety_identifier": "s"}, "safety_identifier", "not supported"),
    ({"verbosity": "low"}, "verbosity", "verbosity is not supported"),
    # SGLang extensions
    ({"top_k": 0}, "top_k", "top_k must be -1 (disabled) or at least 1"),
    ({"min_p": 2}, "min_p", "between 0 and 1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "at most max_tokens (4), got 5"),
    ({"min_tokens": 5, "max_completion_tokens": 4, "max_tokens": 9}, "min_tokens", "(4)"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "at least 0"),
    ({"ignore_eos": 1}, "ignore_eos", "must be a boolean"),
    ({"no_stop_trim": 1}, "no_stop_trim", "must be a boolean"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "must be a boolean"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "not supported"),
    ({"stop_regex": "a+"}, "stop_regex", "stop_regex is not supported yet"),
    ({"continue_final_message": 1}, "continue_final_message", "must be a boolean"),
    (
        {"continue_final_message": True},
        "continue_final_message",
        "continue_final_message needs an assistant message last, got 'user'",
    ),
    ({"chat_template_kwargs": []}, "chat_template_kwargs", "must be an object, got array"),
    ({"separate_reasoning": "yes"}, "separate_reasoning", "must be a boolean"),
    ({"stream_reasoning": 0}, "stream_reasoning", "must be a boolean"),
    ({"regex": "a("}, "regex", "Invalid regex"),
    ({"ebnf": "root ::= 'a'"}, "ebnf", "Invalid EBNF grammar"),
    ({"json_schema": "[]"}, "json_schema", "Invalid JSON schema"),
    ({"prompt": "Hi"}, "prompt", "Unrecognized request argument supplied: prompt"),
    ({"echo": True}, "echo", "Unrecognized request argument supplied: echo"),
    ({"best_of": 2}, "best_of", "Unrecognized request argument supplied: best_of"),
]


@pytest.mark.parametrize(
    ("overrides", "param", "fragment"), BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)]
)
def test_bad_fields_are_refused_naming_the_param(
    overrides: dict[str, Any], param: str, fragment: str
) -> None:
    error = refusal(body(**overrides))
    assert error.param == param
    assert fragment in error.message


@pytest.mark.parametrize("raw", [[], "text", 1, None, True])
def test_the_body_must_be_an_object(raw: object) -> None:
    error = refusal(raw)
    assert error.param is None
    assert "must be a JSON object" in error.message


def test_long_values_are_not_echoed_in_full() -> None:
    for overrides in (
        {"messages": [{"role": "x" * 10_000, "content": "Hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "x" * 10_000}]}]},
        {"reasoning_effort": "x" * 10_000},
        {"service_tier": "x" * 10_000},
        {"response_format": {"type": "x" * 10_000}},
    ):
        assert len(refusal(body(**overrides)).message) < 200
