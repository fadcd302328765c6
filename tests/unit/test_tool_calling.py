"""Planning a request's tool calling: the prompt, the grammar and the parser."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance
import llguidance.hf
import pytest

from sluice.pipeline.errors import InvalidRequest
from sluice.pipeline.template_sources import builtin_template
from sluice.pipeline.tool_calling import (
    FunctionTool,
    ToolChoice,
    ToolSupport,
    plan_tool_calls,
)

ADD = FunctionTool(
    "add",
    "Add two integers",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    strict=True,
)
WEATHER = FunctionTool(
    "get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}
)
GENERIC = ToolSupport("json", template_renders_tools=False)
HERMES = ToolSupport("hermes", template_renders_tools=True)
USER: Mapping[str, object] = {"role": "user", "content": "Add 2 and 3"}


def plan(support: ToolSupport, choice: ToolChoice, *tools: FunctionTool, **kw: Any) -> Any:
    kw.setdefault("parallel", True)
    kw.setdefault("messages", (USER,))
    return plan_tool_calls(support, tools or (ADD, WEATHER), choice, **kw)


@pytest.fixture(scope="module")
def matcher_for(tokenizer: Any) -> Any:
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(constraint: Any, text: str) -> bool:
        kind = "lark" if constraint.kind == "lark" else "json_schema"
        matcher = llguidance.LLMatcher(
            llg_tokenizer, llguidance.grammar_from(kind, constraint.source)
        )
        assert not matcher.is_error(), matcher.get_error()
        return bool(matcher.consume_tokens(tokenizer.encode(text))) and matcher.is_accepting()

    return accepts


def test_template_support_is_recognised() -> None:
    qwen = builtin_template("qwen2.5")
    chatml = builtin_template("chatml")
    assert ToolSupport.for_template(None, qwen) == ToolSupport("hermes", True)
    assert ToolSupport.for_template(None, chatml) == GENERIC
    assert ToolSupport.for_template("json", qwen) == GENERIC
    assert ToolSupport.for_template("mistral", qwen) == ToolSupport("mistral", True)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        ToolSupport.for_template("nope", qwen)


def test_none_shows_no_tools_and_parses_nothing() -> None:
    result = plan(HERMES, ToolChoice("none"))
    assert (result.template_tools, result.constraint, result.parser) == (None, None, None)
    assert result.messages == (USER,)


def test_auto_with_a_native_template_passes_the_tools_to_it() -> None:
    result = plan(HERMES, ToolChoice("auto"), WEATHER)
    assert result.template_tools == (WEATHER.template_entry(),)
    assert (result.constraint, result.parser) == (None, "hermes")
    assert set(result.schemas) == {"get_weather"}


def test_the_generic_format_is_described_in_a_system_message() -> None:
    system = {"role": "system", "content": "Be brief."}
    result = plan(GENERIC, ToolChoice("auto"), WEATHER, messages=(system, USER))
    assert result.template_tools is None
    first = result.messages[0]
    assert first["role"] == "system"
    content = str(first["content"])
    assert content.startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in content
    assert '[{"name": "<function name>", "parameters": {<arguments as a JSON object>}}]' in content
    assert "answer the user in plain text" in content
    assert result.messages[1:] == (USER,)
    alone = plan(GENERIC, ToolChoice("required"), WEATHER).messages
    assert alone[0]["role"] == "system" and "You must call a function." in str(alone[0]["content"])


def test_the_generic_format_rewrites_call_history_as_text() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    history = (
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    )
    result = plan(GENERIC, ToolChoice("auto"), messages=history)
    assistant = result.messages[2]
    assert "tool_calls" not in assistant
    assert assistant["content"] == '[{"name": "add", "parameters": {"a": 1}}]'
    assert result.messages[3] == history[2]
    # A template that renders tools keeps the structured history.
    assert plan(HERMES, ToolChoice("auto"), messages=history).messages == history


@pytest.mark.parametrize("support", [GENERIC, HERMES], ids=["generic", "hermes"])
def test_required_forces_a_json_array_of_valid_calls(
    support: ToolSupport, matcher_for: Any
) -> None:
    result = plan(support, ToolChoice("required"))
    assert result.parser == "json" and result.constraint.kind == "json_schema"
    ok = '[{"name": "add", "parameters": {"a": 2, "b": 3}}]'
    two = ok[:-1] + ', {"name": "get_weather", "parameters": {"city": "Paris"}}]'
    assert matcher_for(result.constraint, ok)
    assert matcher_for(result.constraint, two)
    assert not matcher_for(result.constraint, "The answer is 5")
    assert not matcher_for(result.constraint, "[]")
    assert not matcher_for(result.constraint, '[{"name": "add", "parameters": {"a": "2", "b": 3}}]')
    assert not matcher_for(result.constraint, '[{"name": "sub", "parameters": {}}]')
    single = plan(support, ToolChoice("required"), parallel=False)
    assert single.max_calls == 1
    assert matcher_for(single.constraint, ok) and not matcher_for(single.constraint, two)


def test_a_named_tool_is_the_only_one_offered_and_forced(matcher_for: Any) -> None:
    result = plan(HERMES, ToolChoice("required", ("get_weather",)))
    assert result.template_tools == (WEATHER.template_entry(),)
    assert set(result.schemas) == {"get_weather"}
    assert matcher_for(
        result.constraint, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    )
    assert not matcher_for(result.constraint, '[{"name": "add", "parameters": {"a": 1, "b": 2}}]')


def test_strict_tools_under_auto_allow_text_or_valid_calls(matcher_for: Any) -> None:
    generic = plan(GENERIC, ToolChoice("auto")).constraint
    assert generic.kind == "lark"
    assert matcher_for(generic, "Five.")
    assert matcher_for(generic, '[{"name": "add", "parameters": {"a": 2, "b": 3}}]')
    assert not matcher_for(generic, '[{"name": "add", "parameters": {"a": 2}}]')
    # A non-strict tool's arguments are any object.
    assert matcher_for(generic, '[{"name": "get_weather", "parameters": {"town": 1}}]')
    hermes = plan(HERMES, ToolChoice("auto")).constraint
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert matcher_for(hermes, "No call needed.")
    assert matcher_for(hermes, "Let me add. " + call)
    assert matcher_for(hermes, call + "\n" + call)
    assert not matcher_for(
        hermes, '<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call>'
    )
    assert not matcher_for(hermes, '<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
    # Without strict tools, auto is not constrained at all.
    assert plan(HERMES, ToolChoice("auto"), WEATHER).constraint is None


def test_unframeable_formats_refuse_strict_auto_instead_of_ignoring_it() -> None:
    with pytest.raises(InvalidRequest) as raised:
        plan(ToolSupport("deepseekv3", True), ToolChoice("auto"))
    assert raised.value.param == "tools"
    assert "strict tools under tool_choice 'auto'" in raised.value.message
    assert plan(ToolSupport("deepseekv3", True), ToolChoice("required")).parser == "json"


def test_tool_grammars_do_not_combine_with_another_constraint() -> None:
    with pytest.raises(InvalidRequest, match="cannot be combined") as raised:
        plan(HERMES, ToolChoice("required"), has_constraint=True)
    assert raised.value.param == "tool_choice"
    assert plan(HERMES, ToolChoice("auto"), WEATHER, has_constraint=True).parser == "hermes"


def test_the_compact_json_grammar_rejects_runaway_whitespace(matcher_for: Any) -> None:
    constraint = plan(GENERIC, ToolChoice("required")).constraint
    assert json.loads(constraint.source)["x-guidance"]["whitespace_flexible"] is False
    assert not matcher_for(constraint, '[ {"name": "add", "parameters": {"a": 2, "b": 3}}]')


NESTED = FunctionTool(
    "book",
    None,
    {  # as pydantic writes a model with a nested model
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Place"}, "nights": {"type": "integer"}},
        "required": ["where", "nights"],
        "$defs": {
            "Place": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            }
        },
    },
    strict=True,
)


def test_tool_defs_are_lifted_so_their_references_resolve(matcher_for: Any) -> None:
    required = plan(GENERIC, ToolChoice("required"), NESTED, ADD).constraint
    assert set(json.loads(required.source)["$defs"]) == {"Place"}
    call = '[{"name": "book", "parameters": {"where": {"city": "Oslo"}, "nights": 2}}]'
    assert matcher_for(required, call)
    assert not matcher_for(required, call.replace('{"city": "Oslo"}', '{"town": "Oslo"}'))
    hermes = plan(HERMES, ToolChoice("auto"), NESTED).constraint
    arguments = '{"where": {"city": "Oslo"}, "nights": 2}'
    text = f'<tool_call>{{"name": "book", "arguments": {arguments}}}</tool_call>'
    assert matcher_for(hermes, text)
    assert not matcher_for(hermes, text.replace("Oslo", "1").replace('"1"', "1"))
    assert NESTED.parameters["$defs"]  # the request's own tool is left as it was


def test_tools_defining_one_name_differently_are_refused() -> None:
    other = FunctionTool(
        "rent",
        None,
        {"type": "object", "$defs": {"Place": {"type": "string"}}, "properties": {}},
        strict=True,
    )
    with pytest.raises(InvalidRequest, match="define \\$defs 'Place' differently") as raised:
        plan(GENERIC, ToolChoice("required"), NESTED, other)
    assert raised.value.param == "tools"
