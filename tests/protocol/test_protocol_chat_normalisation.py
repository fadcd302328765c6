"""Chat request normalisation: what a valid body becomes (messages, content parts,
sampling, stops, tools, response formats), without the model."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine.params import SamplingParams
from sluice.http.errors import ApiError
from sluice.http.protocol.chat import ChatRequest, parse_chat_request
from sluice.http.protocol.fields import INT64_MAX
from sluice.pipeline.template_sources import builtin_template
from sluice.pipeline.tool_calling import ToolChoice
from tests.support.chat_bodies import ASSISTANT, CALL, USER, body, parse, tool

# ------------------------------------------------------------------------ normalisation


def test_defaults() -> None:
    request = parse()
    assert request == ChatRequest(
        model="m",
        messages=({"role": "user", "content": "Hi"},),
        base_sampling=SamplingParams(max_tokens=INT64_MAX),
    )
    assert request.max_tokens is None
    assert request.sampling_for(100) == SamplingParams(max_tokens=100)
    assert (request.skip_special_tokens, request.separate_reasoning, request.stream_reasoning) == (
        True,
        True,
        True,
    )
    assert request.chat_template_kwargs == {}
    assert request.base_sampling.constraint is None


NULLABLE = [
    "max_completion_tokens", "max_tokens", "n", "stop", "seed", "temperature", "top_p",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "stream",
    "stream_options", "user", "metadata", "store", "response_format", "functions",
    "function_call", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "audio",
    "modalities", "prediction", "web_search_options", "service_tier", "prompt_cache_key",
    "safety_identifier", "verbosity", "top_k", "min_p", "repetition_penalty", "min_tokens",
    "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens",
    "spaces_between_special_tokens", "continue_final_message", "chat_template_kwargs",
    "separate_reasoning", "stream_reasoning", "regex", "ebnf", "json_schema", "stop_regex",
]  # fmt: skip


def test_nulls_mean_defaults() -> None:
    assert parse(**dict.fromkeys(NULLABLE)) == parse()


def test_harmless_values_of_refused_fields_are_accepted() -> None:
    harmless = {
        "store": False,
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "service_tier": "auto",
    }
    assert parse(**harmless) == parse()
    assert parse(service_tier="default") == parse()


GOOD_MESSAGES: list[tuple[list[dict[str, Any]], list[dict[str, object]]]] = [
    # (messages as sent, messages as the template gets them)
    ([USER], [{"role": "user", "content": "Hi"}]),
    (
        [{"role": "developer", "content": "Be brief."}, USER],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ),
    (
        [{"role": "system", "content": "", "name": "rules"}, {"role": "user", "content": ""}],
        [{"role": "system", "content": "", "name": "rules"}, {"role": "user", "content": ""}],
    ),
    (
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Hello"},
                    {"type": "text", "text": "there", "cache_control": {"type": "ephemeral"}},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
            }
        ],
    ),
    ([{"role": "user", "content": []}], [{"role": "user", "content": []}]),
    (
        # An SDK response message sent back whole: its extra keys are dropped.
        [
            USER,
            {
                "role": "assistant",
                "content": "Hello",
                "refusal": None,
                "annotations": [],
                "audio": None,
                "function_call": None,
                "tool_calls": None,
                "reasoning_content": "greeting",
            },
        ],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greeting"},
        ],
    ),
    (
        [{"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}],
        [{"role": "assistant", "content": [{"type": "text", "text": "I can't."}]}],
    ),
    ([{"role": "assistant", "content": None}], [{"role": "assistant", "content": ""}]),
    ([{"role": "assistant"}], [{"role": "assistant", "content": ""}]),
    ([{"role": "assistant", "tool_calls": []}], [{"role": "assistant", "content": ""}]),
    (
        [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "type": None}]},
            {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "call_1", "name": "f"},
        ],
        [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": {"a": 1}},
                    }
                ]
                * 2,
            },
            {"role": "tool", "content": '{"temp": 20}', "name": "f", "tool_call_id": "call_1"},
        ],
    ),
    (
        [{"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c"}],
        [{"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c"}],
    ),
    (
        [{"role": "function", "name": "f", "content": None}],
        [{"role": "function", "content": "", "name": "f"}],
    ),
    (
        # Keys a role does not use are dropped, not refused.
        [{"role": "user", "content": "Hi", "tool_call_id": 1, "reasoning_content": "x"}],
        [{"role": "user", "content": "Hi"}],
    ),
]


@pytest.mark.parametrize(("sent", "expected"), GOOD_MESSAGES)
def test_messages_are_normalised_for_the_template(
    sent: list[dict[str, Any]], expected: list[dict[str, object]]
) -> None:
    assert list(parse(messages=sent).messages) == expected


@pytest.mark.parametrize(
    ("overrides", "max_tokens"),
    [
        ({}, None),
        ({"max_tokens": 7}, 7),
        ({"max_completion_tokens": 9}, 9),
        ({"max_completion_tokens": 9, "max_tokens": 7}, 9),
        ({"max_completion_tokens": None, "max_tokens": 7}, 7),
    ],
)
def test_max_completion_tokens_wins_over_max_tokens(
    overrides: dict[str, Any], max_tokens: int | None
) -> None:
    assert parse(**overrides).max_tokens == max_tokens


def test_sampling_for_sets_the_final_length_and_checks_min_tokens() -> None:
    request = parse(min_tokens=10, temperature=0.5)
    assert request.sampling_for(10) == SamplingParams(max_tokens=10, min_tokens=10, temperature=0.5)
    with pytest.raises(ApiError) as raised:
        request.sampling_for(9)
    assert (raised.value.status, raised.value.param) == (400, "min_tokens")
    assert "min_tokens must be at most max_tokens (9), got 10" in raised.value.message


@pytest.mark.parametrize(
    ("overrides", "logprobs", "top_logprobs", "engine_logprobs"),
    [
        ({}, False, 0, None),
        ({"logprobs": False}, False, 0, None),
        ({"logprobs": True}, True, 0, 0),
        ({"logprobs": True, "top_logprobs": 5}, True, 5, 5),
        ({"logprobs": True, "top_logprobs": 20}, True, 20, 20),
        ({"logprobs": True, "top_logprobs": None}, True, 0, 0),
    ],
)
def test_logprobs(
    overrides: dict[str, Any], logprobs: bool, top_logprobs: int, engine_logprobs: int | None
) -> None:
    request = parse(**overrides)
    assert (request.logprobs, request.top_logprobs) == (logprobs, top_logprobs)
    assert request.sampling_for(16).logprobs == engine_logprobs
    assert request.sampling_for(16).prompt_logprobs is None


def test_every_field_reaches_the_request() -> None:
    request = parse(
        messages=[USER, ASSISTANT],
        max_completion_tokens=32,
        n=2,
        stop=["\n", "END"],
        seed=7,
        temperature=1e-7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"50": 100, "3": -1},
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        user="u",
        metadata={"k" * 64: "v" * 512, "team": "a"},
        reasoning_effort="low",
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=4,
        stop_token_ids=[2, 2, 7],
        ignore_eos=True,
        no_stop_trim=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=True,
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False, "nested": {"a": [1]}},
        separate_reasoning=False,
        stream_reasoning=False,
    )
    assert request == ChatRequest(
        model="m",
        messages=({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}),
        base_sampling=SamplingParams(
            max_tokens=32,
            temperature=0.0,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logit_bias=((3, -1.0), (50, 100.0)),
            seed=7,
            min_tokens=4,
            stop_token_ids=frozenset({2, 7}),
            ignore_eos=True,
            logprobs=3,
        ),
        max_tokens=32,
        max_tokens_name="max_completion_tokens",
        n=2,
        stream=True,
        include_usage=True,
        continuous_usage_stats=True,
        logprobs=True,
        top_logprobs=3,
        stop=("\n", "END"),
        no_stop_trim=True,
        skip_special_tokens=False,
        user="u",
        metadata={"k" * 64: "v" * 512, "team": "a"},
        reasoning_effort="low",
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False, "nested": {"a": [1]}},
        separate_reasoning=False,
        stream_reasoning=False,
    )
    assert request.sampling_for(32) == request.base_sampling
    assert request.sampling_for(32).greedy  # 1e-7 is below SGLang's greedy threshold


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high"])
def test_reasoning_efforts(effort: str) -> None:
    assert parse(reasoning_effort=effort).reasoning_effort == effort


def test_the_input_is_not_aliased() -> None:
    kwargs = {"enable_thinking": True}
    raw = body(chat_template_kwargs=kwargs, metadata={"k": "v"})
    request = parse_chat_request(raw)
    kwargs["enable_thinking"] = False
    assert request.chat_template_kwargs == {"enable_thinking": True}


def test_the_request_is_frozen() -> None:
    request = parse()
    with pytest.raises(AttributeError):
        request.n = 2  # type: ignore[misc]


def test_parsed_messages_render_with_a_chat_template() -> None:
    """Tool-call arguments reach the template as a mapping, which it serialises itself."""
    messages = parse(
        messages=[
            {"role": "developer", "content": "Be brief."},
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    ).messages
    prompt = builtin_template("qwen2.5").render(messages, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert '{"name": "f", "arguments": {"a": 1}}' in prompt


# ------------------------------------------------------------------------------ tools


def test_tools_and_tool_choice_are_normalised() -> None:
    request = parse(tools=[tool(description="Add", strict=True), tool(name="g", parameters=None)])
    f, g = request.tools
    assert (f.name, f.description, f.strict, dict(f.parameters)) == (
        "f",
        "Add",
        True,
        {"type": "object"},
    )
    assert (g.name, g.description, g.strict) == ("g", None, False)
    assert dict(g.parameters) == {"type": "object", "properties": {}}
    assert request.tool_choice == ToolChoice("auto")
    assert request.parallel_tool_calls is True
    assert parse().tool_choice == ToolChoice("none")
    assert parse(tool_choice="auto").tool_choice == ToolChoice("none")  # no tools: nothing to call
    named = {"type": "function", "function": {"name": "g"}}
    tools = [tool(), tool(name="g")]
    assert parse(tools=tools, tool_choice=named).tool_choice == ToolChoice("required", ("g",))
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "g"}}],
        },
    }
    assert parse(tools=tools, tool_choice=allowed).tool_choice == ToolChoice("required", ("g",))
    assert parse(tools=tools, tool_choice="none").tool_choice == ToolChoice("none")
    assert parse(tools=tools, parallel_tool_calls=False).parallel_tool_calls is False
